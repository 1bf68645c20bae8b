// Egress: one pass per replica. The receiver is egress_rid for multicast replicas (egress_rid = worker
// id) and meta.receiver for a unicast resend. Each replica passes its receiver's drop policy (down for
// RESULT, param for PARAM / PARAM_REQ unless CRITICAL; none for a leaf's partial going up, receiver
// LTA_UPLINK), then is readdressed and counted tx_packets.
// An OWNER RESULT's replicas to other workers than its owner leave nothing and count nothing.
#ifndef LTA_EGRESS
#define LTA_EGRESS

#include "headers.p4"
#include "counters.gen.p4"
#include "drop_policy.p4"
#include "worker_address.p4"

const bit<32> PKT_INSTANCE_TYPE_REPLICATION = 5;

control LtaEgress(inout headers_t hdr, inout lta_metadata_t meta,
                  inout standard_metadata_t standard_metadata) {
    DropPolicy() down_loss;
    DropPolicy() param_loss;
    WorkerAddress() worker_address;
    EgressCounters() counters;
    bit<8> receiver;
    bit<8> outcome;
    bool drop;

    apply {
        if (hdr.lta.isValid()) {
            receiver = (standard_metadata.instance_type == PKT_INSTANCE_TYPE_REPLICATION)
                ? (bit<8>)standard_metadata.egress_rid : meta.receiver;
            outcome = BRANCH_TX_PACKETS;
            drop = false;
            if (hdr.lta.op == OP_RESULT && (hdr.lta.flags & FLAG_OWNER) != 0 && receiver != meta.slot.owner) {
                outcome = BRANCH_NONE;
            } else if (hdr.lta.op == OP_RESULT) {
                down_loss.apply(hdr.lta.job_id, receiver, drop);
                if (drop) {
                    outcome = BRANCH_DROP_POLICY_DOWN;
                }
            } else if (receiver == LTA_UPLINK) {
                // a leaf's partial to its uplink: no policy here (the spine's up policy, by leaf, applies)
            } else if (receiver == hdr.lta.worker_id) {
                outcome = BRANCH_NONE;  // the sender's own copy of its PARAM: not a packet sent
            } else {
                if ((hdr.lta.flags & FLAG_CRITICAL) == 0) {
                    param_loss.apply(hdr.lta.job_id, receiver, drop);
                }
                if (drop) {
                    outcome = BRANCH_DROP_POLICY_PARAM;
                }
            }
            if (outcome == BRANCH_TX_PACKETS) {
                worker_address.apply(hdr, receiver);
                hdr.udp.checksum = 0;  // optional over IPv4; the payload changed
            } else {
                mark_to_drop(standard_metadata);
            }
            counters.apply((bit<32>)hdr.lta.job_id, outcome);
        }
    }
}

#endif
