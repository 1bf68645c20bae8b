"""``lta train``: a small char-level GPT trained by N worker processes through a lossy softswitch,
swept over drop rates (the paper's Table 1 at small scale)."""
