"""``lta demo --leaves L --netns``: a leaf-spine tree in network namespaces, each switch a softswitch process
in its own namespace, kernel loss (nftables) on the worker links and on the leaf uplinks.

1. build :class:`mininet_topos.netns_tree.NetnsTree` (the workers in contiguous blocks,
   :func:`softswitch.hierarchy.leaf_blocks`);
2. write a jobs file per switch (``role = "leaf"`` with its ``uplink`` and ``leaf_id``, ``role = "spine"``
   listing the leaves' uplink addresses; docs/jobs_file.md) and start ``lta softswitch`` in each
   switch's namespace;
3. run :mod:`mininet_topos.allreduce_worker` in every worker's namespace: each regenerates every
   worker's seeded input and checks each chunk of its result against numpy's mean over the workers in
   the chunk's global bitmap (hostlib.verify), and prints one JSON line;
4. collect those lines, every switch's final counters and the nftables loss counters per link.

Nothing is dropped by the softswitches' own drop policies: every loss is the kernel's, on the wire.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostlib.protocol import LTA_PORT
from softswitch.hierarchy import leaf_blocks

REPO = Path(__file__).resolve().parents[1]
JOB_ID = 1
WORKER_PORT_BASE = 40000
START_TIMEOUT_S = 30.0


@dataclass
class TreeDemoConfig:
    workers: int = 8
    leaves: int = 2
    loss: float = 0.1  # worker -> leaf and leaf -> spine (GRADs, partials)
    down_loss: float = 0.0  # spine -> leaf and leaf -> worker (RESULTs)
    elems: int = 16384
    rounds: int = 5
    seed: int = 0
    prefix: str = "lta"  # namespace names start with it (tests use their own)
    timeout_s: float = 300.0


@dataclass
class TreeDemoReport:
    config: TreeDemoConfig
    workers: list[dict[str, Any]]
    switches: dict[str, dict[str, int]]  # "leaf0".., "spine" -> that switch's counters of the job
    links: dict[str, dict[str, int]]  # "w<i>" / "u<j>" -> nftables seen/dropped per direction
    wall_s: float
    logs: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(
            w.get("returncode") == 0 and w["worst_error_over_tolerance"] < 1.0 for w in self.workers
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.__dict__,
            "workers": self.workers,
            "switches": self.switches,
            "links": self.links,
            "wall_s": self.wall_s,
            "exact": self.ok,
            "errors": self.errors,
            "logs": self.logs,
        }


def leaf_toml(job_id: int, leaf: int, first_worker: int, worker_addrs: list[str], uplink: str) -> str:
    workers = ", ".join(f'"{a}"' for a in worker_addrs)
    return (
        f'[[jobs]]\njob_id = {job_id}\nrole = "leaf"\nuplink = "{uplink}"\nleaf_id = {leaf}\n'
        f"worker_base = {first_worker}\nworkers = [{workers}]\n"
    )


def spine_toml(job_id: int, leaf_addrs: list[str]) -> str:
    leaves = ", ".join(f'"{a}"' for a in leaf_addrs)
    return f'[[jobs]]\njob_id = {job_id}\nrole = "spine"\nworkers = [{leaves}]\n'


def run_tree_demo(config: TreeDemoConfig, log: Any = lambda text: None) -> TreeDemoReport:
    """Build the tree, run the workers, check every chunk, tear everything down (whatever happens)."""
    from mininet_topos.linkshape import LinkSpec
    from mininet_topos.netns_tree import NetnsTree

    blocks = leaf_blocks(config.workers, config.leaves)
    link = LinkSpec(rate_mbit=None, loss_up=config.loss, loss_down=config.down_loss)
    workdir = Path(tempfile.mkdtemp(prefix=f"{config.prefix}-tree-"))
    started = time.monotonic()
    with NetnsTree([len(b) for b in blocks], link, link, prefix=config.prefix,
                   max_runtime_s=config.timeout_s + 60) as net:  # fmt: skip
        log(
            f"tree {net.tag}: {config.leaves} leaves x {[len(b) for b in blocks]} workers, loss up "
            f"{config.loss:g} / down {config.down_loss:g} on every worker link and leaf uplink (nftables)"
        )
        addrs = [f"{h.ip}:{WORKER_PORT_BASE + w}" for w, h in enumerate(net.workers)]
        spine_addr = f"{net.spine.ip}:{LTA_PORT}"
        switches: dict[str, tuple[Any, Path]] = {}
        (workdir / "spine.toml").write_text(
            spine_toml(JOB_ID, [f"{lf.uplink_ip}:{LTA_PORT}" for lf in net.leaves])
        )
        switches["spine"] = _start_switch(net, net.spine.netns, workdir, "spine")
        for lf, block in zip(net.leaves, blocks, strict=True):
            name = f"leaf{lf.index}"
            (workdir / f"{name}.toml").write_text(
                leaf_toml(JOB_ID, lf.index, block[0], [addrs[w] for w in block], spine_addr)
            )
            switches[name] = _start_switch(net, lf.netns, workdir, name)
        for name, (proc, log_path) in switches.items():
            _wait_listening(name, proc, log_path)
        procs = []
        for w, host in enumerate(net.workers):
            argv = [sys.executable, "-m", "mininet_topos.allreduce_worker", "--job", str(JOB_ID),
                    "--worker", str(w), "--workers", str(config.workers),
                    "--switch", f"{net.leaf_of(w).ip}:{LTA_PORT}", "--bind", addrs[w],
                    "--elems", str(config.elems), "--rounds", str(config.rounds),
                    "--seed", str(config.seed),
                    "--leaf-sizes", ",".join(str(len(b)) for b in blocks)]  # fmt: skip
            procs.append(net.run_in(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO))
        log(f"{config.workers} workers reducing {config.elems} values x {config.rounds} rounds")
        deadline = started + config.timeout_s
        reports = [_collect(w, proc, deadline) for w, proc in enumerate(procs)]
        links = {name: c.__dict__ for name, c in net.loss_counters().items()}
        counters: dict[str, dict[str, int]] = {}
        errors = [f"worker {r['worker']}: {r['error']}" for r in reports if "error" in r]
        for name, (proc, log_path) in switches.items():
            proc.terminate()  # SIGTERM: the daemon prints its final counters and exits
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            lines = [line for line in out.splitlines() if line.strip()]
            if lines:
                counters[name] = json.loads(lines[-1]).get(str(JOB_ID), {})
            else:
                errors.append(f"{name} printed no counters; its log: {log_path}")
    report = TreeDemoReport(config, reports, counters, links, time.monotonic() - started, errors=errors)
    if not report.ok:
        report.logs = str(workdir)
    return report


def _start_switch(net: Any, ns: str, workdir: Path, name: str) -> tuple[Any, Path]:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as stderr:
        proc = net.run_in(
            ns,
            [sys.executable, "-m", "lta.cli", "softswitch", "--listen", f"0.0.0.0:{LTA_PORT}",
             "--config", str(workdir / f"{name}.toml"), "--stats-every", "3600"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO,
        )  # fmt: skip
    return proc, log_path


def _wait_listening(name: str, proc: Any, log_path: Path) -> None:
    give_up = time.monotonic() + START_TIMEOUT_S
    while "listening" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > give_up:
            raise RuntimeError(
                f"{name}'s softswitch did not start within {START_TIMEOUT_S:g} s: "
                f"{log_path.read_text(errors='replace')[-2000:] or '(it printed nothing)'}"
            )
        time.sleep(0.05)


def _collect(w: int, proc: Any, deadline: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"worker": w, "returncode": None, "error": "timed out (raise the timeout)"}
    lines = out.decode().strip().splitlines()
    try:
        report: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = err.decode().strip().splitlines()[-5:]
        return {"worker": w, "returncode": proc.returncode, "error": " | ".join(tail) or "no output"}
    report["returncode"] = proc.returncode
    return report


def format_report(report: TreeDemoReport) -> str:
    """What a person reads: per worker timings and chunk outcomes, the verdict, switch and link counters."""
    cfg = report.config
    lines = [
        f"lta demo --netns: {cfg.workers} workers behind {cfg.leaves} leaf softswitches and a spine, each in "
        f"its namespace; {cfg.elems} values x {cfg.rounds} rounds; kernel loss up {cfg.loss:.0%}, down "
        f"{cfg.down_loss:.0%} on every worker link and leaf uplink"
    ]
    for w in report.workers:
        if "error" in w:
            lines.append(f"worker {w['worker']}: FAILED ({w['error']})")
            continue
        c = w["chunks"]
        lines.append(
            f"worker {w['worker']:3d}: p50 {w['ms_p50']:7.1f} ms, p99 {w['ms_p99']:7.1f} ms; chunks full "
            f"{c['full']}, partial {c['partial']}, fallback {c['fallback']}; worst error "
            f"{w['worst_error_over_tolerance']:.2f} of tolerance ({w['chunks_checked']} chunks checked)"
        )
    for name, counters in report.switches.items():
        shown = ", ".join(f"{k}={v}" for k, v in counters.items() if v)
        lines.append(f"{name} counters: {shown}")
    for level, prefix in (("worker links", "w"), ("leaf uplinks", "u")):
        seen = {
            d: sum(v[f"seen_{d}"] for k, v in report.links.items() if k.startswith(prefix))
            for d in ("up", "down")
        }
        dropped = {
            d: sum(v[f"dropped_{d}"] for k, v in report.links.items() if k.startswith(prefix))
            for d in ("up", "down")
        }
        lines.append(
            f"{level}: up {dropped['up']}/{seen['up']} packets dropped, down {dropped['down']}/{seen['down']}"
        )
    lines += [f"error: {e}" for e in report.errors]
    verdict = (
        "every chunk equals the mean over its global bitmap (within the codec bound)"
        if report.ok
        else f"FAILED: see above (switch logs in {report.logs})"
    )
    lines.append(f"{verdict}; wall time {report.wall_s:.1f} s")
    return "\n".join(lines)
