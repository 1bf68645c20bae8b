// Ingress (Tofino): the control pass runs the checks of docs/protocol.md in order (a damaged IPv4/UDP
// header first) and the up-loss policy; a GRAD or FLUSH that passes them recirculates for the slot pass
// (the slot state machine), one that changes or reads the K accumulators once more for the element pass,
// and one that leaves as a RESULT once more for the harvest pass (docs/protocol.md, "Tofino"). The
// control pass and the recirculated passes are the two branches of one if, so the compiler may place
// them in the same stages. Every LTA packet counts rx_packets in its control pass and exactly one branch
// counter (indexed by its job, 0 if unknown): in the control pass, or in the slot pass for the slot state
// machine's branches; worker_rx counts every packet that passed the worker check, at
// job_id * LTA_MAX_WORKERS + worker_id.
#ifndef LTA_INGRESS
#define LTA_INGRESS

#include "headers.p4"
#include "counters.gen.p4"
#include "job_lookup.p4"
#include "worker_check.p4"
#include "drop_policy.p4"
#include "slot_update.p4"
#include "result_emit.p4"

// The slot pass's quorum is a stateful ALU input: in one 32-bit container (split over three, slot_count's
// table could not reach it from the search bus).
@pa_container_size("ingress", "meta.quorum", 32)
control LtaIngress(inout headers_t hdr, inout ingress_metadata_t meta,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    JobLookup() job_lookup;
    WorkerCheck() worker_check;
    DropPolicy() up_loss;
    SlotPrep() slot_prep;
    SlotUpdate() slot_update;
    SlotElements0() elements;  // the first group of accumulator pairs; the others in slot_update
    PayloadClear() payload_clear;
    ResultEmit() result_emit;
    IngressRxCounter() rx_counter;
    IngressBranchCounters() branch_counters;
    @name(".worker_rx")
    Counter<bit<32>, bit<12>>(LTA_MAX_JOBS * LTA_MAX_WORKERS, CounterType_t.PACKETS) worker_rx;
    Hash<bit<12>>(HashAlgorithm_t.IDENTITY) worker_rx_hash;

    // To this pipe's recirculation port, with the pass header in front.
    action recirculate() {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ RECIRC_PORT_LOCAL;
        hdr.bridge.setValid();
        hdr.bridge.emit = EMIT_RECIRC;
        hdr.bridge.receiver = 0;
        ig_dprsr_md.drop_ctl = 0;
    }
    // Each recirculation is one action, called alone: the compiler makes a table of every action call and
    // of every run of statements around it, and these end ingress's last stage, which holds at most 16
    // tables (with the recirculation as a call between statements, two tables a site and the branch
    // counters a stage later).
    // Control pass -> slot pass.
    action to_slot_pass() {
        hdr.pass_out.setValid();
        hdr.pass_out.pass = PASS_SLOT;
        hdr.pass_out.element_op = 0;
        hdr.pass_out.emit = EMIT_NONE;
        hdr.pass_out.receiver = hdr.lta.worker_id;
        hdr.pass_out.reply_port = ig_intr_md.ingress_port;
        recirculate();
    }
    // Slot pass -> element pass: decide wrote pass_out's pass, element_op and emit.
    action to_element_pass() {
        hdr.pass_out.receiver = hdr.pass.receiver;
        hdr.pass_out.reply_port = hdr.pass.reply_port;
        hdr.pass_out.slot_index = meta.slot_index;
        hdr.pass_out.mcast_grp = meta.mcast_grp;
        hdr.pass.setInvalid();
        recirculate();
    }
    // Element pass -> harvest pass (the parsed pass header goes on).
    action to_harvest_pass() {
        hdr.pass.pass = PASS_HARVEST;
        recirculate();
    }

    // Gateways compare fields with constants: differences are computed first, in keyless tables (the
    // compiler would fold a temporary back into the condition).
    bit<16> ip_udp_len_diff;  // total_len - udp.length: 20 for a sound header
    bit<16> slot_room;        // pool_size |-| slot: 0 when the slot is out of the job's range
    bit<16> nelem_over;       // nelem |-| K: nonzero when nelem > K
    action compute_ip_len() {
        ip_udp_len_diff = hdr.ipv4.total_len - hdr.udp.length;
        nelem_over = hdr.lta.nelem |-| LTA_ELEMS;
    }
    table ip_len {
        actions = { compute_ip_len; }
        const default_action = compute_ip_len();
        size = 1;
    }
    action compute_slot_room() { slot_room = meta.pool_size |-| hdr.lta.slot; }
    table slot_range {
        actions = { compute_slot_room; }
        const default_action = compute_slot_room();
        size = 1;
    }

    apply {
        ig_dprsr_md.drop_ctl = 1;  // nothing leaves unless a branch below says so
        meta.branch = BRANCH_NONE;
        meta.result_quorum = false;
        meta.policy_drop = false;
        meta.counter_index = 0;
        // Slot, element and harvest passes are internal packets: nothing is checked again.
        bool recirculated = hdr.pass.isValid();
        // (Tofino: a bool takes a constant or one comparison; compound conditions live in ifs.)
        bool lta_packet = false;
        if (!recirculated && hdr.udp.isValid() && hdr.udp.dst_port == LTA_PORT) {
            lta_packet = true;
        }
        ip_len.apply();  // no side effect: for every packet, from stage 0
        // The accumulators next: they need nothing the other passes decide (those write pass_out, not
        // the parsed pass header), and Tofino 1 places tables in the order they are applied.
        if (recirculated) {
            elements.apply(hdr.payload, hdr.pass.slot_index, hdr.pass.element_op, hdr.pass.pass);
        }
        // The job is looked up in every pass of an LTA packet (no side effect): the control pass
        // checks it, the slot pass takes the slot's base, quorum and group from it again rather than
        // from the pass header; the element and harvest passes do not use it.
        if (hdr.lta.isValid()) {
            job_lookup.apply(hdr.lta, meta);
            slot_range.apply();
        }
        // Which passes count their branch: in the control pass every LTA packet but a slot candidate,
        // and a slot candidate only when the up-loss policy drops it; every slot pass (count_branch,
        // set before the state machine). The counters' gate reads these flags and meta.policy_drop
        // itself, so the counters wait only for the stage that decides the branch (the policy's or the
        // slot chain's `decide`), not for one more stage of flag writes after it.
        bool count_branch = false;
        bool slot_candidate = false;  // control pass: passed every check before the up-loss policy
        if (!recirculated) {
            // ---- control pass: the checks in order and the up-loss policy ----
            bool up_active = false;       // the up-loss policy applies (a checked, non-CRITICAL GRAD)
            if (lta_packet) {
                if (meta.job_known) {
                    meta.counter_index = hdr.lta.job_id;
                }
                // A damaged IPv4/UDP header or a truncated packet: nothing of it is trusted, the job id
                // included, so it counts on index 0. (Trailing bytes after the payload are not seen
                // here: Tofino's ingress does not know the frame length.) A gateway reads at most 4
                // bytes and 12 bits, so the tests are split over three ifs of one outcome.
                bool damaged = false;
                if (meta.ipv4_checksum_err || (hdr.ipv4.flags & 1) == 1) {
                    damaged = true;
                } else if (hdr.ipv4.frag_offset != 0 || ip_udp_len_diff != 20) {
                    damaged = true;
                } else if (ig_prsr_md.parser_err != 0) {
                    damaged = true;
                }
                if (damaged) {
                    meta.counter_index = 0;
                    meta.branch = BRANCH_DROP_MALFORMED;
                } else if (!hdr.lta.isValid() || hdr.lta.version != LTA_VERSION || hdr.lta.op < OP_GRAD
                        || (hdr.lta.op > OP_PARAM_REQ && hdr.lta.op != OP_HEARTBEAT)
                        || hdr.lta.op == OP_RESULT) {
                    meta.branch = BRANCH_DROP_MALFORMED;
                } else if (!meta.job_known) {
                    meta.branch = BRANCH_DROP_UNKNOWN_JOB;
                } else if (!hdr.payload.isValid() || hdr.udp.length != LTA_UDP_BYTES) {
                    meta.branch = BRANCH_DROP_MALFORMED;
                } else if (nelem_over != 0) {
                    meta.branch = BRANCH_DROP_MALFORMED;
                } else {
                    worker_check.apply(hdr.lta, ig_intr_md.ingress_port, meta);
                    if (meta.worker_known) {
                        // A counter's index must be one field or a hash: the identity hash of
                        // job_id[5:0] ++ worker_id[5:0] is job_id * 64 + worker_id for a known job and
                        // worker (both below 64).
                        bit<12> worker_rx_index = worker_rx_hash.get({hdr.lta.job_id[5:0],
                                                                      hdr.lta.worker_id[5:0]});
                        worker_rx.count(worker_rx_index);
                    }
                    if (!meta.worker_known || (bit<32>)hdr.lta.worker_id >= LTA_TOFINO_MAX_WORKERS) {
                        meta.branch = BRANCH_DROP_BAD_WORKER;
                    } else if (hdr.lta.op == OP_HEARTBEAT) {
                        meta.branch = BRANCH_HEARTBEAT;  // counted, nothing leaves
                    } else if (hdr.lta.op == OP_PARAM || hdr.lta.op == OP_PARAM_REQ) {
                        // Replicated unchanged; egress drops the sender's own copy.
                        if (hdr.lta.op == OP_PARAM) {
                            meta.branch = BRANCH_PARAM_FWD;
                        } else {
                            meta.branch = BRANCH_PARAM_REQ_FWD;
                        }
                        ig_tm_md.mcast_grp_a = meta.mcast_grp;
                        hdr.bridge.setValid();
                        hdr.bridge.emit = EMIT_PARAM;
                        hdr.bridge.receiver = 0;
                        ig_dprsr_md.drop_ctl = 0;
                    } else if (slot_room == 0) {
                        meta.branch = BRANCH_DROP_SLOT_RANGE;
                    } else {
                        slot_candidate = true;
                        // Counted only if the policy drops it; else the slot pass counts its branch.
                        meta.branch = BRANCH_DROP_POLICY_UP;
                        if (hdr.lta.op == OP_GRAD && (hdr.lta.flags & FLAG_CRITICAL) == 0) {
                            up_active = true;
                        }
                    }
                }
            }
            // The policy is looked up for every packet of this pass (no side effect); only its state
            // register and decision wait for the checks above (drop_policy.p4).
            up_loss.apply(hdr.lta.job_id, hdr.lta.worker_id, up_active, meta.policy_drop);
            if (lta_packet) {
                rx_counter.apply(meta.counter_index);  // here: Tofino 1 places tables in applied order
            }
            if (slot_candidate) {
                if (!meta.policy_drop) {
                    // On to the slot pass, which counts the branch the slot state machine decides.
                    to_slot_pass();
                }
            }
        } else {
            // ---- slot pass: the slot state machine; element pass: the stored RESULT fields;
            // harvest pass: their lo halves. A dropped packet never gets here (no policy_drop).
            // First (no side effect): in the slot pass the slot index, the sender's bit, the round word
            // and the mode. Only in this branch, so its fields and the control pass's (the up-loss
            // policy's draws and rooms) are never on one control-flow path: the compiler may overlay
            // them in the same PHV containers.
            if (hdr.pass.pass == PASS_SLOT) {
                meta.counter_index = hdr.lta.job_id;
                count_branch = true;
            }
            slot_prep.apply(hdr, meta);
            slot_update.apply(hdr, meta);
            if (hdr.pass.pass == PASS_SLOT) {
                if (hdr.pass_out.isValid()) {
                    // The slot needs its accumulators: on to the element pass, with a payload of
                    // zeros for a LOAD (an add of zeros) or a CLEAR (a store of zeros).
                    if (hdr.pass_out.element_op == ELEMENT_OP_LOAD
                            || hdr.pass_out.element_op == ELEMENT_OP_CLEAR) {
                        payload_clear.apply(hdr.payload);
                    }
                    to_element_pass();
                }
            } else if (hdr.pass.pass == PASS_ELEMENTS) {
                if (hdr.pass.emit != EMIT_NONE) {
                    to_harvest_pass();
                }
            } else {
                result_emit.apply(hdr, ig_tm_md, ig_dprsr_md);
            }
        }
        if (count_branch || meta.policy_drop || (lta_packet && !slot_candidate)) {
            // The branch: the checks' or the up-loss policy's (control pass; policy_drop is false in
            // every other pass), or the slot state machine's (slot pass).
            branch_counters.apply(meta.counter_index, meta.branch, meta.result_quorum);
        }
    }
}

#endif
