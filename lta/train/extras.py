"""What ``lta train --metrics-port``, ``--dp-sigma/--dp-clip`` and ``--straggle-*`` add to each worker: a
Prometheus endpoint with the step telemetry, differential privacy in the sharded optimizer, and emulated
compute stragglers (``hostlib/emulation/stragglers.py``: each step, seeded per worker and step, takes
``--straggle-factor`` times ``--straggle-base-ms`` longer with probability ``--straggle-prob``, or always
on ``--slow-host``).

None changes a run when its flags are absent: the worker then builds no Telemetry, no exporter, no
privacy mechanism and sleeps nothing, and its summary has no extra keys.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from hostlib.emulation.stragglers import StragglerEmulator, StragglerModel
from hostlib.emulation.telemetry import Telemetry, alpha_from_env
from hostlib.errors import AddressInUseError, UsageError
from hostlib.torch_ext.dp import DpConfig, GaussianPrivacy, privacy_report, require_accountant
from hostlib.transport import LtaWorker


@dataclass(frozen=True)
class WorkerExtras:
    """Handed to every worker process at start-up (pickled by ``spawn``)."""

    metrics_port: int | None = None  # worker r serves on metrics_port + r
    metrics_addr: str = "127.0.0.1"
    telemetry_alpha: float | None = None  # None: TELEMETRY_ALPHA or the default
    dp: DpConfig | None = None
    # The shared secret the top-up noise is drawn from (never written to results): one per `lta train`.
    dp_secret: int = 0
    stragglers: StragglerModel | None = None  # None: no emulated stragglers

    def straggler_emulator(self, seed: int) -> StragglerEmulator | None:
        """The run's emulator (its seed mixes the model's and the run's), or None without the flags."""
        if self.stragglers is None or not self.stragglers.active:
            return None
        mixed = int(np.random.SeedSequence([self.stragglers.seed, seed]).generate_state(1)[0])
        return StragglerEmulator(StragglerModel(**{**vars(self.stragglers), "seed": mixed}))

    @classmethod
    def make(
        cls,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        telemetry_alpha: float | None = None,
        dp: DpConfig | None = None,
        stragglers: StragglerModel | None = None,
    ) -> WorkerExtras:
        secret = secrets.randbits(63) if dp else 0
        return cls(metrics_port, metrics_addr, telemetry_alpha, dp, secret, stragglers)

    def start_exporter(self, rank: int) -> Any:
        """The worker's PrometheusExporter, serving on ``metrics_port + rank``; None without the flag."""
        if self.metrics_port is None:
            return None
        from hostlib.torch_ext.metrics import PrometheusExporter

        return PrometheusExporter().serve(self.metrics_port + rank, self.metrics_addr)

    def privacy(self, worker: LtaWorker, job_id: int, seed: int) -> GaussianPrivacy | None:
        """The run's mechanism (None without ``--dp-sigma``): the top-up seed is the same on every
        worker of the run and differs between runs; each worker's own share uses fresh entropy."""
        if self.dp is None:
            return None
        shared = int(np.random.SeedSequence([self.dp_secret, job_id, seed]).generate_state(1, np.uint64)[0])
        return GaussianPrivacy.for_worker(self.dp, worker, shared_seed=shared)

    def telemetry(self, run_name: str, rank: int) -> Telemetry | None:
        if self.metrics_port is None:
            return None
        return Telemetry(alpha=self.telemetry_alpha, job=run_name, worker=rank)


def extras_from_args(args: argparse.Namespace) -> WorkerExtras:
    """The extras of an ``lta train`` command line, checked before any worker starts: the DP flags
    come together, the accountant imports, TELEMETRY_ALPHA parses and the metrics ports are free."""
    dp = None
    if (args.dp_sigma is None) != (args.dp_clip is None):
        raise UsageError("--dp-sigma and --dp-clip go together (noise multiplier, clipping norm)")
    if args.dp_sigma is not None:
        dp = DpConfig(args.dp_sigma, args.dp_clip, args.dp_delta)
        require_accountant("lta train --dp-sigma")
    alpha = None
    if args.metrics_port is not None:
        alpha = alpha_from_env()
        check_ports_free(args.metrics_addr, args.metrics_port, args.workers)
    stragglers = None
    if getattr(args, "straggle_prob", 0.0) or getattr(args, "slow_host", None) is not None:
        if args.slow_host is not None and args.slow_host >= args.workers:
            raise UsageError(f"--slow-host {args.slow_host}: there are workers 0..{args.workers - 1}")
        stragglers = StragglerModel(
            base_s=args.straggle_base_ms / 1000.0,
            prob=args.straggle_prob,
            factor=args.straggle_factor,
            slow_host=args.slow_host,
        )
    return WorkerExtras.make(args.metrics_port, args.metrics_addr, alpha, dp, stragglers)


def check_ports_free(addr: str, first: int, count: int) -> None:
    """UsageError unless TCP ports ``first .. first+count-1`` can be listened on at ``addr``."""
    last = first + count - 1
    if last > 65535:
        raise UsageError(f"--metrics-port {first} + {count} workers passes port 65535")
    for port in range(first, last + 1):
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((addr, port))
            except OSError as exc:
                error = AddressInUseError if exc.errno == errno.EADDRINUSE else UsageError
                raise error(
                    f"cannot serve metrics on {addr}:{port} (worker {port - first}): "
                    f"{exc.strerror}; choose another --metrics-port or --metrics-addr"
                ) from None


def privacy_summary(extras: WorkerExtras, steps: int) -> dict[str, Any] | None:
    """results.json's ``privacy``: σ, C, δ and ε after ``steps`` steps; None without ``--dp-sigma``.

    The protected unit is one worker: its whole gradient is clipped to C each step, every worker takes
    part in every step (sampling rate 1; a lost packet is not counted as subsampling), so ε is that of
    ``steps`` Gaussian mechanisms with noise multiplier σ. Per-example privacy would need per-example
    clipping, which this experiment does not do."""
    if extras.dp is None:
        return None
    return privacy_report(extras.dp, steps, sampling_rate=1.0, accountant="rdp", unit="worker")
