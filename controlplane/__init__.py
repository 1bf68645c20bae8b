"""P4Runtime control plane for LTA switches: BMv2 (simple_switch_grpc), Tofino later, and the softswitch's
own P4Runtime server, through one code path (:class:`controlplane.switch.LtaSwitch`)."""
