"""The P4 program seen from Python, owned by neither end: its schema (names, paths, the drop-policy
encoding), the P4Info lookups, the P4Runtime bindings, how a job is written into its tables, and a scapy
layer that dissects the LTA header in captures."""
