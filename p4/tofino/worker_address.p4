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
        // The rest of the IPv4 header is the switch's own, whatever the packet arrived with (as
        // softswitch/rawport.py's build_udp_frame): no options, DF, TTL 64, lengths from the datagram.
        hdr.ipv4.version = 4;
        hdr.ipv4.ihl = 5;
        hdr.ipv4.diffserv = 0;
        hdr.ipv4.total_len = hdr.udp.length + 20;
        hdr.ipv4.identification = 0;
        hdr.ipv4.flags = 2;
        hdr.ipv4.frag_offset = 0;
        hdr.ipv4.ttl = 64;
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
