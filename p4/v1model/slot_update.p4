// Slot update: the GRAD / FLUSH state machine of docs/protocol.md on one slot, in each role (flat, leaf,
// spine: "Hierarchy"), and a leaf's RESULT from its uplink.
// Decisions are one const table (`branch`): each action is a branch of the contract, named as its
// counter, and says what to write, what to do with the K accumulators and whether a RESULT leaves.
// A packet contributes `contrib_count` workers (`contrib_bitmap`): one, the sender, at a flat switch or
// a leaf; a leaf's whole partial (its header's count and bitmap) at a spine.
#ifndef LTA_SLOT_UPDATE
#define LTA_SLOT_UPDATE

#include "headers.p4"
#include "slot_elements.gen.p4"

const bit<2> SEQ_OLDER = 0;  // q < seq[s]
const bit<2> SEQ_SAME = 1;   // q == seq[s]
const bit<2> SEQ_NEWER = 2;  // q > seq[s]

// The number of set bits of x (BMv2 has no popcount): pairs, nibbles, then bytes summed by shifts.
bit<8> popcount64(in bit<64> x) {
    bit<64> c = x - ((x >> 1) & 0x5555555555555555);
    c = (c & 0x3333333333333333) + ((c >> 2) & 0x3333333333333333);
    c = (c + (c >> 4)) & 0x0f0f0f0f0f0f0f0f;
    c = c + (c >> 8);
    c = c + (c >> 16);
    c = c + (c >> 32);
    return (bit<8>)(c & 0x7f);
}

control SlotUpdate(inout headers_t hdr, inout lta_metadata_t meta) {
    register<bit<32>>(LTA_SLOT_CAPACITY) slot_seq;
    register<bit<32>>(LTA_SLOT_CAPACITY) slot_generation;
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_closed;
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_count;
    register<bit<64>>(LTA_SLOT_CAPACITY) slot_bitmap;
    register<bit<32>>(LTA_SLOT_CAPACITY) slot_weight;
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_exp;
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_flags;
    register<bit<16>>(LTA_SLOT_CAPACITY) slot_nelem;
    register<bit<32>>(LTA_SLOT_CAPACITY) slot_step;
    register<bit<32>>(LTA_SLOT_CAPACITY) slot_chunk;
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_closer;
    register<bit<32>>(LTA_SLOT_CAPACITY) slot_parts;
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_leaf_state;
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_owner;
    SlotElements() elements;

    bit<32> generation;
    bit<2> seq_order;
    bit<1> seen;       // this worker's bit (a spine: this leaf's part) is already in the round
    bit<1> overlap;    // a spine: one of the partial's workers is already in the round's bitmap
    bit<1> mismatch;   // both the round and the packet carry values, and exponent or MAX flag differ
    bit<1> retx;       // the packet's RETX flag (a leaf: a worker's repeated FLUSH; ignored elsewhere)
    bit<8> contrib_count;
    bit<64> contrib_bitmap;
    bit<32> contrib_part;  // a spine: 1 << leaf id; else 0
    bit<8> owner_flag;  // FLAG_OWNER at a flat switch; 0 at a leaf or a spine (OWNER is ignored there)
    bit<8> owner;       // a flat switch: the owner a worker's GRAD or FLUSH names in its count; else 0
    bool takes;        // a round with count 0 takes the packet's values, exponent and MAX flag

    action read_slot() {
        slot_generation.read(generation, meta.slot_index);
        slot_seq.read(meta.slot.seq, meta.slot_index);
        slot_closed.read(meta.slot.closed, meta.slot_index);
        slot_count.read(meta.slot.count, meta.slot_index);
        slot_bitmap.read(meta.slot.bitmap, meta.slot_index);
        slot_weight.read(meta.slot.weight, meta.slot_index);
        slot_exp.read(meta.slot.exp, meta.slot_index);
        slot_flags.read(meta.slot.flags, meta.slot_index);
        slot_nelem.read(meta.slot.nelem, meta.slot_index);
        slot_step.read(meta.slot.step, meta.slot_index);
        slot_chunk.read(meta.slot.chunk, meta.slot_index);
        slot_closer.read(meta.slot.closer, meta.slot_index);
        slot_parts.read(meta.slot.parts, meta.slot_index);
        slot_leaf_state.read(meta.slot.leaf_state, meta.slot_index);
        slot_owner.read(meta.slot.owner, meta.slot_index);
    }
    // A slot last written under another generation (a reset or a re-added job) is a never-used slot.
    action forget_slot() {
        meta.slot.seq = 0;
        meta.slot.closed = 0;
        meta.slot.count = 0;
        meta.slot.bitmap = 0;
        meta.slot.weight = 0;
        meta.slot.exp = 0;
        meta.slot.flags = 0;
        meta.slot.nelem = 0;
        meta.slot.step = 0;
        meta.slot.chunk = 0;
        meta.slot.closer = 0;
        meta.slot.parts = 0;
        meta.slot.leaf_state = LEAF_PARTIAL;
        meta.slot.owner = 0;
    }
    action write_slot() {
        slot_generation.write(meta.slot_index, meta.generation);
        slot_seq.write(meta.slot_index, meta.slot.seq);
        slot_closed.write(meta.slot_index, meta.slot.closed);
        slot_count.write(meta.slot_index, meta.slot.count);
        slot_bitmap.write(meta.slot_index, meta.slot.bitmap);
        slot_weight.write(meta.slot_index, meta.slot.weight);
        slot_exp.write(meta.slot_index, meta.slot.exp);
        slot_flags.write(meta.slot_index, meta.slot.flags);
        slot_nelem.write(meta.slot_index, meta.slot.nelem);
        slot_step.write(meta.slot_index, meta.slot.step);
        slot_chunk.write(meta.slot_index, meta.slot.chunk);
        slot_closer.write(meta.slot_index, meta.slot.closer);
        slot_parts.write(meta.slot_index, meta.slot.parts);
        slot_leaf_state.write(meta.slot_index, meta.slot.leaf_state);
        slot_owner.write(meta.slot_index, meta.slot.owner);
    }

    action grad_start() {
        meta.branch = BRANCH_GRAD_START;
        meta.slot.seq = hdr.lta.seq;
        meta.slot.closed = 0;
        meta.slot.count = contrib_count;
        meta.slot.bitmap = contrib_bitmap;
        meta.slot.weight = hdr.lta.weight;
        meta.slot.exp = hdr.lta.exp;
        meta.slot.flags = hdr.lta.flags & (FLAG_MAX | FLAG_SATURATED | owner_flag);
        meta.slot.owner = owner;
        meta.slot.nelem = hdr.lta.nelem;
        meta.slot.step = hdr.lta.step;
        meta.slot.chunk = hdr.lta.chunk;
        meta.slot.parts = contrib_part;
        meta.slot.leaf_state = LEAF_PARTIAL;
        meta.element_op = (contrib_count == 0) ? ELEMENT_OP_CLEAR : ELEMENT_OP_STORE;  // an empty partial
        meta.write_slot = true;
        meta.check_quorum = true;
    }
    action grad_add() {
        meta.branch = BRANCH_GRAD_ADD;
        // An empty partial adds no values (LOAD: a RESULT it closes carries the accumulators).
        meta.element_op = (contrib_count == 0) ? ELEMENT_OP_LOAD
            : (takes ? ELEMENT_OP_STORE : (((meta.slot.flags & FLAG_MAX) != 0) ? ELEMENT_OP_MAX : ELEMENT_OP_ADD));
        meta.slot.exp = takes ? hdr.lta.exp : meta.slot.exp;
        meta.slot.flags = takes ? ((meta.slot.flags & FLAG_SATURATED) | (hdr.lta.flags & FLAG_MAX)) : meta.slot.flags;
        meta.slot.count = meta.slot.count + contrib_count;
        meta.slot.bitmap = meta.slot.bitmap | contrib_bitmap;
        meta.slot.parts = meta.slot.parts | contrib_part;
        meta.slot.weight = meta.slot.weight + hdr.lta.weight;
        meta.slot.flags = meta.slot.flags | (hdr.lta.flags & FLAG_SATURATED);
        meta.write_slot = true;
        meta.check_quorum = true;
    }
    action grad_late_resend() {
        meta.branch = BRANCH_GRAD_LATE_RESEND;
        meta.element_op = ELEMENT_OP_LOAD;
        meta.emit = EMIT_RESEND;
    }
    action grad_dup() {
        meta.branch = BRANCH_GRAD_DUP;
    }
    action grad_exp_mismatch() {
        meta.branch = BRANCH_GRAD_EXP_MISMATCH;
    }
    action grad_stale() {
        meta.branch = BRANCH_GRAD_STALE;
    }
    action flush_empty() {
        meta.branch = BRANCH_FLUSH_EMPTY;
        meta.slot.seq = hdr.lta.seq;
        meta.slot.closed = 1;
        meta.slot.count = 0;
        meta.slot.bitmap = 0;
        meta.slot.weight = 0;
        meta.slot.exp = hdr.lta.exp;
        meta.slot.flags = hdr.lta.flags & (FLAG_MAX | owner_flag);
        meta.slot.owner = owner;
        meta.slot.nelem = hdr.lta.nelem;
        meta.slot.step = hdr.lta.step;
        meta.slot.chunk = hdr.lta.chunk;
        meta.slot.closer = hdr.lta.worker_id;
        meta.slot.parts = 0;
        meta.slot.leaf_state = LEAF_PARTIAL;  // a leaf: its partial gets one more try at a first-try FLUSH
        meta.element_op = ELEMENT_OP_CLEAR;
        meta.write_slot = true;
        meta.emit = EMIT_MULTICAST;
    }
    action flush_partial() {
        meta.branch = BRANCH_FLUSH_PARTIAL;
        meta.slot.closed = 1;
        meta.slot.closer = hdr.lta.worker_id;
        meta.element_op = ELEMENT_OP_LOAD;
        meta.write_slot = true;
        meta.emit = EMIT_MULTICAST;
    }
    action flush_resend() {
        meta.branch = BRANCH_FLUSH_RESEND;
        meta.element_op = ELEMENT_OP_LOAD;
        meta.emit = EMIT_RESEND;
    }
    action flush_stale() {
        meta.branch = BRANCH_FLUSH_STALE;
    }

    // ---- a leaf: its closed partial again to the uplink (a worker asks for a round not answered yet)
    action up_resend_grad() {
        meta.branch = BRANCH_UP_RESEND;
        meta.element_op = ELEMENT_OP_LOAD;
        meta.emit = EMIT_UP;
        meta.up_op = OP_GRAD;
        meta.retx = true;
    }
    // A FLUSH of a round closed here, unanswered: a worker's repeated FLUSH (RETX) sends the partial up
    // as a FLUSH (closes the spine); a first-try FLUSH as a GRAD, once (leaf_state 0 -> 1).
    action up_resend_flush(bit<8> up_op) {
        up_resend_grad();
        meta.up_op = up_op;
        meta.slot.leaf_state = LEAF_FLUSHED;
        meta.write_slot = true;
    }
    // A first-try FLUSH of a round whose partial went up again at an earlier FLUSH: nothing is sent.
    action up_held() {
        meta.branch = BRANCH_UP_HELD;
    }
    // ---- a leaf: the spine's RESULT from the uplink, stored as the slot's final round and multicast
    action down_result() {
        meta.branch = BRANCH_DOWN_RESULT;
        meta.slot.seq = hdr.lta.seq;
        meta.slot.closed = 1;
        meta.slot.count = hdr.lta.count;
        meta.slot.bitmap = hdr.lta.bitmap;
        meta.slot.weight = hdr.lta.weight;
        meta.slot.exp = hdr.lta.exp;
        meta.slot.flags = hdr.lta.flags & (FLAG_MAX | FLAG_SATURATED);
        meta.slot.nelem = hdr.lta.nelem;
        meta.slot.step = hdr.lta.step;
        meta.slot.chunk = hdr.lta.chunk;
        meta.slot.closer = hdr.lta.worker_id;
        meta.slot.parts = 0;
        meta.slot.leaf_state = LEAF_FINAL;
        meta.slot.owner = 0;  // the spine's RESULT goes to all the leaf's workers (OWNER is not kept)
        meta.element_op = ELEMENT_OP_STORE;
        meta.write_slot = true;
        meta.emit = EMIT_MULTICAST;
        meta.retx = (hdr.lta.flags & FLAG_RETX) != 0;
    }
    action down_stale() {
        meta.branch = BRANCH_DOWN_STALE;
    }
    // ---- a spine: FLUSH (a leaf's partial) adds the partial if the round lacks it, then closes
    action spine_flush_start() {
        grad_start();
        meta.branch = (contrib_count == 0) ? BRANCH_FLUSH_EMPTY : BRANCH_FLUSH_PARTIAL;
        meta.slot.closed = 1;
        meta.slot.closer = hdr.lta.worker_id;
        meta.check_quorum = false;
        meta.emit = EMIT_MULTICAST;
    }
    action spine_flush_add() {
        grad_add();
        meta.branch = BRANCH_FLUSH_PARTIAL;
        meta.slot.closed = 1;
        meta.slot.closer = hdr.lta.worker_id;
        meta.check_quorum = false;
        meta.emit = EMIT_MULTICAST;
    }
    // The leaf's partial is in already, or is not added (`also`: grad_dup, grad_exp_mismatch): close.
    action spine_flush_close(bit<8> also) {
        meta.branch = BRANCH_FLUSH_PARTIAL;
        meta.also = also;
        meta.slot.closed = 1;
        meta.slot.closer = hdr.lta.worker_id;
        meta.element_op = ELEMENT_OP_LOAD;
        meta.write_slot = true;
        meta.emit = EMIT_MULTICAST;
    }

    // The whole state machine; the first matching entry wins.
    table branch {
        key = {
            hdr.lta.op: exact @name("op");
            meta.role: ternary @name("role");
            seq_order: exact @name("seq_order");
            meta.slot.closed: ternary @name("closed");
            meta.slot.leaf_state: ternary @name("leaf_state");
            seen: ternary @name("seen");
            overlap: ternary @name("overlap");
            mismatch: ternary @name("mismatch");
            retx: ternary @name("retx");
        }
        actions = {
            grad_start; grad_add; grad_late_resend; grad_dup; grad_exp_mismatch; grad_stale;
            flush_empty; flush_partial; flush_resend; flush_stale;
            up_resend_grad; up_resend_flush; up_held; down_result; down_stale;
            spine_flush_start; spine_flush_add; spine_flush_close; NoAction;
        }
        const entries = {
            // (op, role, seq_order, closed, leaf_state, seen, overlap, mismatch, retx)
            (OP_GRAD, _, SEQ_NEWER, _, _, _, _, _, _): grad_start();
            (OP_GRAD, ROLE_LEAF, SEQ_SAME, 1, LEAF_FINAL, _, _, _, _): grad_late_resend();
            (OP_GRAD, ROLE_LEAF, SEQ_SAME, 1, _, _, _, _, _): up_resend_grad();
            (OP_GRAD, _, SEQ_SAME, 1, _, _, _, _, _): grad_late_resend();
            (OP_GRAD, _, SEQ_SAME, 0, _, 1, _, _, _): grad_dup();
            (OP_GRAD, _, SEQ_SAME, 0, _, 0, 1, _, _): grad_dup();
            (OP_GRAD, _, SEQ_SAME, 0, _, 0, 0, 1, _): grad_exp_mismatch();
            (OP_GRAD, _, SEQ_SAME, 0, _, 0, 0, 0, _): grad_add();
            (OP_GRAD, _, SEQ_OLDER, _, _, _, _, _, _): grad_stale();
            (OP_FLUSH, _, SEQ_OLDER, _, _, _, _, _, _): flush_stale();
            (OP_FLUSH, ROLE_SPINE, SEQ_NEWER, _, _, _, _, _, _): spine_flush_start();
            (OP_FLUSH, _, SEQ_NEWER, _, _, _, _, _, _): flush_empty();
            (OP_FLUSH, ROLE_LEAF, SEQ_SAME, 1, LEAF_FINAL, _, _, _, _): flush_resend();
            (OP_FLUSH, ROLE_LEAF, SEQ_SAME, 1, _, _, _, _, 1): up_resend_flush(OP_FLUSH);
            (OP_FLUSH, ROLE_LEAF, SEQ_SAME, 1, LEAF_PARTIAL, _, _, _, 0): up_resend_flush(OP_GRAD);
            (OP_FLUSH, ROLE_LEAF, SEQ_SAME, 1, LEAF_FLUSHED, _, _, _, 0): up_held();
            (OP_FLUSH, _, SEQ_SAME, 1, _, _, _, _, _): flush_resend();
            (OP_FLUSH, ROLE_SPINE, SEQ_SAME, 0, _, 1, _, _, _): spine_flush_close(BRANCH_NONE);
            (OP_FLUSH, ROLE_SPINE, SEQ_SAME, 0, _, 0, 1, _, _): spine_flush_close(BRANCH_GRAD_DUP);
            (OP_FLUSH, ROLE_SPINE, SEQ_SAME, 0, _, 0, 0, 1, _): spine_flush_close(BRANCH_GRAD_EXP_MISMATCH);
            (OP_FLUSH, ROLE_SPINE, SEQ_SAME, 0, _, 0, 0, 0, _): spine_flush_add();
            (OP_FLUSH, _, SEQ_SAME, 0, _, _, _, _, _): flush_partial();
            (OP_RESULT, ROLE_LEAF, SEQ_OLDER, _, _, _, _, _, _): down_stale();
            (OP_RESULT, ROLE_LEAF, SEQ_SAME, _, _, _, _, _, _): down_result();
            (OP_RESULT, ROLE_LEAF, SEQ_NEWER, _, _, _, _, _, _): down_result();
        }
        default_action = NoAction();
    }

    apply {
        meta.slot_index = meta.slot_base + (bit<32>)hdr.lta.slot;
        read_slot();
        bool fresh = generation != meta.generation;
        if (fresh) {
            forget_slot();
        }
        if (hdr.lta.seq > meta.slot.seq) {
            seq_order = SEQ_NEWER;
        } else if (hdr.lta.seq == meta.slot.seq) {
            seq_order = SEQ_SAME;
        } else {
            seq_order = SEQ_OLDER;
        }
        bool spine = meta.role == ROLE_SPINE;
        if (spine) {  // a leaf's partial: its count and bitmap; the leaf is one part
            contrib_count = hdr.lta.count;
            contrib_bitmap = hdr.lta.bitmap;
            contrib_part = ((bit<32>)1) << hdr.lta.worker_id;
            seen = (bit<1>)(meta.slot.parts >> hdr.lta.worker_id);
            overlap = ((meta.slot.bitmap & hdr.lta.bitmap) != 0) ? (bit<1>)1 : (bit<1>)0;
        } else {  // a worker: itself
            contrib_count = 1;
            contrib_bitmap = ((bit<64>)1) << hdr.lta.worker_id;
            contrib_part = 0;
            seen = (bit<1>)(meta.slot.bitmap >> hdr.lta.worker_id);
            overlap = 0;
        }
        retx = ((hdr.lta.flags & FLAG_RETX) != 0) ? (bit<1>)1 : (bit<1>)0;
        // Owner-only RESULT: a flat job's only. At a spine `count` is a partial's count, not an owner.
        owner_flag = (meta.role == ROLE_FLAT) ? FLAG_OWNER : (bit<8>)0;
        owner = (meta.role == ROLE_FLAT) ? hdr.lta.count : (bit<8>)0;
        takes = meta.slot.count == 0 && contrib_count != 0;
        mismatch = (meta.slot.count != 0 && contrib_count != 0 && (hdr.lta.exp != meta.slot.exp
                    || ((hdr.lta.flags ^ meta.slot.flags) & FLAG_MAX) != 0)) ? (bit<1>)1 : (bit<1>)0;
        branch.apply();

        // A spine's quorum counts leaves (parts), any other's counts workers.
        bit<8> have = spine ? popcount64((bit<64>)meta.slot.parts) : meta.slot.count;
        // A duplicate into an open round that a lowered quorum (liveness) left at its quorum closes it,
        // as the GRAD that reached the quorum would have (still counted grad_dup, and result_quorum).
        if (meta.branch == BRANCH_GRAD_DUP && have >= meta.quorum) {
            meta.check_quorum = true;
            meta.element_op = ELEMENT_OP_LOAD;
            meta.write_slot = true;
        }
        if (meta.check_quorum && have >= meta.quorum) {
            meta.slot.closed = 1;
            meta.slot.closer = hdr.lta.worker_id;
            meta.result_quorum = true;
            meta.emit = EMIT_MULTICAST;
        }
        // A leaf does not answer its workers: a round it closes (quorum, FLUSH) goes up as its partial.
        if (meta.role == ROLE_LEAF && meta.emit == EMIT_MULTICAST && hdr.lta.op != OP_RESULT) {
            meta.emit = EMIT_UP;
            meta.up_op = OP_GRAD;
            meta.also = BRANCH_UP_PARTIAL;
        }
        if (meta.write_slot) {
            write_slot();
        }
        // A forgotten slot's accumulators hold another generation's values: they count as zero.
        if (fresh && meta.element_op == ELEMENT_OP_ADD) {
            meta.element_op = ELEMENT_OP_STORE;
        } else if (fresh && meta.element_op == ELEMENT_OP_LOAD) {
            meta.element_op = ELEMENT_OP_CLEAR;
        }
        elements.apply(hdr.payload, meta.slot_index, meta.element_op);
    }
}

#endif
