// Parsers and deparsers. Only UDP to LTA_PORT behind a 20-byte IPv4 header is parsed as LTA. A packet
// arriving on the pipe's recirculation port carries an lta_pass_t header in front of its Ethernet header.
#ifndef LTA_PARSER
#define LTA_PARSER

#include "headers.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IP_PROTO_UDP = 17;

parser LtaIngressParser(packet_in pkt, out headers_t hdr, out ingress_metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    Checksum() ipv4_checksum;

    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition select(ig_intr_md.ingress_port[6:0]) {
            RECIRC_PORT_LOCAL: parse_pass;
            default: parse_ethernet;
        }
    }
    state parse_pass {
        pkt.extract(hdr.pass);
        transition parse_ethernet;
    }
    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        ipv4_checksum.add(hdr.ipv4);
        // A parser field is written once per path, so there is no default before this. The flag the
        // checksum unit writes is read as an error (1: the checksum is wrong), as Intel's switch.p4
        // and other TNA programs do, although tna.p4's comment on verify() says "valid"; metadata
        // starts at 0, so a packet without IPv4 has no error here (it is not LTA either).
        meta.ipv4_checksum_err = ipv4_checksum.verify();
        transition select(hdr.ipv4.ihl, hdr.ipv4.protocol) {
            (5, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            LTA_PORT: parse_lta;
            default: accept;
        }
    }
    state parse_lta {
        pkt.extract(hdr.lta);
        pkt.extract(hdr.payload);
        transition accept;
    }
}

control LtaIngressDeparser(packet_out pkt, inout headers_t hdr, in ingress_metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(hdr.bridge);
        pkt.emit(hdr.pass_out);  // valid after a control pass that recirculates (pass is not)
        pkt.emit(hdr.pass);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.lta);
        pkt.emit(hdr.payload);
    }
}

parser LtaEgressParser(packet_in pkt, out headers_t hdr, out egress_metadata_t meta,
                       out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        transition select(hdr.bridge.emit) {
            EMIT_RECIRC: parse_pass;
            default: parse_ethernet;
        }
    }
    state parse_pass {
        pkt.extract(hdr.pass);
        transition parse_ethernet;
    }
    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.protocol) {
            (5, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            LTA_PORT: parse_lta;
            default: accept;
        }
    }
    state parse_lta {
        // Egress reads and rewrites headers only: the K elements stay unparsed and leave as they came
        // (the egress parser's depth is 160 bytes on Tofino 1, less than headers plus payload).
        pkt.extract(hdr.lta);
        transition accept;
    }
}

control LtaEgressDeparser(packet_out pkt, inout headers_t hdr, in egress_metadata_t meta,
                          in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;
    apply {
        // Egress rewrites the IPv4 header of every packet it sends to a worker.
        hdr.ipv4.hdr_checksum = ipv4_checksum.update({
            hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
            hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
            hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        pkt.emit(hdr.pass);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.lta);
        pkt.emit(hdr.payload);
    }
}

#endif
