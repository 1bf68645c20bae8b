// Result emit (end of the harvest pass): the packet, whose header and payload the three passes filled from
// the slot registers, becomes the RESULT and leaves: to the job's multicast group (one replica per worker,
// egress_rid = worker id) or back to the port of the worker that asked (flag RETX).
#ifndef LTA_RESULT_EMIT
#define LTA_RESULT_EMIT

#include "headers.p4"

control ResultEmit(inout headers_t hdr, inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    apply {
        hdr.lta.op = OP_RESULT;
        if (hdr.pass.emit == EMIT_RESEND) {
            hdr.lta.flags = hdr.lta.flags | FLAG_RETX;
            ig_tm_md.ucast_egress_port = hdr.pass.reply_port;
        } else {
            ig_tm_md.mcast_grp_a = hdr.pass.mcast_grp;
        }
        hdr.bridge.setValid();
        hdr.bridge.emit = hdr.pass.emit;
        hdr.bridge.receiver = hdr.pass.receiver;
        hdr.pass.setInvalid();
    }
}

#endif
