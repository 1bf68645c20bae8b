// Worker addresses: every packet the switch sends (RESULT replicas, resends, PARAM copies) is
// readdressed to its receiver. The switch's own addresses are the ones the worker wrote as destination.
// Managed by controlplane/jobs.py (table LtaEgress.worker_address.worker_addresses).
#ifndef LTA_WORKER_ADDRESS
#define LTA_WORKER_ADDRESS

#include "headers.p4"

control WorkerAddress(inout headers_t hdr, in bit<8> receiver) {
    action set_address(bit<48> mac, bit<32> ipv4, bit<16> udp_port) {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = ipv4;
        hdr.udp.src_port = LTA_PORT;
        hdr.udp.dst_port = udp_port;
        hdr.udp.checksum = 0;  // optional over IPv4; the payload was rewritten
    }
    table worker_addresses {
        key = {
            hdr.lta.job_id: exact @name("job_id");
            receiver: exact @name("worker_id");
        }
        actions = { set_address; NoAction; }
        default_action = NoAction();
        size = 4096;
    }
    apply { worker_addresses.apply(); }
}

#endif
