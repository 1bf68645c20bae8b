"""The parameter-server mode of the software path (``lta ps``): a sibling of the softswitch on the same
wire protocol, for what a summing switch cannot do. It keeps per-worker state: the model's parameters
as float32 chunks, an SGD-with-momentum optimizer, synchronous partial windows with Byzantine-robust
rules over the contributions that arrived, and asynchronous bounded staleness with adaptive per-worker
bounds. The exchange (ops ``hostlib.protocol.PsOp``, payloads ``hostlib.ps.wire``) is documented in
docs/protocol.md, "Parameter-server mode"; workers use ``hostlib.ps.client.PsClient`` or, from torch,
``hostlib.torch_ext.ps.PSOptimizer``.

Modules: ``config.py`` (job settings, TOML), ``staleness.py`` (the staleness rule), ``job.py`` (one
job's state machine), ``core.py`` (jobs, packet checks), ``server.py`` (UDP daemon), ``cli.py``.
"""
