// Headers and per-packet metadata of the LTA v1model program (wire format: docs/protocol.md).
#ifndef LTA_HEADERS
#define LTA_HEADERS

#include "protocol_constants.gen.p4"
#include "payload.gen.p4"

// Total slots over all jobs: a job's pool is [slot_base, slot_base + pool_size) of every slot register.
// The control plane reads this size back from the P4Info (register LtaIngress.slot_update.slot_seq).
const bit<32> LTA_SLOT_CAPACITY = 16384;

header ethernet_t {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_t {
    bit<4>  version;
    bit<4>  ihl;
    bit<8>  diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3>  flags;
    bit<13> frag_offset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

// The LTA header: names, order and widths equal hostlib.protocol.HEADER_FIELDS
// (tests/test_p4_sources.py checks it).
header lta_t {
    bit<8>  version;
    bit<8>  op;
    bit<8>  flags;
    bit<8>  exp;        // signed on the wire; the switch only compares it for equality
    bit<16> job_id;
    bit<8>  worker_id;
    bit<8>  count;
    bit<16> slot;
    bit<16> nelem;
    bit<32> seq;
    bit<32> step;
    bit<32> chunk;
    bit<32> weight;
    bit<64> bitmap;
}

struct headers_t {
    ethernet_t    ethernet;
    ipv4_t        ipv4;
    udp_t         udp;
    lta_t         lta;
    lta_payload_t payload;
}

// The scalar half of one slot, as read from (and written back to) the slot registers.
struct slot_state_t {
    bit<32> seq;
    bit<8>  closed;
    bit<8>  count;
    bit<64> bitmap;
    bit<32> weight;
    bit<8>  exp;
    bit<8>  flags;    // MAX | SATURATED | OWNER of the round
    bit<16> nelem;
    bit<32> step;
    bit<32> chunk;
    bit<8>  closer;   // worker whose packet closed the round (the RESULT's worker_id)
    bit<32> parts;    // a spine: bit l = leaf l's partial is in the round
    bit<8>  leaf_state;  // a leaf: LEAF_PARTIAL, LEAF_FLUSHED or LEAF_FINAL
    bit<8>  owner;    // OWNER rounds: the one worker the RESULT goes to
}

// A leaf's slot (docs/protocol.md, "Hierarchy"): it holds its own partial, a worker FLUSHed that partial,
// or it holds the spine's RESULT (softswitch/batch.py: LEAF_PARTIAL, LEAF_FLUSHED, LEAF_FINAL).
const bit<8> LEAF_PARTIAL = 0;
const bit<8> LEAF_FLUSHED = 1;
const bit<8> LEAF_FINAL = 2;
// The receiver id of a leaf's partial going up (hostlib/p4schema.py UPLINK_WORKER_ID): its address is
// the worker_addresses entry (job, LTA_UPLINK).
const bit<8> LTA_UPLINK = 0xff;

// How a packet leaves ingress: dropped, a RESULT to every worker, a RESULT resent to its sender, or a
// leaf's partial to its uplink.
const bit<2> EMIT_NONE = 0;
const bit<2> EMIT_MULTICAST = 1;
const bit<2> EMIT_RESEND = 2;
const bit<2> EMIT_UP = 3;  // a leaf's partial (GRAD or FLUSH) to its uplink

struct lta_metadata_t {
    // job lookup
    bool    job_known;
    bit<8>  n_workers;
    bit<8>  quorum;
    bit<16> pool_size;
    bit<32> slot_base;
    bit<16> mcast_grp;
    bit<32> generation;   // slots written under another generation read as never used
    // job role (docs/protocol.md, "Hierarchy")
    bit<8>  role;         // ROLE_FLAT (no job_roles entry), ROLE_LEAF or ROLE_SPINE
    bit<9>  uplink_port;  // a leaf: the port toward the spine
    bit<8>  leaf_id;      // a leaf: its contributor id at the spine
    bool    down;         // a RESULT from a leaf's uplink: the spine's answer
    // worker check
    bool    worker_known;
    bit<9>  worker_port;
    // loss emulation
    bool    policy_drop;
    // slot update
    bit<32>      slot_index;
    slot_state_t slot;
    bit<8>  element_op;
    bool    write_slot;
    bool    check_quorum;
    bool    result_quorum;
    bit<2>  emit;
    bool    retx;         // the packet sent carries RETX (besides every EMIT_RESEND)
    bit<8>  up_op;        // EMIT_UP: OP_GRAD or OP_FLUSH
    // counting and replicas
    bit<32> counter_index;
    bit<8>  branch;
    bit<8>  also;         // a second branch counted (up_partial; a spine FLUSH's grad_dup / mismatch)
    bit<8>  receiver;     // the worker a unicast RESULT goes to (replicas use egress_rid)
}

#endif
