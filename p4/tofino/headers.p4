// Headers and metadata of the LTA Tofino (TNA) program. Wire format: docs/protocol.md; what differs from
// the v1model program: docs/protocol.md, "Tofino".
#ifndef LTA_HEADERS
#define LTA_HEADERS

#include "protocol_constants.gen.p4"
#include "payload.gen.p4"

// Slots per pipe: every slot register has this many entries; a job owns [slot_base, slot_base + pool).
// The control plane reads the size back from bf-rt.json (register LtaIngress.slot_update.slot_seq).
const bit<32> LTA_SLOT_CAPACITY = 16384;
// Workers per job on Tofino: the bitmap register is 32 bits (one stateful ALU word).
const bit<32> LTA_TOFINO_MAX_WORKERS = 32;
// The recirculation port of a pipe is (pipe << 7) | 68 on Tofino 1.
const bit<7> RECIRC_PORT_LOCAL = 68;

// Passes a packet makes through ingress (docs/protocol.md, "Tofino").
const bit<8> PASS_CONTROL = 0;   // from a worker: checks, up-loss policy, counters
const bit<8> PASS_SLOT = 3;      // recirculated GRAD / FLUSH: the slot state machine and its branch counter
const bit<8> PASS_ELEMENTS = 1;  // recirculated again: the K accumulators (store / add / max / load hi)
const bit<8> PASS_HARVEST = 2;   // and again: the lo halves and the stored RESULT fields; sent out

// How a packet leaves ingress (the bridged header tells egress).
const bit<8> EMIT_NONE = 0;
const bit<8> EMIT_MULTICAST = 1;  // RESULT to every worker of the job
const bit<8> EMIT_RESEND = 2;     // RESULT back to the worker that asked
const bit<8> EMIT_PARAM = 3;      // PARAM / PARAM_REQ to the other workers
const bit<8> EMIT_RECIRC = 4;     // to the pipe's recirculation port, for the next pass

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
// (tests/test_p4_sources.py checks it for both programs).
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

// Carried in front of the Ethernet header while a packet recirculates (never leaves the switch).
header lta_pass_t {
    bit<8>  pass;
    bit<8>  element_op;
    bit<8>  emit;         // what to do after the harvest pass: EMIT_MULTICAST or EMIT_RESEND
    bit<8>  receiver;     // the worker a resend goes back to (the sender, from the control pass on)
    bit<7>  _pad1;
    PortId_t reply_port;  // the ingress port of the worker a resend goes back to
    bit<16> mcast_grp;
    bit<16> slot_index;   // slot_base + slot (below LTA_SLOT_CAPACITY)
}

// Ingress -> egress (bridged; stripped in egress).
header lta_bridge_t {
    bit<8>  emit;
    bit<8>  receiver;     // the worker a resend goes to (multicast replicas use egress_rid)
}

struct headers_t {
    lta_bridge_t  bridge;
    lta_pass_t    pass_out;  // written for the next pass (ingress only; the parsed one is then invalidated)
    lta_pass_t    pass;      // parsed: the pass a recirculated packet is in
    ethernet_t    ethernet;
    ipv4_t        ipv4;
    udp_t         udp;
    lta_t         lta;
    lta_payload_t payload;
}

// One accumulator register word: two int32 elements.
struct acc_pair_t {
    bit<32> lo;
    bit<32> hi;
}

// A slot register word: {lo, hi} halves updated by one register action.
struct slot_pair_t {
    bit<32> lo;
    bit<32> hi;
}

struct ingress_metadata_t {
    bool    ipv4_checksum_err;  // the parser's IPv4 checksum verification failed
    // job lookup
    bool    job_known;
    bit<8>  n_workers;
    bit<32> quorum;  // 32 bits: compared with slot_count's 32-bit count
    bit<16> pool_size;
    bit<16> slot_base;    // the action's 32-bit slot_base, below LTA_SLOT_CAPACITY

    bit<16> mcast_grp;
    // worker check
    bool    worker_known;
    PortId_t worker_port;
    // loss emulation
    bool    policy_drop;
    // slot state machine (slot pass)
    bit<16> slot_index;   // 16 bits: added to the packet's 16-bit slot in one 16-bit operation
    bit<32> worker_bit;   // 1 << worker_id
    bit<32> closed_flags; // RESULT_CLOSED | worker_id << 8
    bit<32> packet_round; // exp | MAX << 8 | FLUSHED << 9 (a FLUSH)
    bit<32> sat_flags;    // the packet's FLAG_SATURATED
    bit<8>  slot_mode;    // slot_update.p4's MODE_*
    bit<1>  quorum_of_one;
    bit<8>  branch;       // decided by the checks and the up-loss policy, or the slot state machine
    bool    result_quorum;
    bit<16> counter_index;
}

struct egress_metadata_t {
    bit<8>  receiver;
    bit<8>  outcome;
}

#endif
