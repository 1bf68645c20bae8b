// Emulated loss, one instance per direction: up (GRAD, by sender, ingress), down (RESULT, by receiver,
// egress) and param (PARAM / PARAM_REQ, by receiver, egress). Same table, actions and thresholds as the
// v1model program: a per-worker entry (ternary worker_id, priority 2) wins over the job's (priority 1);
// drop when a uniform 32-bit draw is below the threshold round(p * (2^32 - 1)); the threshold 2^32 - 1
// always drops (the draw covers [0, 2^32 - 1] here, so that value is tested on its own).
// Gilbert-Elliott keeps its state per (job, worker) in a register: first move the state (good->bad with
// p, bad->good with r), then drop with the new state's loss.
//
// Laid out for Tofino's stages: the policy is looked up and every threshold compared with its draw for
// every packet (no side effect, so from the first stages on, before the caller's checks are known);
// only the Gilbert-Elliott state register and the decision wait for `active`. The comparisons are
// saturating differences (threshold |-| draw, nonzero when draw < threshold) matched by two small
// ternary tables, not gateway chains. A table takes 32 random bits at most, so each draw is written to
// a field first.
#ifndef LTA_DROP_POLICY
#define LTA_DROP_POLICY

#include "headers.p4"

const bit<32> THRESHOLD_ALWAYS = 0xffffffff;
const bit<8> MODEL_NONE = 0;
const bit<8> MODEL_BERNOULLI = 1;
const bit<8> MODEL_GILBERT_ELLIOTT = 2;

control DropPolicy(in bit<16> job_id, in bit<8> worker_id, in bool active, out bool drop) {
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

    // The table's parameters (named as the control plane writes them) land in these; Bernoulli's loss
    // is the good state's. Each is then replaced in place by threshold |-| draw (PHV is scarce).
    bit<8> model;
    bit<32> p_room;
    bit<32> r_room;
    bit<32> good_room;
    bit<32> bad_room;
    // Whether a threshold is THRESHOLD_ALWAYS, taken before the difference replaces it.
    bit<1> p_always;
    bit<1> r_always;
    bit<1> good_always;
    bit<1> bad_always;
    bit<32> transition_value;
    bit<32> loss_value;
    bit<8> bad;  // the Gilbert-Elliott state after this packet's transition

    action no_loss() {
        model = MODEL_NONE;
    }
    action bernoulli(bit<32> loss) {
        model = MODEL_BERNOULLI;
        good_room = loss;
        good_always = 0;
    }
    action gilbert_elliott(bit<32> p, bit<32> r, bit<32> loss_good, bit<32> loss_bad) {
        model = MODEL_GILBERT_ELLIOTT;
        p_room = p;
        r_room = r;
        good_room = loss_good;
        bad_room = loss_bad;
        p_always = 0;
        r_always = 0;
        good_always = 0;
        bad_always = 0;
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

    // One draw for both transitions (only the current state's applies) and one for both losses (only
    // the new state's applies): the same law as drawing only the one that is used.
    action compute_rooms() {
        p_room = p_room |-| transition_value;
        r_room = r_room |-| transition_value;
        good_room = good_room |-| loss_value;
        bad_room = bad_room |-| loss_value;
    }
    table rooms {
        actions = { compute_rooms; }
        const default_action = compute_rooms();
        size = 1;
    }

    action state_keep() { bad = ge_keep.execute(state_hash.get({job_id[5:0], worker_id[5:0]})); }
    action state_bad() { bad = ge_bad.execute(state_hash.get({job_id[5:0], worker_id[5:0]})); }
    action state_good() { bad = ge_good.execute(state_hash.get({job_id[5:0], worker_id[5:0]})); }
    action state_toggle() { bad = ge_toggle.execute(state_hash.get({job_id[5:0], worker_id[5:0]})); }
    // The register's one access per pass: a transition is taken when its threshold always fires or its
    // draw fell below it (room != 0). Entries in priority order.
    table gilbert_elliott_state {
        key = {
            p_always: ternary @name("p_always");
            p_room: ternary @name("p_room");
            r_always: ternary @name("r_always");
            r_room: ternary @name("r_room");
        }
        actions = { state_keep; state_bad; state_good; state_toggle; NoAction; }
        const entries = {
            (0, 0, 0, 0): state_keep();    // neither transition
            (0, 0, _, _): state_good();    // bad->good only: good either way
            (_, _, 0, 0): state_bad();     // good->bad only: bad either way
            (_, _, _, _): state_toggle();  // both: good becomes bad, bad becomes good
        }
        // Never taken (the last entry matches everything); a default action cannot address a
        // register through the hash unit on Tofino.
        const default_action = NoAction();
        size = 4;
    }

    action drop_it() { drop = true; }
    // The loss of the state the packet is in now: drop when its threshold always fires or the draw fell
    // below it. Entries in priority order; what matches none keeps the packet.
    table decide {
        key = {
            model: ternary @name("model");
            bad: ternary @name("bad");
            good_always: ternary @name("good_always");
            good_room: ternary @name("good_room");
            bad_always: ternary @name("bad_always");
            bad_room: ternary @name("bad_room");
        }
        actions = { drop_it; NoAction; }
        const entries = {
            (MODEL_BERNOULLI, _, 1, _, _, _): drop_it();
            (MODEL_BERNOULLI, _, _, 0, _, _): NoAction();
            (MODEL_BERNOULLI, _, _, _, _, _): drop_it();
            (MODEL_GILBERT_ELLIOTT, 1, _, _, 1, _): drop_it();
            (MODEL_GILBERT_ELLIOTT, 1, _, _, _, 0): NoAction();
            (MODEL_GILBERT_ELLIOTT, 1, _, _, _, _): drop_it();
            (MODEL_GILBERT_ELLIOTT, _, 1, _, _, _): drop_it();
            (MODEL_GILBERT_ELLIOTT, _, _, 0, _, _): NoAction();
            (MODEL_GILBERT_ELLIOTT, _, _, _, _, _): drop_it();
        }
        const default_action = NoAction();
        size = 16;
    }

    apply {
        drop = false;
        policy.apply();
        transition_value = transition_draw.get();
        loss_value = loss_draw.get();
        if (good_room == THRESHOLD_ALWAYS) { good_always = 1; }
        if (bad_room == THRESHOLD_ALWAYS) { bad_always = 1; }
        if (p_room == THRESHOLD_ALWAYS) { p_always = 1; }
        if (r_room == THRESHOLD_ALWAYS) { r_always = 1; }
        rooms.apply();
        if (active) {
            if (model == MODEL_GILBERT_ELLIOTT) {
                gilbert_elliott_state.apply();
            }
            decide.apply();
        }
    }
}

#endif
