"""The LTA application: the ``lta`` command, its launchers, demos, benchmarks and the ``lta train``
experiment. It may import every part of the project; no part imports it (checked by import-linter,
see docs/architecture.md)."""
