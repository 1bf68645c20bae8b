// Result emit (end of the harvest pass): the packet, whose header and payload the three passes filled from
// the slot registers, becomes the RESULT and leaves: to the job's multicast group (one replica per worker,
// egress_rid = worker id) or back to the port of the worker that asked (flag RETX).
// One table with an action per way out rather than an if between statements: the compiler makes a table of
// every statement run around an if, and this ends ingress's last stage, which holds at most 16 tables.
#ifndef LTA_RESULT_EMIT
#define LTA_RESULT_EMIT

#include "headers.p4"

control ResultEmit(inout headers_t hdr, inout ingress_intrinsic_metadata_for_tm_t ig_tm_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    action emit_multicast() {
        hdr.lta.op = OP_RESULT;
        ig_tm_md.mcast_grp_a = hdr.pass.mcast_grp;
        hdr.bridge.setValid();
        hdr.bridge.emit = hdr.pass.emit;
        hdr.bridge.receiver = hdr.pass.receiver;
        hdr.pass.setInvalid();
        ig_dprsr_md.drop_ctl = 0;
    }
    action emit_resend() {
        hdr.lta.op = OP_RESULT;
        hdr.lta.flags = hdr.lta.flags | FLAG_RETX;
        ig_tm_md.ucast_egress_port = hdr.pass.reply_port;
        hdr.bridge.setValid();
        hdr.bridge.emit = hdr.pass.emit;
        hdr.bridge.receiver = hdr.pass.receiver;
        hdr.pass.setInvalid();
        ig_dprsr_md.drop_ctl = 0;
    }
    table emit {
        key = { hdr.pass.emit: exact @name("emit"); }
        actions = { emit_multicast; emit_resend; }
        const entries = {
            EMIT_RESEND: emit_resend();
        }
        const default_action = emit_multicast();
        size = 2;
    }
    apply {
        emit.apply();
    }
}

#endif
