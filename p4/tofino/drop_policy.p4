// Emulated loss, one instance per direction: up (GRAD, by sender, ingress), down (RESULT, by receiver,
// egress) and param (PARAM / PARAM_REQ, by receiver, egress). Same table, actions and thresholds as the
// v1model program: a per-worker entry (ternary worker_id, priority 2) wins over the job's (priority 1);
// drop when a uniform 32-bit draw is below the threshold round(p * (2^32 - 1)); the threshold 2^32 - 1
// always drops (the draw covers [0, 2^32 - 1] here, so that value is tested on its own).
// Gilbert-Elliott keeps its state per (job, worker) in a register: first move the state (good->bad with
// p, bad->good with r), then drop with the new state's loss. The state's register action cannot compare
// three values at once, so the two transitions are decided before it and select one of four actions.
#ifndef LTA_DROP_POLICY
#define LTA_DROP_POLICY

#include "headers.p4"

const bit<32> THRESHOLD_ALWAYS = 0xffffffff;

control DropPolicy(in bit<16> job_id, in bit<8> worker_id, out bool drop) {
    Register<bit<8>, bit<12>>(4096, 0) gilbert_elliott_bad;
    // The state's index job_id * 64 + worker_id (both below 64 for a known worker): the identity hash
    // of job_id[5:0] ++ worker_id[5:0], since a register's index must be one field or a hash.
    Hash<bit<12>>(HashAlgorithm_t.IDENTITY) state_hash;
    RegisterAction<bit<8>, bit<12>, bit<8>>(gilbert_elliott_bad) ge_keep = {
        void apply(inout bit<8> value, out bit<8> rv) { rv = value; }
    };
    RegisterAction<bit<8>, bit<12>, bit<8>>(gilbert_elliott_bad) ge_bad = {
        void apply(inout bit<8> value, out bit<8> rv) { value = 1; rv = 1; }
    };
    RegisterAction<bit<8>, bit<12>, bit<8>>(gilbert_elliott_bad) ge_good = {
        void apply(inout bit<8> value, out bit<8> rv) { value = 0; rv = 0; }
    };
    RegisterAction<bit<8>, bit<12>, bit<8>>(gilbert_elliott_bad) ge_toggle = {
        void apply(inout bit<8> value, out bit<8> rv) { value = 1 - value; rv = value; }
    };
    Random<bit<32>>() transition_draw;
    Random<bit<32>>() loss_draw;

    // The table's parameters (named as the control plane writes them) land in these.
    bit<8> model;  // 0 none, 1 Bernoulli, 2 Gilbert-Elliott
    bit<32> loss_threshold;
    bit<32> p_threshold;
    bit<32> r_threshold;
    bit<32> good_threshold;
    bit<32> bad_threshold;
    bit<12> state_index;
    bit<8> move;  // 1: good->bad taken, 2: bad->good taken (each applies only in its state)
    bit<8> bad;
    bit<32> move_draw;
    bit<32> loss_draw_value;

    action no_loss() {
        model = 0;
    }
    action bernoulli(bit<32> loss) {
        model = 1;
        loss_threshold = loss;
    }
    action gilbert_elliott(bit<32> p, bit<32> r, bit<32> loss_good, bit<32> loss_bad) {
        model = 2;
        p_threshold = p;
        r_threshold = r;
        good_threshold = loss_good;
        bad_threshold = loss_bad;
    }
    table policy {
        key = {
            job_id: exact @name("job_id");
            worker_id: ternary @name("worker_id");
        }
        actions = { no_loss; bernoulli; gilbert_elliott; }
        default_action = no_loss();
        size = 4160;  // a policy per worker and one for all workers, for every job
    }

    action state_keep() { bad = ge_keep.execute(state_index); }
    action state_bad() { bad = ge_bad.execute(state_index); }
    action state_good() { bad = ge_good.execute(state_index); }
    action state_toggle() { bad = ge_toggle.execute(state_index); }
    // The new state from the old one and the two transitions: the register's one access per pass.
    table gilbert_elliott_state {
        key = { move: exact @name("move"); }
        actions = { state_keep; state_bad; state_good; state_toggle; NoAction; }
        const entries = {
            0: state_keep();    // neither transition: stay
            1: state_bad();     // good->bad taken, bad->good not: bad either way
            2: state_good();    // bad->good taken, good->bad not: good either way
            3: state_toggle();  // both: good becomes bad, bad becomes good
        }
        // Never taken (move is 0..3); a default action cannot address a register through the hash
        // unit on Tofino.
        const default_action = NoAction();
        size = 4;
    }

    // Whether a threshold is THRESHOLD_ALWAYS, decided before the threshold is replaced in place by
    // threshold |-| draw (nonzero when draw < threshold; PHV is scarce).
    bit<1> p_always;
    bit<1> r_always;
    bit<1> loss_always;
    // Keyless tables hold computations a later gateway tests: the compiler would otherwise fold a
    // temporary back into the condition, which Tofino's gateways cannot evaluate.
    action compute_move_rooms() {
        p_threshold = p_threshold |-| move_draw;
        r_threshold = r_threshold |-| move_draw;
    }
    table move_rooms {
        actions = { compute_move_rooms; }
        const default_action = compute_move_rooms();
        size = 1;
    }
    action compute_loss_room() { loss_threshold = loss_threshold |-| loss_draw_value; }
    table loss_rooms {
        actions = { compute_loss_room; }
        const default_action = compute_loss_room();
        size = 1;
    }

    apply {
        drop = false;
        policy.apply();
        move_draw = transition_draw.get();
        loss_draw_value = loss_draw.get();
        if (model == 2) {
            state_index = state_hash.get({job_id[5:0], worker_id[5:0]});
            move = 0;
            // draw < threshold as the saturating threshold |-| draw != 0 (a gateway compares with
            // constants only, and reads at most 4 bytes: one test per if).
            p_always = 0;
            r_always = 0;
            if (p_threshold == THRESHOLD_ALWAYS) {
                p_always = 1;
            }
            if (r_threshold == THRESHOLD_ALWAYS) {
                r_always = 1;
            }
            move_rooms.apply();
            if (p_always == 1) {
                move = move | 1;
            } else if (p_threshold != 0) {
                move = move | 1;
            }
            if (r_always == 1) {
                move = move | 2;
            } else if (r_threshold != 0) {
                move = move | 2;
            }
            gilbert_elliott_state.apply();
            if (bad == 1) {
                loss_threshold = bad_threshold;
            } else {
                loss_threshold = good_threshold;
            }
        }
        if (model != 0) {
            loss_always = 0;
            if (loss_threshold == THRESHOLD_ALWAYS) {
                loss_always = 1;
            }
            loss_rooms.apply();
            if (loss_always == 1) {
                drop = true;
            } else if (loss_threshold != 0) {
                drop = true;
            }
        }
    }
}

#endif
