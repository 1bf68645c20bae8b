// Slot update: the GRAD / FLUSH state machine of docs/protocol.md on one slot.
// Decisions are one const table (`branch`): each action is a branch of the contract, named as its
// counter, and says what to write, what to do with the K accumulators and whether a RESULT leaves.
#ifndef LTA_SLOT_UPDATE
#define LTA_SLOT_UPDATE

#include "headers.p4"
#include "slot_elements.gen.p4"

const bit<2> SEQ_OLDER = 0;  // q < seq[s]
const bit<2> SEQ_SAME = 1;   // q == seq[s]
const bit<2> SEQ_NEWER = 2;  // q > seq[s]

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
    register<bit<8>>(LTA_SLOT_CAPACITY) slot_owner;
    SlotElements() elements;

    bit<32> generation;
    bit<2> seq_order;
    bit<1> seen;       // this worker's bit is already in the round's bitmap
    bit<1> mismatch;   // exponent or MAX flag differ from the round's

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
        slot_owner.write(meta.slot_index, meta.slot.owner);
    }

    action grad_start() {
        meta.branch = BRANCH_GRAD_START;
        meta.slot.seq = hdr.lta.seq;
        meta.slot.closed = 0;
        meta.slot.count = 1;
        meta.slot.bitmap = ((bit<64>)1) << hdr.lta.worker_id;
        meta.slot.weight = hdr.lta.weight;
        meta.slot.exp = hdr.lta.exp;
        meta.slot.flags = hdr.lta.flags & (FLAG_MAX | FLAG_SATURATED | FLAG_OWNER);
        meta.slot.owner = hdr.lta.count;  // a worker's GRAD names an OWNER round's owner in count
        meta.slot.nelem = hdr.lta.nelem;
        meta.slot.step = hdr.lta.step;
        meta.slot.chunk = hdr.lta.chunk;
        meta.element_op = ELEMENT_OP_STORE;
        meta.write_slot = true;
        meta.check_quorum = true;
    }
    action grad_add() {
        meta.branch = BRANCH_GRAD_ADD;
        meta.slot.count = meta.slot.count + 1;
        meta.slot.bitmap = meta.slot.bitmap | (((bit<64>)1) << hdr.lta.worker_id);
        meta.slot.weight = meta.slot.weight + hdr.lta.weight;
        meta.slot.flags = meta.slot.flags | (hdr.lta.flags & FLAG_SATURATED);
        meta.element_op = ((meta.slot.flags & FLAG_MAX) != 0) ? ELEMENT_OP_MAX : ELEMENT_OP_ADD;
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
        meta.slot.flags = hdr.lta.flags & (FLAG_MAX | FLAG_OWNER);
        meta.slot.owner = hdr.lta.count;
        meta.slot.nelem = hdr.lta.nelem;
        meta.slot.step = hdr.lta.step;
        meta.slot.chunk = hdr.lta.chunk;
        meta.slot.closer = hdr.lta.worker_id;
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

    // The whole state machine; the first matching entry wins.
    table branch {
        key = {
            hdr.lta.op: exact @name("op");
            seq_order: exact @name("seq_order");
            meta.slot.closed: ternary @name("closed");
            seen: ternary @name("seen");
            mismatch: ternary @name("mismatch");
        }
        actions = {
            grad_start; grad_add; grad_late_resend; grad_dup; grad_exp_mismatch; grad_stale;
            flush_empty; flush_partial; flush_resend; flush_stale; NoAction;
        }
        const entries = {
            (OP_GRAD, SEQ_NEWER, _, _, _): grad_start();
            (OP_GRAD, SEQ_SAME, 1, _, _): grad_late_resend();
            (OP_GRAD, SEQ_SAME, 0, 1, _): grad_dup();
            (OP_GRAD, SEQ_SAME, 0, 0, 1): grad_exp_mismatch();
            (OP_GRAD, SEQ_SAME, 0, 0, 0): grad_add();
            (OP_GRAD, SEQ_OLDER, _, _, _): grad_stale();
            (OP_FLUSH, SEQ_NEWER, _, _, _): flush_empty();
            (OP_FLUSH, SEQ_SAME, 0, _, _): flush_partial();
            (OP_FLUSH, SEQ_SAME, 1, _, _): flush_resend();
            (OP_FLUSH, SEQ_OLDER, _, _, _): flush_stale();
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
        seen = (bit<1>)(meta.slot.bitmap >> hdr.lta.worker_id);
        mismatch = (hdr.lta.exp != meta.slot.exp || ((hdr.lta.flags ^ meta.slot.flags) & FLAG_MAX) != 0)
            ? (bit<1>)1 : (bit<1>)0;
        branch.apply();

        if (meta.check_quorum && meta.slot.count >= meta.quorum) {
            meta.slot.closed = 1;
            meta.slot.closer = hdr.lta.worker_id;
            meta.result_quorum = true;
            meta.emit = EMIT_MULTICAST;
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
