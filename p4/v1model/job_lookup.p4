// Job lookup: job_id -> the job's shape and role. Managed by controlplane/jobs.py (tables
// LtaIngress.job_lookup.jobs and LtaIngress.job_lookup.job_roles).
#ifndef LTA_JOB_LOOKUP
#define LTA_JOB_LOOKUP

#include "headers.p4"

control JobLookup(in lta_t lta, inout lta_metadata_t meta) {
    // generation changes on every reset: slots last written under another generation read as unused,
    // which resets a job without register writes (BMv2 cannot write registers over P4Runtime).
    action set_job(bit<8> n_workers, bit<8> quorum, bit<16> pool_size, bit<32> slot_base,
                   bit<16> mcast_grp, bit<32> generation) {
        meta.job_known = true;
        meta.n_workers = n_workers;
        meta.quorum = quorum;
        meta.pool_size = pool_size;
        meta.slot_base = slot_base;
        meta.mcast_grp = mcast_grp;
        meta.generation = generation;
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
    // The job's role in a hierarchy (docs/protocol.md, "Hierarchy"): no entry is a flat job. A leaf
    // sends its closed rounds to uplink_port as contributor leaf_id and takes RESULTs only from there.
    action flat() {
        meta.role = ROLE_FLAT;
    }
    action leaf(bit<9> uplink_port, bit<8> leaf_id) {
        meta.role = ROLE_LEAF;
        meta.uplink_port = uplink_port;
        meta.leaf_id = leaf_id;
    }
    action spine() {
        meta.role = ROLE_SPINE;
    }
    table job_roles {
        key = { lta.job_id: exact @name("job_id"); }
        actions = { leaf; spine; @defaultonly flat; }
        default_action = flat();
        size = LTA_MAX_JOBS;
    }
    apply {
        jobs.apply();
        job_roles.apply();
    }
}

#endif
