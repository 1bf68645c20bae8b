// Emulated loss, one instance per direction: up (GRAD, by sender, ingress), down (RESULT, by receiver,
// egress) and param (PARAM / PARAM_REQ, by receiver, egress). Managed by controlplane/drop_policies.py.
// A policy for one worker (ternary worker_id with mask 0xff, higher priority) wins over the job's
// policy for all workers (worker_id wildcard). Probabilities are thresholds: drop when a uniform draw in
// [0, 2^32 - 2] is below round(p * (2^32 - 1)), so p = 1 always drops and p = 0 never does.
#ifndef LTA_DROP_POLICY
#define LTA_DROP_POLICY

#include "headers.p4"

const bit<32> DRAW_MAX = 0xfffffffe;

control DropPolicy(in bit<16> job_id, in bit<8> worker_id, out bool drop) {
    // Gilbert-Elliott state per (job, worker) of this direction: 1 = bad.
    register<bit<1>>(4096) gilbert_elliott_bad;
    bit<32> draw;
    bit<1> bad;

    action no_loss() {
        drop = false;
    }
    action bernoulli(bit<32> loss) {
        random(draw, 0, DRAW_MAX);
        drop = draw < loss;
    }
    // netem's gemodel: first move the state (good->bad with p, bad->good with r), then drop with
    // the new state's loss probability.
    action gilbert_elliott(bit<32> p, bit<32> r, bit<32> loss_good, bit<32> loss_bad) {
        bit<32> state_index = (((bit<32>)job_id) << 6) + (bit<32>)worker_id;
        gilbert_elliott_bad.read(bad, state_index);
        random(draw, 0, DRAW_MAX);
        bad = (bad == 1) ? ((draw < r) ? (bit<1>)0 : (bit<1>)1) : ((draw < p) ? (bit<1>)1 : (bit<1>)0);
        gilbert_elliott_bad.write(state_index, bad);
        random(draw, 0, DRAW_MAX);
        drop = draw < ((bad == 1) ? loss_bad : loss_good);
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
    apply {
        drop = false;
        policy.apply();
    }
}

#endif
