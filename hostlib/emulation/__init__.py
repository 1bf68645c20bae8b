"""Emulation and research: loss models (shared with the softswitch), the in-process drop simulator,
compute stragglers, and the research mechanisms layered on a reduce (lost-contribution feedback, the
Hadamard rotation, per-worker telemetry)."""
