// Result emit: turn the packet into the slot's RESULT (every field from the slot state just read from
// or written to the registers; the payload already holds the accumulators) and address it: multicast
// to the job's group (one replica per worker, egress_rid = worker id) or back to the asking worker. A
// leaf's partial (EMIT_UP) is the same packet as a GRAD or FLUSH from contributor leaf_id to its uplink.
// An OWNER round's RESULT goes to the job's group whether it closed or is resent: egress keeps the
// owner's replica (a flat job's only: a leaf or a spine never stores OWNER).
#ifndef LTA_RESULT_EMIT
#define LTA_RESULT_EMIT

#include "headers.p4"

control ResultEmit(inout lta_t lta, inout lta_metadata_t meta, inout standard_metadata_t standard_metadata) {
    apply {
        meta.receiver = lta.worker_id;
        lta.op = OP_RESULT;
        lta.flags = meta.slot.flags;
        if (meta.emit == EMIT_RESEND || meta.retx) {
            lta.flags = lta.flags | FLAG_RETX;
        }
        lta.exp = meta.slot.exp;
        lta.worker_id = meta.slot.closer;
        lta.count = meta.slot.count;
        lta.nelem = meta.slot.nelem;
        lta.seq = meta.slot.seq;
        lta.step = meta.slot.step;
        lta.chunk = meta.slot.chunk;
        lta.weight = meta.slot.weight;
        lta.bitmap = meta.slot.bitmap;
        if (meta.emit == EMIT_UP) {
            lta.op = meta.up_op;
            lta.worker_id = meta.leaf_id;
            meta.receiver = LTA_UPLINK;
            standard_metadata.egress_spec = meta.uplink_port;
        } else if (meta.emit == EMIT_MULTICAST || (meta.slot.flags & FLAG_OWNER) != 0) {
            standard_metadata.mcast_grp = meta.mcast_grp;
        } else {
            standard_metadata.egress_spec = standard_metadata.ingress_port;
        }
    }
}

#endif
