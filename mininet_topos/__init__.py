"""Emulated networks for LTA: a plain network-namespace harness (:mod:`mininet_topos.netns`) and
Mininet topologies (star, leaf-spine) with BMv2 or softswitch as the switch, on links that really
lose packets (netem where the kernel has it, nftables ``numgen random`` rules otherwise)."""
