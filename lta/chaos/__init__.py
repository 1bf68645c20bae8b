"""``lta chaos``: seeded fault injection through every front door, with a verdict per run (cli.py)."""
