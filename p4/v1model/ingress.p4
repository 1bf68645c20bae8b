// Ingress: the checks of docs/protocol.md in order (a damaged IPv4/UDP header first), then the slot
// update or the PARAM replication.
// Every LTA packet counts rx_packets and exactly one branch counter (indexed by its job, 0 if unknown),
// plus at most one more (`also`: up_partial when a leaf sends a closed round up; docs/protocol.md).
// A packet that passes the worker check also counts worker_rx[job_id * LTA_MAX_WORKERS + worker_id]
// (liveness: the control plane marks a worker offline when its count stops moving).
#ifndef LTA_INGRESS
#define LTA_INGRESS

#include "headers.p4"
#include "counters.gen.p4"
#include "job_lookup.p4"
#include "worker_check.p4"
#include "drop_policy.p4"
#include "slot_update.p4"
#include "result_emit.p4"

control LtaIngress(inout headers_t hdr, inout lta_metadata_t meta,
                   inout standard_metadata_t standard_metadata) {
    JobLookup() job_lookup;
    WorkerCheck() worker_check;
    DropPolicy() up_loss;
    SlotUpdate() slot_update;
    ResultEmit() result_emit;
    IngressCounters() counters;
    @name(".worker_rx") counter(LTA_MAX_JOBS * LTA_MAX_WORKERS, CounterType.packets) worker_rx;

    apply {
        bool update = false;  // the packet goes to the slot update (a GRAD or FLUSH, or a leaf's RESULT)
        mark_to_drop(standard_metadata);  // nothing leaves unless a branch below says so
        if (hdr.udp.isValid() && hdr.udp.dst_port == LTA_PORT) {
            meta.branch = BRANCH_NONE;
            meta.also = BRANCH_NONE;
            meta.emit = EMIT_NONE;
            if (hdr.lta.isValid()) {
                job_lookup.apply(hdr.lta, meta);
                // A RESULT reaches a switch only as the spine's answer to a leaf, from the leaf's uplink.
                meta.down = hdr.lta.op == OP_RESULT && meta.job_known && meta.role == ROLE_LEAF
                    && standard_metadata.ingress_port == meta.uplink_port;
            }
            meta.counter_index = meta.job_known ? (bit<32>)hdr.lta.job_id : 0;
            if (standard_metadata.checksum_error == 1 || (hdr.ipv4.flags & 1) == 1
                    || hdr.ipv4.frag_offset != 0 || hdr.ipv4.total_len != hdr.udp.length + 20
                    || standard_metadata.packet_length != (bit<32>)hdr.ipv4.total_len + 14) {
                // A damaged IPv4/UDP header (bad checksum, a fragment, lengths that disagree with each
                // other or with the frame: trailing or missing bytes): nothing of it is trusted, the
                // job id included, so it counts on index 0. (IHL != 5 never reaches here: the parser
                // only parses UDP after a 20-byte IPv4 header.)
                meta.counter_index = 0;
                meta.branch = BRANCH_DROP_MALFORMED;
            } else if (!hdr.lta.isValid() || hdr.lta.version != LTA_VERSION || hdr.lta.op < OP_GRAD
                    || (hdr.lta.op > OP_PARAM_REQ && hdr.lta.op != OP_HEARTBEAT)
                    || (hdr.lta.op == OP_RESULT && !meta.down)) {
                meta.branch = BRANCH_DROP_MALFORMED;
            } else if (!meta.job_known) {
                meta.branch = BRANCH_DROP_UNKNOWN_JOB;
            } else if (!hdr.payload.isValid() || hdr.udp.length != LTA_UDP_BYTES
                    || hdr.lta.nelem > LTA_ELEMS
                    || (meta.role == ROLE_SPINE && (hdr.lta.op == OP_GRAD || hdr.lta.op == OP_FLUSH)
                        && hdr.lta.count != popcount64(hdr.lta.bitmap))) {
                // (a spine: a partial's count must be the size of its bitmap, so no round's count can
                // differ from its bitmap's)
                meta.branch = BRANCH_DROP_MALFORMED;
            } else if (meta.down) {
                // The spine's RESULT at a leaf: no worker check, no up policy (docs/protocol.md, "Hierarchy").
                if (hdr.lta.slot >= meta.pool_size) {
                    meta.branch = BRANCH_DROP_SLOT_RANGE;
                } else {
                    update = true;
                }
            } else {
                worker_check.apply(hdr.lta, standard_metadata.ingress_port, meta);
                if (meta.worker_known) {
                    worker_rx.count((bit<32>)hdr.lta.job_id * LTA_MAX_WORKERS + (bit<32>)hdr.lta.worker_id);
                }
                if (!meta.worker_known) {
                    meta.branch = BRANCH_DROP_BAD_WORKER;
                } else if (hdr.lta.op == OP_HEARTBEAT) {
                    meta.branch = BRANCH_HEARTBEAT;  // counted, nothing leaves
                } else if (hdr.lta.op == OP_PARAM || hdr.lta.op == OP_PARAM_REQ) {
                    // Replicated unchanged; egress drops the sender's own copy.
                    meta.branch = (hdr.lta.op == OP_PARAM) ? BRANCH_PARAM_FWD : BRANCH_PARAM_REQ_FWD;
                    standard_metadata.mcast_grp = meta.mcast_grp;
                } else if (hdr.lta.slot >= meta.pool_size) {
                    meta.branch = BRANCH_DROP_SLOT_RANGE;
                } else {
                    if (hdr.lta.op == OP_GRAD && (hdr.lta.flags & FLAG_CRITICAL) == 0) {
                        up_loss.apply(hdr.lta.job_id, hdr.lta.worker_id, meta.policy_drop);
                    }
                    if (meta.policy_drop) {
                        meta.branch = BRANCH_DROP_POLICY_UP;
                    } else {
                        update = true;
                    }
                }
            }
            if (update) {  // (one call site: BMv2 applies each table from one place)
                slot_update.apply(hdr, meta);
                if (meta.emit != EMIT_NONE) {
                    result_emit.apply(hdr.lta, meta, standard_metadata);
                }
            }
            counters.apply(meta.counter_index, meta.branch, meta.also, meta.result_quorum);
        }
    }
}

#endif
