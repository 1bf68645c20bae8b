"""One worker of the emulated-network demo: reduce seeded tensors through the switch and check them.

Each worker rebuilds every worker's seeded input and checks its own result (hostlib.verify). Prints
one JSON line with timings, chunk outcomes and the worst error relative to the tolerance (< 1 passes).

``python -m mininet_topos.allreduce_worker --job 1 --worker 0 --workers 2 --switch 10.0.0.254:48879
--bind 10.0.0.1``
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hostlib.protocol import LTA_PORT
from hostlib.transport import LtaWorker, TransportConfig
from hostlib.verify import check_result, slack_bits
from hostlib.verify import seeded_input as worker_input


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mininet_topos.allreduce_worker", description=__doc__)
    parser.add_argument("--job", type=int, default=1)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--switch", required=True, help="IP[:PORT] of the switch")
    parser.add_argument("--bind", default="0.0.0.0", help="local IP[:PORT] to send from")
    parser.add_argument("--elems", type=int, default=16384, help="float32 values per allreduce")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pool-size", type=int, default=0, help="slots of the job (default: the protocol's, 2048 at K = 64)"
    )
    parser.add_argument("--window", type=int, default=None, help="packets in flight (default: transport's)")
    parser.add_argument("--min-deadline-ms", type=float, default=None, help="floor of the FLUSH deadline")
    parser.add_argument(
        "--leaf-sizes",
        default="",
        help="behind leaf switches: the workers of each leaf, comma-separated, in worker-id order "
        "(TransportConfig.leaf_sizes; '' for one switch)",
    )
    args = parser.parse_args(argv)
    host, _, port = args.switch.partition(":")
    bind_ip, _, bind_port = args.bind.partition(":")
    tuning = {"window": args.window, "min_deadline_ms": args.min_deadline_ms}
    leaf_sizes = tuple(int(size) for size in args.leaf_sizes.split(",")) if args.leaf_sizes else ()
    config = TransportConfig(
        pool_size=args.pool_size,
        seed=args.seed,
        leaf_sizes=leaf_sizes,
        **{k: v for k, v in tuning.items() if v is not None},
    )
    times_ms, checked, worst = [], 0, 0.0
    outcomes = {"full": 0, "partial": 0, "fallback": 0}
    with LtaWorker(
        args.job,
        args.worker,
        args.workers,
        (host, int(port or LTA_PORT)),
        config=config,
        bind=(bind_ip, int(bind_port or 0)),
    ) as worker:
        for r in range(args.rounds):
            inputs = np.stack([worker_input(args.seed, r, w, args.elems) for w in range(args.workers)])
            result = worker.allreduce(inputs[args.worker], step=r)
            times_ms.append(result.elapsed_s * 1000.0)
            n_checked, err = check_result(result, inputs, config.elems_per_packet, slack=slack_bits(config))
            checked, worst = checked + n_checked, max(worst, err)
            outcomes["full"] += int((result.count == args.workers).sum())
            outcomes["partial"] += int(((result.count > 0) & (result.count < args.workers)).sum())
            outcomes["fallback"] += int((result.fallback != 0).sum())
        stats = worker.stats.as_dict()
    t = np.array(times_ms)
    report = {
        "worker": args.worker,
        "rounds": args.rounds,
        "elems": args.elems,
        "ms_p50": float(np.percentile(t, 50)),
        "ms_p99": float(np.percentile(t, 99)),
        "ms_max": float(t.max()),
        "chunks": outcomes,
        "chunks_checked": checked,
        "worst_error_over_tolerance": worst,
        "transport": stats,
    }
    print(json.dumps(report), flush=True)
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
