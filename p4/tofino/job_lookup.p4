// Job lookup (Tofino): job_id -> the job's shape. Managed by controlplane/jobs.py (table LtaIngress.job_lookup.jobs).
#ifndef LTA_JOB_LOOKUP
#define LTA_JOB_LOOKUP

#include "headers.p4"

control JobLookup(in lta_t lta, inout ingress_metadata_t meta) {
    // `generation` keeps the entry the same on every target; Tofino ignores it: there the control plane
    // resets a job by clearing its slot range through BfRt, which can write registers.
    action set_job(bit<8> n_workers, bit<8> quorum, bit<16> pool_size, bit<32> slot_base,
                   bit<16> mcast_grp, bit<32> generation) {
        meta.job_known = true;
        meta.n_workers = n_workers;
        meta.quorum = (bit<32>)quorum;
        meta.pool_size = pool_size;
        meta.slot_base = slot_base[15:0];  // slot_base + pool_size <= LTA_SLOT_CAPACITY = 16384
        meta.mcast_grp = mcast_grp;
    }
    action unknown_job() {
        meta.job_known = false;
    }
    table jobs {
        key = { lta.job_id: exact @name("job_id"); }
        actions = { set_job; @defaultonly unknown_job; }
        default_action = unknown_job();
        size = LTA_MAX_JOBS;
    }
    apply { jobs.apply(); }
}

#endif
