// Slot update (Tofino): the GRAD / FLUSH state machine of docs/protocol.md on one slot, in the control
// pass, and the reads of the stored RESULT fields in the element and harvest passes.
// Tofino lets a pass touch each register once, through one stateful ALU that returns one 32-bit word,
// so the slot is four registers read in dependency order, each updated by the same access that reads it:
//   slot_seq     {seq, round: exp | MAX << 8 | FLUSHED << 9}   order of q against seq; exp check; FLUSH
//   slot_bitmap  raw bitmap: test-and-set of the sender's bit  (duplicates)
//   slot_count   {count, weight}, add only while count < quorum (quorum closure is atomic here)
//   slot_result  {bitmap at closure, CLOSED | closer << 8 | SATURATED}
// A late GRAD to a round closed by quorum still sets its bit in slot_bitmap (that register is read before
// slot_count says the round is closed); RESULTs therefore take their bitmap from slot_result, written at
// closure, never from slot_bitmap.
#ifndef LTA_SLOT_UPDATE
#define LTA_SLOT_UPDATE

#include "headers.p4"
#include "slot_elements.gen.p4"

// slot_seq's answer in the control pass: the round's word when q == seq, else one of these codes.
const bit<32> ROUND_NEWER = 0x80000000;  // q > seq: the register now holds round q
const bit<32> ROUND_OLDER = 0x40000000;  // q < seq
const bit<32> ROUND_EXP_MASK = 0x1ff;    // exp and MAX: must equal the packet's to add
const bit<32> ROUND_MAX = 0x100;
const bit<32> ROUND_FLUSHED = 0x200;
// slot_count's answer when the round already has its quorum: nothing added.
const bit<32> COUNT_NOT_ADDED = 0xffffffff;
// slot_result's hi word.
const bit<32> RESULT_CLOSED = 0x80000000;

// Accesses (each register has one table choosing its register action from these codes).
const bit<8> ACCESS_NONE = 0;
const bit<8> ACCESS_GRAD = 1;     // slot_seq
const bit<8> ACCESS_FLUSH = 2;    // slot_seq
const bit<8> ACCESS_SET = 3;      // slot_bitmap, slot_count, slot_result: a new round
const bit<8> ACCESS_TEST_SET = 4; // slot_bitmap
const bit<8> ACCESS_ADD = 5;      // slot_count
const bit<8> ACCESS_OR_CLOSE = 6; // slot_result
const bit<8> ACCESS_READ_LO = 7;  // every register: the lo word (slot_seq: the round word)
const bit<8> ACCESS_READ_HI = 8;
const bit<8> ACCESS_HARVEST = 10; // slot_result in the harvest pass: read hi into the header
const bit<8> ACCESS_CLEAR = 9;    // slot_bitmap: a new round opened by FLUSH (empty)

control SlotUpdate(inout headers_t hdr, inout ingress_metadata_t meta) {
    WorkerBit() worker_bit;
    Register<bit<32>, bit<16>>(LTA_SLOT_CAPACITY) slot_seq;
    Register<bit<32>, bit<16>>(LTA_SLOT_CAPACITY) slot_round;
    Register<bit<32>, bit<16>>(LTA_SLOT_CAPACITY) slot_bitmap;
    Register<slot_pair_t, bit<16>>(LTA_SLOT_CAPACITY) slot_count;
    Register<slot_pair_t, bit<16>>(LTA_SLOT_CAPACITY) slot_result;

    bit<32> packet_round;  // exp | MAX << 8 of this packet
    bit<32> old_seq;       // slot_seq's answer: the seq it held
    bit<32> round;         // slot_round's answer (ROUND_NEWER / ROUND_OLDER when q differs)
    bit<32> old_bitmap;
    bit<32> count;         // slot_count's answer
    bit<32> result_hi;     // slot_result's answer
    bit<32> result_flags;  // what slot_result's hi takes (ORed, or set on a new round)
    bit<32> closed_flags;  // RESULT_CLOSED | worker_id << 8 (from WorkerBit's table)
    bit<1>  closing;
    bit<8>  seq_access;
    bit<8>  round_access;
    bit<8>  bitmap_access;
    bit<8>  count_access;
    bit<8>  result_access;

    // ---- slot_seq: the round number; slot_round: exp | MAX << 8 | FLUSHED << 9 ----------------------
    // A stateful ALU answers one word from one source (memory, its ALU, or its predicate), so slot_seq
    // answers the seq it held and the order of q against it is decided from that answer; slot_round,
    // the next register, is then written (a new round), read, or read and marked FLUSHED.
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_seq) seq_order = {
        void apply(inout bit<32> value, out bit<32> rv) {
            rv = value;
            if (hdr.lta.seq > value) {
                value = hdr.lta.seq;
            }
        }
    };
    action do_seq_order() { old_seq = seq_order.execute(meta.slot_index); }
    table seq_access_table {
        key = { seq_access: exact @name("access"); }
        actions = { do_seq_order; NoAction; }
        const entries = {
            ACCESS_GRAD: do_seq_order();
            ACCESS_FLUSH: do_seq_order();
        }
        const default_action = NoAction();
        size = 4;
    }

    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_round) round_set = {
        void apply(inout bit<32> value, out bit<32> rv) { value = packet_round; rv = value; }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_round) round_read = {
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_round) round_flush = {
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; value = value | ROUND_FLUSHED; }
    };
    action do_round_set() { round = round_set.execute(meta.slot_index); }
    action do_round_read() { round = round_read.execute(meta.slot_index); }
    action do_round_flush() { round = round_flush.execute(meta.slot_index); }
    table round_access_table {
        key = { round_access: exact @name("access"); }
        actions = { do_round_set; do_round_read; do_round_flush; NoAction; }
        const entries = {
            ACCESS_SET: do_round_set();
            ACCESS_READ_LO: do_round_read();
            ACCESS_FLUSH: do_round_flush();
        }
        const default_action = NoAction();
        size = 4;
    }

    // ---- slot_bitmap -----------------------------------------------------------------------------
    // A new round: the sender's bit (GRAD), or 0 (FLUSH of an unseen round).
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_bitmap) bitmap_set = {
        void apply(inout bit<32> value, out bit<32> rv) { value = meta.worker_bit; rv = value; }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_bitmap) bitmap_clear = {
        void apply(inout bit<32> value, out bit<32> rv) { rv = 0; value = 0; }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_bitmap) bitmap_test_set = {
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; value = value | meta.worker_bit; }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_bitmap) bitmap_read = {
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; }
    };
    action do_bitmap_set() { old_bitmap = bitmap_set.execute(meta.slot_index); }
    action do_bitmap_clear() { old_bitmap = bitmap_clear.execute(meta.slot_index); }
    action do_bitmap_test_set() { old_bitmap = bitmap_test_set.execute(meta.slot_index); }
    action do_bitmap_read() { old_bitmap = bitmap_read.execute(meta.slot_index); }
    table bitmap_access_table {
        key = { bitmap_access: exact @name("access"); }
        actions = { do_bitmap_set; do_bitmap_clear; do_bitmap_test_set; do_bitmap_read; NoAction; }
        const entries = {
            ACCESS_SET: do_bitmap_set();
            ACCESS_CLEAR: do_bitmap_clear();
            ACCESS_TEST_SET: do_bitmap_test_set();
            ACCESS_READ_LO: do_bitmap_read();
        }
        const default_action = NoAction();
        size = 4;
    }

    // ---- slot_count {count, weight} --------------------------------------------------------------
    // A new round: {1, weight} (GRAD), or {0, 0} (FLUSH of an unseen round: the control pass sets
    // the packet's weight and meta.quorum to 0 for it, and later passes overwrite the header's weight
    // from the register). A register has at most 4 register actions and its stateful ALU at most
    // 2 PHV inputs on Tofino: slot_count's actions read only meta.quorum and hdr.lta.weight.
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_count) count_set = {
        void apply(inout slot_pair_t value, out bit<32> rv) {
            if (meta.quorum == 0) {
                value.lo = 0;
            } else {
                value.lo = 1;
            }
            value.hi = hdr.lta.weight;
            rv = value.lo;
        }
    };
    // Answers the count it held: the packet was added when that was below the quorum.
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_count) count_add = {
        void apply(inout slot_pair_t value, out bit<32> rv) {
            rv = value.lo;
            if (value.lo < meta.quorum) {
                value.lo = value.lo + 1;
                value.hi = value.hi + hdr.lta.weight;
            }
        }
    };
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_count) count_read_lo = {
        void apply(inout slot_pair_t value, out bit<32> rv) { rv = value.lo; }
    };
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_count) count_read_hi = {
        void apply(inout slot_pair_t value, out bit<32> rv) { rv = value.hi; }
    };
    action do_count_set() { count = count_set.execute(meta.slot_index); }
    action do_count_add() { count = count_add.execute(meta.slot_index); }
    // The element pass writes the stored count straight into the header (an 8-bit field cannot take
    // a slice of a 32-bit one that is also added to).
    action do_count_read_lo() { hdr.lta.count = (bit<8>)count_read_lo.execute(meta.slot_index); }
    // Harvest pass: the weight straight into the header.
    action do_count_read_hi() { hdr.lta.weight = count_read_hi.execute(meta.slot_index); }
    table count_access_table {
        key = { count_access: exact @name("access"); }
        actions = { do_count_set; do_count_add; do_count_read_lo; do_count_read_hi; NoAction; }
        const entries = {
            ACCESS_SET: do_count_set();
            ACCESS_ADD: do_count_add();
            ACCESS_READ_LO: do_count_read_lo();
            ACCESS_READ_HI: do_count_read_hi();
        }
        const default_action = NoAction();
        size = 8;
    }

    // ---- slot_result {bitmap at closure, CLOSED | closer << 8 | SATURATED} -----------------------
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_result) result_set = {
        void apply(inout slot_pair_t value, out bit<32> rv) {
            value.lo = old_bitmap;  // by then the bitmap slot_result takes
            value.hi = result_flags;
            rv = 0;
        }
    };
    // Closes an open round (closing == 1) or only ORs SATURATED in; answers the hi word it found, so
    // the caller learns whether the round was already closed.
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_result) result_or_close = {
        void apply(inout slot_pair_t value, out bit<32> rv) {
            rv = value.hi;
            if (value.hi < RESULT_CLOSED) {
                // closing == 1 exactly when result_flags carries RESULT_CLOSED (2 PHV inputs at most)
                if (result_flags >= RESULT_CLOSED) {
                    value.lo = old_bitmap;  // by then the bitmap slot_result takes
                }
                value.hi = value.hi | result_flags;
            }
        }
    };
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_result) result_read_lo = {
        void apply(inout slot_pair_t value, out bit<32> rv) { rv = value.lo; }
    };
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_result) result_read_hi = {
        void apply(inout slot_pair_t value, out bit<32> rv) { rv = value.hi; }
    };
    action do_result_set() { result_hi = result_set.execute(meta.slot_index); }
    action do_result_or_close() { result_hi = result_or_close.execute(meta.slot_index); }
    // The element pass writes the bitmap at closure straight into the header.
    action do_result_read_lo() { hdr.lta.bitmap = (bit<64>)result_read_lo.execute(meta.slot_index); }
    action do_result_read_hi() { result_hi = result_read_hi.execute(meta.slot_index); }
    // Harvest pass: the closer and SATURATED straight from the register's answer into the header
    // (the element pass left FLAG_SATURATED's bit 0, so setting it is the OR of the contract).
    action do_result_harvest() {
        bit<32> hi = result_read_hi.execute(meta.slot_index);
        hdr.lta.worker_id = hi[15:8];
        hdr.lta.flags[1:1] = hi[1:1];  // FLAG_SATURATED
    }
    table result_access_table {
        key = { result_access: exact @name("access"); }
        actions = { do_result_set; do_result_or_close; do_result_read_lo; do_result_read_hi;
                    do_result_harvest; NoAction; }
        const entries = {
            ACCESS_SET: do_result_set();
            ACCESS_OR_CLOSE: do_result_or_close();
            ACCESS_READ_LO: do_result_read_lo();
            ACCESS_READ_HI: do_result_read_hi();
            ACCESS_HARVEST: do_result_harvest();
        }
        const default_action = NoAction();
        size = 8;
    }

    // Keyless tables hold what a later gateway tests (Tofino's gateways compare fields with constants;
    // the compiler would fold a temporary back into the condition): the order of q against seq (the
    // saturating q |-| seq is nonzero exactly when q > seq, unsigned, as the register action compares;
    // the XOR is zero exactly when q == seq), the exponent's XOR, the sender's bit in the old bitmap,
    // and quorum |-| count (0: the quorum was reached before this packet; 1: this packet reaches it).
    bit<32> seq_ahead;
    bit<32> exp_xor;
    bit<32> seen_bits;
    action compute_seq_order() {
        seq_ahead = hdr.lta.seq |-| old_seq;
        old_seq = hdr.lta.seq ^ old_seq;  // in place (PHV is scarce): 0 exactly when q == seq
    }
    table seq_compare {
        actions = { compute_seq_order; }
        const default_action = compute_seq_order();
        size = 1;
    }
    action compute_exp_xor() { exp_xor = round ^ packet_round; }
    table exp_compare {
        actions = { compute_exp_xor; }
        const default_action = compute_exp_xor();
        size = 1;
    }
    action compute_seen() { seen_bits = old_bitmap & meta.worker_bit; }
    table seen_compare {
        actions = { compute_seen; }
        const default_action = compute_seen();
        size = 1;
    }
    // In place (PHV is scarce): count becomes quorum |-| count; only whether and how the packet was
    // added is used after this in the control pass.
    action compute_count_room() { count = meta.quorum |-| count; }
    table count_compare {
        actions = { compute_count_room; }
        const default_action = compute_count_room();
        size = 1;
    }

    // Recirculate for the element pass: the pass header rides in front of the Ethernet header.
    action to_element_pass(bit<8> element_op, bit<8> emit) {
        hdr.pass_out.setValid();
        hdr.pass_out.pass = PASS_ELEMENTS;
        hdr.pass_out.element_op = element_op;
        hdr.pass_out.emit = emit;
        // slot_index and mcast_grp are copied where the packet recirculates (ingress.p4): one action
        // may not write constants and several PHV sources into the pass header's containers.
    }

    apply {
        // Each access table is applied once, whatever the pass: the pass only chooses the access.
        bool control_pass = !hdr.pass.isValid();
        bool element_pass = !control_pass && hdr.pass.pass == PASS_ELEMENTS;
        bool emits = !control_pass && hdr.pass.emit != EMIT_NONE;
        seq_access = ACCESS_NONE;
        round_access = ACCESS_NONE;
        bitmap_access = ACCESS_NONE;
        count_access = ACCESS_NONE;
        result_access = ACCESS_NONE;
        closing = 0;
        bool newer = false;
        bool flushed = false;
        bool same_exp = false;
        bool quorum_of_one = false;
        if (meta.quorum <= 1) {
            quorum_of_one = true;
        }

        // ---- slot_seq orders q (control pass); slot_round: set, flushed, or read ----
        if (control_pass) {
            meta.slot_index = meta.slot_base + hdr.lta.slot;
            worker_bit.apply(hdr.lta.worker_id, meta.worker_bit, closed_flags);
            packet_round = (bit<32>)hdr.lta.exp;
            if ((hdr.lta.flags & FLAG_MAX) != 0) {
                packet_round = packet_round | ROUND_MAX;
            }
            result_flags = (bit<32>)(hdr.lta.flags & FLAG_SATURATED);
            if (hdr.lta.op == OP_GRAD) {
                seq_access = ACCESS_GRAD;
            } else {
                seq_access = ACCESS_FLUSH;
            }
        } else {
            meta.slot_index = hdr.pass.slot_index;
        }
        seq_access_table.apply();
        if (control_pass) {
            seq_compare.apply();
            if (seq_ahead != 0) {
                if (hdr.lta.op != OP_GRAD) {
                    packet_round = packet_round | ROUND_FLUSHED;
                }
                round_access = ACCESS_SET;
            } else if (old_seq == 0) {  // q ^ seq
                if (hdr.lta.op == OP_GRAD) {
                    round_access = ACCESS_READ_LO;
                } else {
                    round_access = ACCESS_FLUSH;
                }
            }
        } else if (element_pass && emits) {
            round_access = ACCESS_READ_LO;
        }
        round_access_table.apply();
        if (control_pass) {
            if (round_access == ACCESS_SET) {
                round = ROUND_NEWER;
            } else if (round_access == ACCESS_NONE) {
                round = ROUND_OLDER;
            }
        }

        // ---- slot_bitmap (control pass only) ----
        if (control_pass) {
            newer = round == ROUND_NEWER;
            flushed = (round & ROUND_FLUSHED) != 0;
            exp_compare.apply();  // packet_round has no bit outside ROUND_EXP_MASK here
            same_exp = (exp_xor & ROUND_EXP_MASK) == 0;
            if (round == ROUND_OLDER) {
                if (hdr.lta.op == OP_GRAD) {
                    meta.branch = BRANCH_GRAD_STALE;
                } else {
                    meta.branch = BRANCH_FLUSH_STALE;
                }
            } else if (newer && hdr.lta.op == OP_GRAD) {
                // grad_start: a new round with this packet alone (closed at once when the quorum is 1).
                bitmap_access = ACCESS_SET;
                count_access = ACCESS_SET;
                result_access = ACCESS_SET;
                if (quorum_of_one) {
                    result_flags = result_flags | closed_flags;
                }
            } else if (newer) {
                // flush_empty: the slot never saw round q: closed with count 0 and zeros.
                result_flags = closed_flags;
                meta.quorum = 0;  // slot_count's {count, weight} = {0, 0}
                hdr.lta.weight = 0;
                bitmap_access = ACCESS_CLEAR;
                count_access = ACCESS_SET;
                result_access = ACCESS_SET;
            } else if (hdr.lta.op == OP_FLUSH) {
                if (flushed) {
                    meta.branch = BRANCH_FLUSH_RESEND;
                } else {
                    // Close the round if it is open: the bitmap so far becomes the RESULT's.
                    bitmap_access = ACCESS_READ_LO;
                    result_access = ACCESS_OR_CLOSE;
                    closing = 1;
                    result_flags = closed_flags;
                }
            } else if (flushed) {
                meta.branch = BRANCH_GRAD_LATE_RESEND;  // closed by a FLUSH
            } else if (same_exp) {
                bitmap_access = ACCESS_TEST_SET;
            } else {
                // Another exponent or MAX flag: closed (quorum), a duplicate, or a mismatch, in the
                // contract's order; the bitmap is only read (a mismatch never sets its bit).
                bitmap_access = ACCESS_READ_LO;
                result_access = ACCESS_READ_HI;
            }
        }
        bitmap_access_table.apply();
        seen_compare.apply();
        bool seen = seen_bits != 0;

        // ---- slot_count: add while below the quorum; RESULTs read count, then weight ----
        if (bitmap_access == ACCESS_TEST_SET) {
            if (seen) {
                result_access = ACCESS_READ_HI;  // a duplicate, or a round closed by quorum
            } else {
                count_access = ACCESS_ADD;
            }
        } else if (element_pass && emits) {
            count_access = ACCESS_READ_LO;
        } else if (!control_pass && !element_pass) {
            count_access = ACCESS_READ_HI;
        }
        count_access_table.apply();
        if (count_access == ACCESS_ADD) {
            count_compare.apply();  // only here: the other passes read count (or weight) out
            if (count == 0) {
                count = COUNT_NOT_ADDED;
            }
        }

        // ---- slot_result: set, closed (or SATURATED ORed in), or read ----
        if (count_access == ACCESS_ADD && count != COUNT_NOT_ADDED) {
            result_access = ACCESS_OR_CLOSE;
            if (count == 1) {  // this packet brought the count to the quorum
                closing = 1;
                old_bitmap = old_bitmap | meta.worker_bit;  // in place: the bitmap at closure
                result_flags = result_flags | closed_flags;
            }
        } else if (count_access == ACCESS_ADD) {
            // The round reached its quorum before this packet: closed already (a late GRAD), or still
            // open because the quorum was lowered since; then this packet closes it without being
            // added, with the bitmap of the contributions it has.
            result_access = ACCESS_OR_CLOSE;
            closing = 1;
            result_flags = closed_flags;
        } else if (bitmap_access == ACCESS_SET && !quorum_of_one) {
            old_bitmap = 0;  // grad_start: bitmap_set answered the sender's bit; lo is written at closure
        } else if (element_pass && emits) {
            result_access = ACCESS_READ_LO;
        } else if (!control_pass && !element_pass) {
            result_access = ACCESS_HARVEST;
        }
        result_access_table.apply();
        bool was_closed = result_hi >= RESULT_CLOSED;

        if (control_pass) {
            // The branch, and what the next passes do.
            if (bitmap_access == ACCESS_SET && hdr.lta.op == OP_GRAD) {
                meta.branch = BRANCH_GRAD_START;
                if (quorum_of_one) {
                    meta.result_quorum = true;
                    to_element_pass(ELEMENT_OP_STORE, EMIT_MULTICAST);
                } else {
                    to_element_pass(ELEMENT_OP_STORE, EMIT_NONE);
                }
            } else if (bitmap_access == ACCESS_CLEAR) {
                meta.branch = BRANCH_FLUSH_EMPTY;
                to_element_pass(ELEMENT_OP_CLEAR, EMIT_MULTICAST);  // stores zeros
            } else if (result_access == ACCESS_OR_CLOSE && hdr.lta.op == OP_FLUSH) {
                if (was_closed) {
                    meta.branch = BRANCH_FLUSH_RESEND;
                    to_element_pass(ELEMENT_OP_LOAD, EMIT_RESEND);
                } else {
                    meta.branch = BRANCH_FLUSH_PARTIAL;
                    to_element_pass(ELEMENT_OP_LOAD, EMIT_MULTICAST);
                }
            } else if (result_access == ACCESS_OR_CLOSE && count == COUNT_NOT_ADDED) {
                meta.branch = BRANCH_GRAD_LATE_RESEND;
                if (was_closed) {
                    to_element_pass(ELEMENT_OP_LOAD, EMIT_RESEND);
                } else {
                    meta.result_quorum = true;
                    to_element_pass(ELEMENT_OP_LOAD, EMIT_MULTICAST);
                }
            } else if (result_access == ACCESS_OR_CLOSE) {
                meta.branch = BRANCH_GRAD_ADD;
                bit<8> op = ELEMENT_OP_ADD;
                if ((round & ROUND_MAX) != 0) {
                    op = ELEMENT_OP_MAX;
                }
                if (closing == 1) {
                    meta.result_quorum = true;
                    to_element_pass(op, EMIT_MULTICAST);
                } else {
                    to_element_pass(op, EMIT_NONE);
                }
            } else if (result_access == ACCESS_READ_HI) {
                if (was_closed) {
                    meta.branch = BRANCH_GRAD_LATE_RESEND;
                    to_element_pass(ELEMENT_OP_LOAD, EMIT_RESEND);
                } else if (seen) {
                    meta.branch = BRANCH_GRAD_DUP;
                } else {
                    meta.branch = BRANCH_GRAD_EXP_MISMATCH;
                }
            } else if (meta.branch == BRANCH_FLUSH_RESEND || meta.branch == BRANCH_GRAD_LATE_RESEND) {
                to_element_pass(ELEMENT_OP_LOAD, EMIT_RESEND);  // closed by a FLUSH
            }
        } else if (element_pass && emits) {
            // The stored round's exp and MAX, its count and its bitmap at closure.
            hdr.lta.exp = round[7:0];
            if ((round & ROUND_MAX) != 0) {
                hdr.lta.flags = FLAG_MAX;
            } else {
                hdr.lta.flags = 0;
            }
        }
        // Harvest pass: weight, the closer and SATURATED were written by the access actions.
    }
}

#endif
