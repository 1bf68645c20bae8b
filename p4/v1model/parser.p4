// Parser, checksums and deparser. Only UDP packets to LTA_PORT are parsed as LTA; a truncated LTA
// header or payload leaves that header invalid (BMv2 still runs ingress, which counts it malformed).
#ifndef LTA_PARSER
#define LTA_PARSER

#include "headers.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IP_PROTO_UDP = 17;

parser LtaParser(packet_in packet, out headers_t hdr, inout lta_metadata_t meta,
                 inout standard_metadata_t standard_metadata) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.protocol) {
            (5, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            LTA_PORT: parse_lta;
            default: accept;
        }
    }
    state parse_lta {
        packet.extract(hdr.lta);
        packet.extract(hdr.payload);
        transition accept;
    }
}

control LtaVerifyChecksum(inout headers_t hdr, inout lta_metadata_t meta) {
    apply {
        // A bad IPv4 header checksum sets standard_metadata.checksum_error; ingress drops the packet.
        verify_checksum(
            hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

control LtaComputeChecksum(inout headers_t hdr, inout lta_metadata_t meta) {
    apply {
        // Egress rewrites the IPv4 addresses of every packet it sends.
        update_checksum(
            hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

control LtaDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.lta);
        packet.emit(hdr.payload);
    }
}

#endif
