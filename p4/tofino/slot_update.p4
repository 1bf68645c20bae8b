// Slot update (Tofino): the GRAD / FLUSH state machine of docs/protocol.md on one slot, in the slot
// pass, and the reads of the stored RESULT fields in the element and harvest passes.
// Tofino lets a pass touch each register once, through one stateful ALU that returns one 32-bit word,
// so the slot is five registers read in dependency order, each updated by the same access that reads it:
//   slot_seq     seq: answers the order of q against it as a predicate (older 1, newer 2, same 4)
//   slot_round   exp | MAX << 8 | FLUSHED << 9 | CLOSED << 10: answers its XOR with the packet's (exp
//                check, FLUSHED, CLOSED); CLOSED is written by the element pass of every RESULT
//   slot_bitmap  raw bitmap: test-and-set of the sender's bit  (duplicates)
//   slot_count   {count, weight}, add only while count < quorum: answers not added 1, added 2, closing 8;
//                for a duplicate, read only: answers count >= quorum 1, below it 2
//   slot_result  {bitmap at closure, CLOSED | closer << 8 | SATURATED}
// Each register's table is keyed on the answers of the registers before it (and the sender's bit, for
// the duplicate test), so the chain is one stage per register plus one that prepares slot_result's
// inputs and one that decides the branch.
// A duplicate GRAD (the sender's bit already in the round) reads slot_count too: an open round whose
// count meets the quorum (lowered under it by the liveness monitor) closes at it as a quorum close does,
// adding nothing (docs/protocol.md, "A duplicate at the quorum").
// Every closure (quorum, FLUSH, a duplicate at the quorum, a start at quorum 1) sends a RESULT, whose
// element pass marks the round CLOSED in slot_round (if slot_seq still holds the round), so a later GRAD
// is late at slot_bitmap's table whatever slot_count would say: once the liveness monitor raises the
// quorum above a closed round's count, slot_count alone would add a late first GRAD (docs/protocol.md,
// "Tofino", "Raised quorum"). A late GRAD in the one recirculation between the closing slot pass and its
// element pass still sets its bit in slot_bitmap (that register is read before slot_count says the
// round is closed); RESULTs therefore take their bitmap from slot_result, written at closure, never from
// slot_bitmap.
#ifndef LTA_SLOT_UPDATE
#define LTA_SLOT_UPDATE

#include "headers.p4"
#include "slot_elements.gen.p4"

const bit<32> ROUND_MAX = 0x100;
const bit<32> ROUND_FLUSHED = 0x200;
const bit<32> ROUND_CLOSED = 0x400;  // written in the element pass of a RESULT (never in a packet's word)
const bit<32> RESULT_CLOSED = 0x80000000;

// meta.slot_mode: which pass, and in the control pass which op.
const bit<8> MODE_NONE = 0;
const bit<8> MODE_GRAD = 1;
const bit<8> MODE_FLUSH = 2;
const bit<8> MODE_EMIT = 3;     // element pass of a packet that leaves as a RESULT
const bit<8> MODE_HARVEST = 4;

// slot_seq's answer: this.predicate(q > seq, q == seq) is 1 << (cmplo + 2 * cmphi).
const bit<8> SEQ_OLDER = 1;
const bit<8> SEQ_NEWER = 2;
const bit<8> SEQ_SAME = 4;
// slot_count's answer to an add: this.predicate(count < quorum, count + 1 == quorum).
const bit<8> COUNT_NOT_ADDED = 1;
const bit<8> COUNT_ADDED = 2;
const bit<8> COUNT_CLOSING = 8;
// ... and to a duplicate's probe, this.predicate(count < quorum) (the bitmap code is then BITMAP_DUP).
const bit<8> COUNT_MET = 1;
const bit<8> COUNT_BELOW = 2;
// The harvest pass's quorum: no job has it (a job's quorum is 8 bits), so slot_count's set-or-read
// action only reads the stored weight.
const bit<32> QUORUM_HARVEST = 0x100;

// What slot_bitmap's table did (its action writes the code).
const bit<8> BITMAP_STALE = 1;         // q < seq
const bit<8> BITMAP_SET = 2;           // GRAD opens round q
const bit<8> BITMAP_CLEAR = 3;         // FLUSH opens round q (empty)
const bit<8> BITMAP_FLUSH_RESEND = 4;  // FLUSH of a round already flushed
const bit<8> BITMAP_FLUSH_CLOSE = 5;   // FLUSH closes the round (bitmap read)
const bit<8> BITMAP_LATE_CLOSED = 6;   // GRAD to a round closed by FLUSH or marked CLOSED
const bit<8> BITMAP_TEST_SET = 7;      // GRAD, same exponent
const bit<8> BITMAP_EXP_OTHER = 8;     // GRAD, another exponent or MAX flag (bitmap read)
const bit<8> BITMAP_DUP = 9;           // either of the two, the sender's bit set: slot_count's table rewrites the code
// What slot_result's prepared access is.
const bit<8> RESULT_SET = 1;
const bit<8> RESULT_OR_CLOSE = 2;
const bit<8> RESULT_READ_LO = 3;
const bit<8> RESULT_READ_HI = 4;
const bit<8> RESULT_HARVEST = 5;

// In the slot pass (no side effect): the slot index, the sender's bit, the packet's round word
// (exp | MAX << 8 | FLUSHED << 9) and the mode, as one table keyed on the pass and the op rather than a
// chain of ifs (a gateway level per stage); in the element and harvest passes the slot index and mode.
// Applied early: Tofino 1 places tables in the order they are applied.
control SlotPrep(inout headers_t hdr, inout ingress_metadata_t meta) {
    WorkerBit() worker_bit;
    action prep_none() { meta.slot_mode = MODE_NONE; }
    action prep_grad(bit<24> round_hi) {
        meta.slot_mode = MODE_GRAD;
        meta.slot_index = meta.slot_base + hdr.lta.slot;
        meta.packet_round = round_hi ++ hdr.lta.exp;
    }
    // FLUSH: a round it opens is flushed; slot_count's {count, weight} then {0, 0} (the later passes
    // take the RESULT's weight from the register).
    action prep_flush(bit<24> round_hi) {
        meta.slot_mode = MODE_FLUSH;
        meta.slot_index = meta.slot_base + hdr.lta.slot;
        meta.packet_round = round_hi ++ hdr.lta.exp;
        meta.quorum = 0;
        hdr.lta.weight = 0;
    }
    action prep_pass(bit<8> mode) {
        meta.slot_mode = mode;
        meta.slot_index = hdr.pass.slot_index;
        meta.packet_round = 0;  // slot_round's compare then reads the stored word as it is
    }
    action prep_harvest() {
        meta.slot_mode = MODE_HARVEST;
        meta.slot_index = hdr.pass.slot_index;
        meta.quorum = QUORUM_HARVEST;
    }
    table slot_prep {
        key = {
            hdr.pass.isValid(): exact @name("recirculated");
            hdr.pass.pass: ternary @name("pass");
            hdr.pass.emit: ternary @name("emit");
            hdr.lta.op: ternary @name("op");
            hdr.lta.flags: ternary @name("flags");
        }
        actions = { prep_none; prep_grad; prep_flush; prep_pass; prep_harvest; }
        const entries = {
            (true, PASS_SLOT, _, OP_GRAD, FLAG_MAX &&& FLAG_MAX): prep_grad(1);   // ROUND_MAX >> 8
            (true, PASS_SLOT, _, OP_GRAD, _): prep_grad(0);
            (true, PASS_SLOT, _, OP_FLUSH, FLAG_MAX &&& FLAG_MAX): prep_flush(3);  // (ROUND_MAX | ROUND_FLUSHED) >> 8
            (true, PASS_SLOT, _, OP_FLUSH, _): prep_flush(2);                    // ROUND_FLUSHED >> 8
            (true, PASS_ELEMENTS, EMIT_NONE, _, _): prep_pass(MODE_NONE);
            (true, PASS_ELEMENTS, _, _, _): prep_pass(MODE_EMIT);
            (true, PASS_HARVEST, _, _, _): prep_harvest();
        }
        const default_action = prep_none();
        size = 8;
    }
    apply {
        meta.quorum_of_one = 0;
        if (meta.quorum <= 1) {
            meta.quorum_of_one = 1;
        }
        meta.sat_flags = (bit<32>)(hdr.lta.flags & FLAG_SATURATED);
        worker_bit.apply(hdr.lta.worker_id, meta.worker_bit, meta.closed_flags);
        slot_prep.apply();
    }
}

control SlotUpdate(inout headers_t hdr, inout ingress_metadata_t meta) {
    // Accumulator pair groups 1-8 (slot_elements.gen.p4), each applied right after one table of the
    // chain: they only run in the element and harvest passes (their tables key on the pass), and Tofino
    // 1 places a table no earlier than those applied before it, so this interleaving lets the pairs
    // share the chain's stages (4 stateful ALUs each) rather than push the chain behind them.
    SlotElements1() elements_1;
    SlotElements2() elements_2;
    SlotElements3() elements_3;
    SlotElements4() elements_4;
    SlotElements5() elements_5;
    SlotElements6() elements_6;
    SlotElements7() elements_7;
    SlotElements8() elements_8;
    Register<bit<32>, bit<16>>(LTA_SLOT_CAPACITY) slot_seq;
    Register<bit<32>, bit<16>>(LTA_SLOT_CAPACITY) slot_round;
    Register<bit<32>, bit<16>>(LTA_SLOT_CAPACITY) slot_bitmap;
    Register<slot_pair_t, bit<16>>(LTA_SLOT_CAPACITY) slot_count;
    Register<slot_pair_t, bit<16>>(LTA_SLOT_CAPACITY) slot_result;

    // slot_bitmap's answer and, updated in place, slot_result's bitmap input: the low word of the
    // packet's own bitmap field, which the slot pass does not read and the element pass of a RESULT
    // overwrites (PHV: a header word the program already writes, not one more 32-bit container).
#define BITMAP_WORD hdr.lta.bitmap[31:0]
    // slot_result's other input, CLOSED | closer << 8 | SATURATED: the high word of the same field.
#define FLAGS_WORD hdr.lta.bitmap[63:32]
    bit<8>  seq_code;
    bit<32> round;         // slot_round's answer
    bit<8>  bitmap_code;
    bit<8>  count_code;
    bit<8>  result_code;
    bit<32> result_hi;     // slot_result's answer

    // ---- slot_seq ----------------------------------------------------------------------------------
    RegisterAction<bit<32>, bit<16>, bit<8>>(slot_seq) seq_order = {
        void apply(inout bit<32> value, out bit<8> rv) {
            rv = this.predicate(hdr.lta.seq > value, hdr.lta.seq == value);
            if (hdr.lta.seq > value) {
                value = hdr.lta.seq;
            }
        }
    };
    action do_seq_order() { seq_code = seq_order.execute(meta.slot_index); }
    table seq_access_table {
        key = { meta.slot_mode: exact @name("mode"); meta.policy_drop: exact @name("policy_drop"); }
        actions = { do_seq_order; NoAction; }
        const entries = {
            (MODE_GRAD, false): do_seq_order();
            (MODE_FLUSH, false): do_seq_order();
            // the element pass of a RESULT: whether the slot still holds the packet's round (never
            // newer; older only if a worker gave up the round and sent the slot's next one before it)
            (MODE_EMIT, false): do_seq_order();
        }
        const default_action = NoAction();
        size = 4;
    }

    // ---- slot_round: set (newer), or answered as its XOR with the packet's word: bits 8:0 zero exactly
    // when exp and MAX agree; bit 9 the FLUSHED mark (inverted for a FLUSH, whose word carries FLUSHED);
    // bit 10 the CLOSED mark. In the element pass of a RESULT (packet word 0) read and marked CLOSED, or
    // only read when slot_seq has moved on ----
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_round) round_set = {
        void apply(inout bit<32> value, out bit<32> rv) { value = meta.packet_round; rv = 0; }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_round) round_close = {
        void apply(inout bit<32> value, out bit<32> rv) {
            rv = value;
            value = value | ROUND_CLOSED;
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_round) round_compare = {
        void apply(inout bit<32> value, out bit<32> rv) { rv = value ^ meta.packet_round; }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(slot_round) round_flush = {
        void apply(inout bit<32> value, out bit<32> rv) {
            rv = value ^ meta.packet_round;
            value = value | ROUND_FLUSHED;
        }
    };
    action do_round_set() { round = round_set.execute(meta.slot_index); }
    action do_round_close() { round = round_close.execute(meta.slot_index); }
    action do_round_compare() { round = round_compare.execute(meta.slot_index); }
    action do_round_flush() { round = round_flush.execute(meta.slot_index); }
    table round_access_table {
        key = { meta.slot_mode: exact @name("mode"); seq_code: exact @name("seq"); }
        actions = { do_round_set; do_round_close; do_round_compare; do_round_flush; NoAction; }
        const entries = {
            (MODE_GRAD, SEQ_NEWER): do_round_set();
            (MODE_FLUSH, SEQ_NEWER): do_round_set();
            (MODE_GRAD, SEQ_SAME): do_round_compare();
            (MODE_FLUSH, SEQ_SAME): do_round_flush();
            (MODE_EMIT, SEQ_SAME): do_round_close();
            (MODE_EMIT, SEQ_OLDER): do_round_compare();
        }
        const default_action = NoAction();
        size = 8;
    }

    // ---- slot_bitmap: keyed on slot_seq's and slot_round's answers -----------------------------------
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
    action do_bitmap_set() { BITMAP_WORD = bitmap_set.execute(meta.slot_index); bitmap_code = BITMAP_SET; }
    action do_bitmap_clear() { BITMAP_WORD = bitmap_clear.execute(meta.slot_index); bitmap_code = BITMAP_CLEAR; }
    action do_bitmap_test_set() {
        BITMAP_WORD = bitmap_test_set.execute(meta.slot_index);
        bitmap_code = BITMAP_TEST_SET;
    }
    action do_bitmap_read(bit<8> code) { BITMAP_WORD = bitmap_read.execute(meta.slot_index); bitmap_code = code; }
    action no_bitmap(bit<8> code) { bitmap_code = code; }
    table bitmap_access_table {
        key = {
            meta.slot_mode: exact @name("mode");
            seq_code: ternary @name("seq");
            round: ternary @name("round");
        }
        actions = { do_bitmap_set; do_bitmap_clear; do_bitmap_test_set; do_bitmap_read; no_bitmap; }
        const entries = {
            (MODE_GRAD, SEQ_OLDER, _): no_bitmap(BITMAP_STALE);
            (MODE_FLUSH, SEQ_OLDER, _): no_bitmap(BITMAP_STALE);
            (MODE_GRAD, SEQ_NEWER, _): do_bitmap_set();
            (MODE_FLUSH, SEQ_NEWER, _): do_bitmap_clear();
            // FLUSH: its word carries FLUSHED, so bit 9 of the XOR is 0 when the round was flushed
            (MODE_FLUSH, SEQ_SAME, 32w0 &&& ROUND_FLUSHED): no_bitmap(BITMAP_FLUSH_RESEND);
            (MODE_FLUSH, SEQ_SAME, _): do_bitmap_read(BITMAP_FLUSH_CLOSE);
            (MODE_GRAD, SEQ_SAME, ROUND_FLUSHED &&& ROUND_FLUSHED): no_bitmap(BITMAP_LATE_CLOSED);
            // closed (its RESULT sent): late, whatever slot_count would say of a raised quorum
            (MODE_GRAD, SEQ_SAME, ROUND_CLOSED &&& ROUND_CLOSED): no_bitmap(BITMAP_LATE_CLOSED);
            (MODE_GRAD, SEQ_SAME, 32w0 &&& 32w0x1ff): do_bitmap_test_set();
            (MODE_GRAD, SEQ_SAME, _): do_bitmap_read(BITMAP_EXP_OTHER);
        }
        const default_action = no_bitmap(0);
        size = 16;
    }

    // ---- slot_count {count, weight}: keyed on slot_bitmap's code and answer (the sender's bit in it) --
    // A new round: {1, weight} (GRAD), or {0, 0} (FLUSH: SlotPrep set its quorum and weight to 0); in
    // the harvest pass (SlotPrep set the quorum to QUORUM_HARVEST) nothing is written and the answer,
    // the weight as it was, is the RESULT's. A register has at most 4 register actions and its stateful
    // ALU at most 2 PHV inputs on Tofino: slot_count's actions read only meta.quorum and hdr.lta.weight,
    // and the start and the harvest's read share one action so that the duplicate's probe has the fourth.
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_count) count_set_or_weight = {
        void apply(inout slot_pair_t value, out bit<32> rv) {
            rv = value.hi;
            if (meta.quorum != QUORUM_HARVEST) {
                if (meta.quorum == 0) {
                    value.lo = 0;
                } else {
                    value.lo = 1;
                }
                value.hi = hdr.lta.weight;
            }
        }
    };
    RegisterAction<slot_pair_t, bit<16>, bit<8>>(slot_count) count_add = {
        void apply(inout slot_pair_t value, out bit<8> rv) {
            rv = this.predicate(value.lo < meta.quorum, value.lo + 1 == meta.quorum);
            if (value.lo < meta.quorum) {
                value.lo = value.lo + 1;
                value.hi = value.hi + hdr.lta.weight;
            }
        }
    };
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_count) count_read_lo = {
        void apply(inout slot_pair_t value, out bit<32> rv) { rv = value.lo; }
    };
    // A duplicate: the count against the (current) quorum, nothing written.
    RegisterAction<slot_pair_t, bit<16>, bit<8>>(slot_count) count_probe = {
        void apply(inout slot_pair_t value, out bit<8> rv) {
            rv = this.predicate(value.lo < meta.quorum);
        }
    };
    action do_count_set() { count_set_or_weight.execute(meta.slot_index); }
    action do_count_add() { count_code = count_add.execute(meta.slot_index); }
    // The duplicate's own code, so that result_prep and decide tell its answer from an add's.
    action do_count_probe() { count_code = count_probe.execute(meta.slot_index); bitmap_code = BITMAP_DUP; }
    // The element pass writes the stored count straight into the header, the harvest pass the weight.
    action do_count_read_lo() { hdr.lta.count = (bit<8>)count_read_lo.execute(meta.slot_index); }
    action do_count_read_hi() { hdr.lta.weight = count_set_or_weight.execute(meta.slot_index); }
    table count_access_table {
        key = {
            meta.slot_mode: exact @name("mode");
            bitmap_code: exact @name("bitmap");
            BITMAP_WORD: ternary @name("old_bitmap");
            hdr.lta.worker_id: ternary @name("worker_id");
        }
        actions = { do_count_set; do_count_add; do_count_probe; do_count_read_lo; do_count_read_hi; NoAction; }
        const entries = {
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000001 &&& 32w0x00000001, 0): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000001 &&& 32w0x00000001, 0): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000002 &&& 32w0x00000002, 1): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000002 &&& 32w0x00000002, 1): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000004 &&& 32w0x00000004, 2): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000004 &&& 32w0x00000004, 2): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000008 &&& 32w0x00000008, 3): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000008 &&& 32w0x00000008, 3): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000010 &&& 32w0x00000010, 4): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000010 &&& 32w0x00000010, 4): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000020 &&& 32w0x00000020, 5): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000020 &&& 32w0x00000020, 5): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000040 &&& 32w0x00000040, 6): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000040 &&& 32w0x00000040, 6): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000080 &&& 32w0x00000080, 7): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000080 &&& 32w0x00000080, 7): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000100 &&& 32w0x00000100, 8): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000100 &&& 32w0x00000100, 8): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000200 &&& 32w0x00000200, 9): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000200 &&& 32w0x00000200, 9): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000400 &&& 32w0x00000400, 10): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000400 &&& 32w0x00000400, 10): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00000800 &&& 32w0x00000800, 11): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00000800 &&& 32w0x00000800, 11): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00001000 &&& 32w0x00001000, 12): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00001000 &&& 32w0x00001000, 12): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00002000 &&& 32w0x00002000, 13): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00002000 &&& 32w0x00002000, 13): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00004000 &&& 32w0x00004000, 14): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00004000 &&& 32w0x00004000, 14): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00008000 &&& 32w0x00008000, 15): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00008000 &&& 32w0x00008000, 15): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00010000 &&& 32w0x00010000, 16): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00010000 &&& 32w0x00010000, 16): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00020000 &&& 32w0x00020000, 17): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00020000 &&& 32w0x00020000, 17): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00040000 &&& 32w0x00040000, 18): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00040000 &&& 32w0x00040000, 18): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00080000 &&& 32w0x00080000, 19): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00080000 &&& 32w0x00080000, 19): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00100000 &&& 32w0x00100000, 20): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00100000 &&& 32w0x00100000, 20): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00200000 &&& 32w0x00200000, 21): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00200000 &&& 32w0x00200000, 21): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00400000 &&& 32w0x00400000, 22): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00400000 &&& 32w0x00400000, 22): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x00800000 &&& 32w0x00800000, 23): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x00800000 &&& 32w0x00800000, 23): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x01000000 &&& 32w0x01000000, 24): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x01000000 &&& 32w0x01000000, 24): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x02000000 &&& 32w0x02000000, 25): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x02000000 &&& 32w0x02000000, 25): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x04000000 &&& 32w0x04000000, 26): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x04000000 &&& 32w0x04000000, 26): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x08000000 &&& 32w0x08000000, 27): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x08000000 &&& 32w0x08000000, 27): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x10000000 &&& 32w0x10000000, 28): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x10000000 &&& 32w0x10000000, 28): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x20000000 &&& 32w0x20000000, 29): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x20000000 &&& 32w0x20000000, 29): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x40000000 &&& 32w0x40000000, 30): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x40000000 &&& 32w0x40000000, 30): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, 32w0x80000000 &&& 32w0x80000000, 31): do_count_probe();
            (MODE_GRAD, BITMAP_EXP_OTHER, 32w0x80000000 &&& 32w0x80000000, 31): do_count_probe();
            (MODE_GRAD, BITMAP_TEST_SET, _, _): do_count_add();
            (MODE_GRAD, BITMAP_SET, _, _): do_count_set();
            (MODE_FLUSH, BITMAP_CLEAR, _, _): do_count_set();
            (MODE_EMIT, 0, _, _): do_count_read_lo();
            (MODE_HARVEST, 0, _, _): do_count_read_hi();
        }
        const default_action = NoAction();
        size = 80;
    }

    // ---- slot_result's inputs (its stateful ALU takes two PHV words: res_bitmap, FLAGS_WORD) ----------
    // grad_start: closed at once, its bit the bitmap, when the quorum is 1
    action prep_start() { BITMAP_WORD = 0; FLAGS_WORD = meta.sat_flags; result_code = RESULT_SET; }
    action prep_start_closed() {
        BITMAP_WORD = meta.worker_bit;
        FLAGS_WORD = meta.sat_flags | meta.closed_flags;
        result_code = RESULT_SET;
    }
    action prep_flush_empty() { BITMAP_WORD = 0; FLAGS_WORD = meta.closed_flags; result_code = RESULT_SET; }
    // FLUSH closing an open round, or a GRAD not added or a duplicate (the quorum reached before it):
    // closed with the bitmap of the contributions the round has.
    action prep_close() { FLAGS_WORD = meta.closed_flags; result_code = RESULT_OR_CLOSE; }
    action prep_add_close() {
        BITMAP_WORD = BITMAP_WORD | meta.worker_bit;
        FLAGS_WORD = meta.sat_flags | meta.closed_flags;
        result_code = RESULT_OR_CLOSE;
    }
    action prep_add() { FLAGS_WORD = meta.sat_flags; result_code = RESULT_OR_CLOSE; }
    action prep_access(bit<8> code) { result_code = code; }
    table result_prep {
        key = {
            meta.slot_mode: exact @name("mode");
            bitmap_code: exact @name("bitmap");
            count_code: exact @name("count");
            meta.quorum_of_one: exact @name("quorum_of_one");
        }
        actions = { prep_start; prep_start_closed; prep_flush_empty; prep_close; prep_add_close; prep_add; prep_access; NoAction; }
        const entries = {
            (MODE_GRAD, BITMAP_SET, 0, 0): prep_start();
            (MODE_GRAD, BITMAP_SET, 0, 1): prep_start_closed();
            (MODE_FLUSH, BITMAP_CLEAR, 0, 0): prep_flush_empty();
            (MODE_FLUSH, BITMAP_CLEAR, 0, 1): prep_flush_empty();
            (MODE_FLUSH, BITMAP_FLUSH_CLOSE, 0, 0): prep_close();
            (MODE_FLUSH, BITMAP_FLUSH_CLOSE, 0, 1): prep_close();
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_NOT_ADDED, 0): prep_close();
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_NOT_ADDED, 1): prep_close();
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_CLOSING, 0): prep_add_close();
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_CLOSING, 1): prep_add_close();
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_ADDED, 0): prep_add();
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_ADDED, 1): prep_add();
            // a duplicate at the quorum closes the open round with the bitmap it has (below it: read)
            (MODE_GRAD, BITMAP_DUP, COUNT_MET, 0): prep_close();
            (MODE_GRAD, BITMAP_DUP, COUNT_MET, 1): prep_close();
            (MODE_GRAD, BITMAP_DUP, COUNT_BELOW, 0): prep_access(RESULT_READ_HI);
            (MODE_GRAD, BITMAP_DUP, COUNT_BELOW, 1): prep_access(RESULT_READ_HI);
            (MODE_GRAD, BITMAP_EXP_OTHER, 0, 0): prep_access(RESULT_READ_HI);
            (MODE_GRAD, BITMAP_EXP_OTHER, 0, 1): prep_access(RESULT_READ_HI);
            (MODE_EMIT, 0, 0, 0): prep_access(RESULT_READ_LO);
            (MODE_EMIT, 0, 0, 1): prep_access(RESULT_READ_LO);
            (MODE_HARVEST, 0, 0, 0): prep_access(RESULT_HARVEST);
            (MODE_HARVEST, 0, 0, 1): prep_access(RESULT_HARVEST);
        }
        const default_action = NoAction();
        size = 32;
    }

    // ---- slot_result {bitmap at closure, CLOSED | closer << 8 | SATURATED} -----------------------
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_result) result_set = {
        void apply(inout slot_pair_t value, out bit<32> rv) {
            value.lo = BITMAP_WORD;
            value.hi = FLAGS_WORD;
            rv = 0;
        }
    };
    // Closes an open round (FLAGS_WORD carries RESULT_CLOSED) or only ORs SATURATED in; answers the hi
    // word it found, so the caller learns whether the round was already closed.
    RegisterAction<slot_pair_t, bit<16>, bit<32>>(slot_result) result_or_close = {
        void apply(inout slot_pair_t value, out bit<32> rv) {
            rv = value.hi;
            if (value.hi < RESULT_CLOSED) {
                if (FLAGS_WORD >= RESULT_CLOSED) {
                    value.lo = BITMAP_WORD;
                }
                value.hi = value.hi | FLAGS_WORD;
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
        key = { result_code: exact @name("access"); }
        actions = { do_result_set; do_result_or_close; do_result_read_lo; do_result_read_hi;
                    do_result_harvest; NoAction; }
        const entries = {
            RESULT_SET: do_result_set();
            RESULT_OR_CLOSE: do_result_or_close();
            RESULT_READ_LO: do_result_read_lo();
            RESULT_READ_HI: do_result_read_hi();
            RESULT_HARVEST: do_result_harvest();
        }
        const default_action = NoAction();
        size = 8;
    }

    // ---- the branch, and what the next passes do ----------------------------------------------------
    action finish(bit<8> branch) { meta.branch = branch; }
    // Recirculate for the element pass: the pass header rides in front of the Ethernet header
    // (slot_index and mcast_grp are copied where the packet recirculates, ingress.p4).
    action finish_pass(bit<8> branch, bit<8> element_op, bit<8> emit) {
        meta.branch = branch;
        hdr.pass_out.setValid();
        hdr.pass_out.pass = PASS_ELEMENTS;
        hdr.pass_out.element_op = element_op;
        hdr.pass_out.emit = emit;
    }
    action finish_quorum(bit<8> branch, bit<8> element_op) {
        meta.branch = branch;
        meta.result_quorum = true;
        hdr.pass_out.setValid();
        hdr.pass_out.pass = PASS_ELEMENTS;
        hdr.pass_out.element_op = element_op;
        hdr.pass_out.emit = EMIT_MULTICAST;
    }
    table decide {
        key = {
            meta.slot_mode: exact @name("mode");
            bitmap_code: exact @name("bitmap");
            count_code: ternary @name("count");
            result_hi: ternary @name("result_hi");        // bit 31: the round was closed
            meta.quorum_of_one: ternary @name("quorum_of_one");
            meta.packet_round: ternary @name("packet_round");  // ROUND_MAX: the MAX operation
        }
        actions = { finish; finish_pass; finish_quorum; NoAction; }
        const entries = {
            (MODE_GRAD, BITMAP_STALE, _, _, _, _): finish(BRANCH_GRAD_STALE);
            (MODE_FLUSH, BITMAP_STALE, _, _, _, _): finish(BRANCH_FLUSH_STALE);
            (MODE_GRAD, BITMAP_SET, _, _, 1, _): finish_quorum(BRANCH_GRAD_START, ELEMENT_OP_STORE);
            (MODE_GRAD, BITMAP_SET, _, _, _, _): finish_pass(BRANCH_GRAD_START, ELEMENT_OP_STORE, EMIT_NONE);
            (MODE_FLUSH, BITMAP_CLEAR, _, _, _, _): finish_pass(BRANCH_FLUSH_EMPTY, ELEMENT_OP_CLEAR, EMIT_MULTICAST);
            (MODE_FLUSH, BITMAP_FLUSH_RESEND, _, _, _, _): finish_pass(BRANCH_FLUSH_RESEND, ELEMENT_OP_LOAD, EMIT_RESEND);
            (MODE_FLUSH, BITMAP_FLUSH_CLOSE, _, RESULT_CLOSED &&& RESULT_CLOSED, _, _):
                finish_pass(BRANCH_FLUSH_RESEND, ELEMENT_OP_LOAD, EMIT_RESEND);
            (MODE_FLUSH, BITMAP_FLUSH_CLOSE, _, _, _, _): finish_pass(BRANCH_FLUSH_PARTIAL, ELEMENT_OP_LOAD, EMIT_MULTICAST);
            (MODE_GRAD, BITMAP_LATE_CLOSED, _, _, _, _): finish_pass(BRANCH_GRAD_LATE_RESEND, ELEMENT_OP_LOAD, EMIT_RESEND);
            // closed (by quorum) comes first: a late GRAD, whatever its bit or exponent (one marked
            // CLOSED in slot_round, the usual case, is BITMAP_LATE_CLOSED already; these entries take a
            // late GRAD in the recirculation before the closure's element pass writes the mark)
            (MODE_GRAD, BITMAP_DUP, _, RESULT_CLOSED &&& RESULT_CLOSED, _, _):
                finish_pass(BRANCH_GRAD_LATE_RESEND, ELEMENT_OP_LOAD, EMIT_RESEND);
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_NOT_ADDED, RESULT_CLOSED &&& RESULT_CLOSED, _, _):
                finish_pass(BRANCH_GRAD_LATE_RESEND, ELEMENT_OP_LOAD, EMIT_RESEND);
            (MODE_GRAD, BITMAP_EXP_OTHER, _, RESULT_CLOSED &&& RESULT_CLOSED, _, _):
                finish_pass(BRANCH_GRAD_LATE_RESEND, ELEMENT_OP_LOAD, EMIT_RESEND);
            // a duplicate into an open round at the (lowered) quorum closes it, adding nothing
            (MODE_GRAD, BITMAP_DUP, COUNT_MET, _, _, _): finish_quorum(BRANCH_GRAD_DUP, ELEMENT_OP_LOAD);
            (MODE_GRAD, BITMAP_DUP, _, _, _, _): finish(BRANCH_GRAD_DUP);
            (MODE_GRAD, BITMAP_EXP_OTHER, _, _, _, _): finish(BRANCH_GRAD_EXP_MISMATCH);
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_NOT_ADDED, _, _, _): finish_quorum(BRANCH_GRAD_LATE_RESEND, ELEMENT_OP_LOAD);
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_CLOSING, _, _, ROUND_MAX &&& ROUND_MAX): finish_quorum(BRANCH_GRAD_ADD, ELEMENT_OP_MAX);
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_CLOSING, _, _, _): finish_quorum(BRANCH_GRAD_ADD, ELEMENT_OP_ADD);
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_ADDED, _, _, ROUND_MAX &&& ROUND_MAX):
                finish_pass(BRANCH_GRAD_ADD, ELEMENT_OP_MAX, EMIT_NONE);
            (MODE_GRAD, BITMAP_TEST_SET, COUNT_ADDED, _, _, _): finish_pass(BRANCH_GRAD_ADD, ELEMENT_OP_ADD, EMIT_NONE);
        }
        const default_action = NoAction();
        size = 32;
    }

    apply {
        seq_code = 0;
        bitmap_code = 0;
        count_code = 0;
        result_code = 0;
        round = 0;
        result_hi = 0;
        elements_1.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        seq_access_table.apply();
        elements_2.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        round_access_table.apply();
        elements_3.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        bitmap_access_table.apply();
        elements_4.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        count_access_table.apply();
        elements_5.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        result_prep.apply();
        elements_6.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        result_access_table.apply();
        elements_7.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        if (meta.slot_mode == MODE_EMIT) {
            // The stored round's exp and MAX, its count and its bitmap at closure.
            hdr.lta.exp = round[7:0];
            if ((round & ROUND_MAX) != 0) {
                hdr.lta.flags = FLAG_MAX;
            } else {
                hdr.lta.flags = 0;
            }
        } else {
            decide.apply();
        }
        elements_8.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        // Harvest pass: weight, the closer and SATURATED were written by the access actions.
    }
}

#endif
