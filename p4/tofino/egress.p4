// Egress: packets on their way to the recirculation port pass untouched; every other packet is one
// replica or one resend. The receiver is egress_rid for multicast replicas (egress_rid = worker id) and
// the bridged receiver for a resend. Each passes its receiver's drop policy (down for RESULT, param for
// PARAM / PARAM_REQ unless CRITICAL), then is readdressed and counted tx_packets.
#ifndef LTA_EGRESS
#define LTA_EGRESS

#include "headers.p4"
#include "counters.gen.p4"
#include "drop_policy.p4"
#include "worker_address.p4"

control LtaEgress(inout headers_t hdr, inout egress_metadata_t meta,
                  in egress_intrinsic_metadata_t eg_intr_md,
                  in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                  inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                  inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    DropPolicy() down_loss;
    DropPolicy() param_loss;
    WorkerAddress() worker_address;
    EgressCounters() counters;
    bool drop;
    bit<8> receiver_xor;  // 0: the receiver is the sender itself
    action compute_receiver_xor() { receiver_xor = meta.receiver ^ hdr.lta.worker_id; }
    // Keyless: keeps the XOR a field for the gateway (the compiler would fold it into the condition).
    table receiver_check {
        actions = { compute_receiver_xor; }
        const default_action = compute_receiver_xor();
        size = 1;
    }

    apply {
        if (hdr.bridge.emit != EMIT_RECIRC && hdr.lta.isValid()) {
            if (hdr.bridge.emit == EMIT_RESEND) {
                meta.receiver = hdr.bridge.receiver;
            } else {
                meta.receiver = (bit<8>)eg_intr_md.egress_rid;
            }
            receiver_check.apply();
            meta.outcome = BRANCH_TX_PACKETS;
            drop = false;
            if (hdr.lta.op == OP_RESULT) {
                down_loss.apply(hdr.lta.job_id, meta.receiver, true, drop);
                if (drop) {
                    meta.outcome = BRANCH_DROP_POLICY_DOWN;
                }
            } else if (receiver_xor == 0) {
                meta.outcome = BRANCH_NONE;  // the sender's own copy of its PARAM: not a packet sent
            } else {
                if ((hdr.lta.flags & FLAG_CRITICAL) == 0) {
                    param_loss.apply(hdr.lta.job_id, meta.receiver, true, drop);
                }
                if (drop) {
                    meta.outcome = BRANCH_DROP_POLICY_PARAM;
                }
            }
            if (meta.outcome == BRANCH_TX_PACKETS) {
                worker_address.apply(hdr, meta.receiver);
            } else {
                eg_dprsr_md.drop_ctl = 1;
            }
            counters.apply(hdr.lta.job_id, meta.outcome);
        }
        hdr.bridge.setInvalid();
    }
}

#endif
