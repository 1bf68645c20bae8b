"""The Mininet allreduce demo: workers on lossy, rate-limited links reduce through a programmed LTA switch.

1. build the topology (star or leaf-spine) with the LTA switch (BMv2 or softswitch on raw ports);
2. shape every worker link (tbf; loss by netem, or nftables at the host's interface);
3. program the job through the control plane over P4Runtime (one code path for both switches);
   the softswitch on a leaf-spine spine takes a jobs file instead (shared ports, see leafspine.py);
4. run :mod:`mininet_topos.allreduce_worker` in every host; each checks its own results against the
   mean of the contributors the switch reported;
5. read the switch's counters and the links' drop counters, stop everything (by PID and by name).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from mininet_topos.addressing import SWITCH_IP, worker_ip, worker_mac, worker_udp_port
from mininet_topos.linkshape import (
    LinkSpec,
    LossCounters,
    loss_key,
    nft_device_loss_script,
    parse_loss_counters,
    per_datagram_env,
    resolve_backend,
    shape_egress,
)
from mininet_topos.mnenv import MininetUnavailable, init_mininet_quietly, mininet_problem

_log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
TOPOLOGIES = ("star", "leafspine")
LOSS_TABLE = "lta_loss"


@dataclass
class DemoConfig:
    switch: str = "softswitch"  # softswitch | bmv2
    topo: str = "star"  # star | leafspine
    hosts: int = 2
    loss: float = 0.0  # per link and direction
    rate_mbit: float | None = 200.0
    rounds: int = 20
    elems: int = 16384
    seed: int = 0
    job_id: int = 1
    timeout_s: float = 300.0
    loss_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.topo not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topo!r}")
        if self.switch not in ("softswitch", "bmv2"):
            raise ValueError(f"switch must be softswitch or bmv2, got {self.switch!r}")
        if not 1 <= self.hosts <= 64:
            raise ValueError(f"hosts must be in 1..64 (the bitmap's width), got {self.hosts}")


@dataclass
class DemoReport:
    config: DemoConfig
    workers: list[dict[str, Any]]
    switch_counters: dict[str, int]
    links: dict[str, LossCounters]
    loss_backend: str
    wall_s: float
    leftovers: list[str] = field(default_factory=list)
    logs: str | None = None  # the run's directory (switch log, jobs file), kept when it failed

    @property
    def ok(self) -> bool:
        return all(w.get("returncode") == 0 for w in self.workers) and not self.leftovers

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["links"] = {name: asdict(c) for name, c in self.links.items()}
        doc["ok"] = self.ok
        return doc


def problem(config: DemoConfig) -> str | None:
    """Why this demo cannot run here (root, Mininet, BMv2), or None."""
    found = mininet_problem()
    if found or config.switch != "bmv2":
        return found
    from mininet_topos.switches import bmv2_problem

    return bmv2_problem()


def _node_runner(node: Any):
    """A linkshape.Runner executing argv in a Mininet node's namespace."""

    def run(argv, stdin: str | None) -> str:
        proc = node.popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(stdin.encode() if stdin else None, timeout=10)
        if proc.returncode != 0:
            raise RuntimeError(f"{node.name}: `{' '.join(argv)}` failed: {err.decode().strip()}")
        return out.decode()

    return run


def root_links(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(prefix)]


def _transport_profile(config: DemoConfig) -> list[str]:
    """BMv2 forwards only about 5-6k LTA packets/s here (p4/bench_bmv2.py): a small window keeps rounds
    out of its input queues, and a longer deadline floor covers the queueing that remains. The
    softswitch keeps the transport's defaults."""
    return ["--window", "8", "--min-deadline-ms", "60"] if config.switch == "bmv2" else []


def run_demo(config: DemoConfig, log: Callable[[str], None] = _log.info) -> DemoReport:
    """Build, run and tear down the demo. Raises :class:`MininetUnavailable` if it cannot run here.
    ``log`` hears of each phase as it starts (one line each)."""
    reason = problem(config)
    if reason:
        raise MininetUnavailable(reason)
    init_mininet_quietly()
    from mininet.log import setLogLevel
    from mininet.net import Mininet

    from mininet_topos.leafspine import LeafSpineTopo
    from mininet_topos.star import StarTopo
    from mininet_topos.switches import Bmv2Switch, SoftRawSwitch

    setLogLevel("error")
    use_netem = resolve_backend(config.loss_backend)
    prefix = f"lta{uuid.uuid4().hex[:4]}"  # every node and link name starts with it
    workdir = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    topo_cls = StarTopo if config.topo == "star" else LeafSpineTopo
    ports = topo_cls.worker_ports(config.hosts)
    switch_params: dict[str, Any] = {"switch_ip": SWITCH_IP, "log_dir": str(workdir)}
    programmed_by_file = config.switch == "softswitch" and len(set(ports)) < len(ports)
    if config.switch == "bmv2":
        switch_cls: type = Bmv2Switch
    else:
        switch_cls = SoftRawSwitch
        switch_params["stats_file"] = str(workdir / "switch-stats.json")
        if programmed_by_file:
            jobs = workdir / "jobs.toml"
            workers = ", ".join(f'"{p}@{worker_ip(w)}"' for w, p in enumerate(ports))
            neighbors = "".join(
                f'[[neighbors]]\nport = {p}\nip = "{worker_ip(w)}"\nmac = "{worker_mac(w)}"\n'
                f"udp_port = {worker_udp_port(w)}\n"
                for w, p in enumerate(ports)
            )
            jobs.write_text(f"[[jobs]]\njob_id = {config.job_id}\nworkers = [{workers}]\n{neighbors}")
            switch_params.update(config=str(jobs), ingress_key="port+ip")
    topo = topo_cls(n_hosts=config.hosts, prefix=prefix, switch_cls=switch_cls, switch_params=switch_params)
    link = LinkSpec.symmetric(config.loss, rate_mbit=config.rate_mbit)
    started = time.monotonic()
    net = Mininet(topo=topo, controller=None, build=False, autoSetMacs=False, waitConnected=False)
    old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
    procs: list[subprocess.Popen[bytes]] = []
    counters: dict[str, int] = {}
    links: dict[str, LossCounters] = {}
    reports: list[dict[str, Any]] = []
    try:
        log(f"building the {config.topo} topology: {config.hosts} hosts, {config.switch} switch")
        net.build()
        net.start()
        lta_switch = next(s for s in net.switches if isinstance(s, switch_cls))
        hosts = [net.get(f"{prefix}h{w + 1}") for w in range(config.hosts)]
        lta_switch.wait_ready()
        for host in hosts:
            _prepare_host(host, link, use_netem, lta_switch.switch_mac)
        log(f"{config.topo} with {config.hosts} hosts, {config.switch} switch {lta_switch.name}, links "
            f"{config.rate_mbit or 'unlimited'} Mbit/s, loss {config.loss:g} per direction "
            f"({'netem' if use_netem else 'nftables'})")  # fmt: skip
        if not programmed_by_file:
            _program_job(lta_switch.grpc_target, config, ports)
            log(f"job {config.job_id} programmed over P4Runtime at {lta_switch.grpc_target}")
        for w, host in enumerate(hosts):
            argv = [sys.executable, "-m", "mininet_topos.allreduce_worker", "--job", str(config.job_id),
                    "--worker", str(w), "--workers", str(config.hosts), "--switch", SWITCH_IP,
                    "--bind", f"{worker_ip(w)}:{worker_udp_port(w)}", "--rounds", str(config.rounds),
                    "--elems", str(config.elems), "--seed", str(config.seed),
                    *_transport_profile(config)]  # fmt: skip
            # Mininet's loss (netem, the hosts' netdev hooks) comes before segmentation: per_datagram_env.
            procs.append(host.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                                    env=per_datagram_env(True)))  # fmt: skip
        log(f"{config.hosts} workers reducing {config.elems} values x {config.rounds} rounds")
        deadline = started + config.timeout_s
        for w, proc in enumerate(procs):
            reports.append(_collect(w, proc, deadline))
        if not programmed_by_file:
            counters = _read_counters(lta_switch.grpc_target, config.job_id)
        if not use_netem:
            for host in hosts:
                listing = _node_runner(host)(["nft", "-j", "list", "table", "netdev", LOSS_TABLE], None)
                links[host.name] = parse_loss_counters(listing)[loss_key(host.defaultIntf().name)]
    except BaseException:
        # The error carries what is needed (a switch that fails to start quotes its log).
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        net.stop()
        signal.signal(signal.SIGTERM, old_sigterm)
    stats_file = workdir / "switch-stats.json"
    if programmed_by_file and stats_file.exists():
        counters = json.loads(stats_file.read_text())["jobs"].get(str(config.job_id), {})
    report = DemoReport(config, reports, counters, links, "netem" if use_netem else "nftables",
                        time.monotonic() - started, root_links(prefix))  # fmt: skip
    if report.ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        report.logs = str(workdir)  # the switch's log stays for diagnosis
    return report


def _prepare_host(host: Any, link: LinkSpec, use_netem: bool, switch_mac: str) -> None:
    run = _node_runner(host)
    run(["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], None)
    # BMv2 answers no ARP: a static entry for the switch makes both switches look alike to hosts.
    run(["ip", "neigh", "replace", SWITCH_IP, "lladdr", switch_mac, "dev", host.defaultIntf().name], None)
    intf = host.defaultIntf()
    peer = intf.link.intf2 if intf.link.intf1 is intf else intf.link.intf1
    shape_egress(run, intf.name, link, link.loss_up, use_netem)
    shape_egress(_node_runner(peer.node), peer.name, link, link.loss_down, use_netem)
    if not use_netem:
        run(["nft", "-f", "-"], nft_device_loss_script(LOSS_TABLE, intf.name, link))


def _program_job(target: str, config: DemoConfig, ports: list[int]) -> None:
    from controlplane.jobs import JobSpec, WorkerSpec
    from controlplane.switch import LtaSwitch

    workers = tuple(
        WorkerSpec(port=port, mac=worker_mac(w), ip=worker_ip(w), udp_port=worker_udp_port(w))
        for w, port in enumerate(ports)
    )
    with LtaSwitch.connect(target, timeout_s=10) as ctl:
        ctl.ensure_pipeline()
        ctl.add_job(JobSpec(config.job_id, workers))


def _read_counters(target: str, job_id: int) -> dict[str, int]:
    from controlplane.switch import LtaSwitch

    with LtaSwitch.connect(target, timeout_s=10) as ctl:
        return ctl.read_counters(job_id)[job_id]


def _collect(w: int, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"worker": w, "returncode": None, "error": "timed out (raise --timeout)"}
    lines = out.decode().strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = err.decode().strip().splitlines()[-5:]
        return {"worker": w, "returncode": proc.returncode, "error": " | ".join(tail) or "no output"}
    report["returncode"] = proc.returncode
    return report


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def format_report(report: DemoReport) -> str:
    """A few lines a person reads: timings, chunk outcomes, correctness, switch and link counters."""
    lines = []
    for w in report.workers:
        if "error" in w:
            lines.append(f"worker {w['worker']}: FAILED ({w['error']})")
            continue
        chunks = w["chunks"]
        lines.append(
            f"worker {w['worker']}: {w['rounds']} allreduces of {w['elems']} floats, "
            f"p50 {w['ms_p50']:.1f} ms, p99 {w['ms_p99']:.1f} ms; chunks full {chunks['full']}, "
            f"partial {chunks['partial']}, fallback {chunks['fallback']}; worst error "
            f"{w['worst_error_over_tolerance']:.2f} of tolerance ({w['chunks_checked']} chunks checked)"
        )
    c = report.switch_counters
    if c:
        keys = ("rx_packets", "grad_start", "grad_add", "result_quorum", "flush_partial", "flush_empty",
                "grad_late_resend", "flush_resend", "drop_bad_worker", "tx_packets")  # fmt: skip
        lines.append("switch: " + ", ".join(f"{k} {c.get(k, 0)}" for k in keys))
    for name, link in report.links.items():
        lines.append(
            f"link {name}: up {link.dropped_up}/{link.seen_up} dropped ({link.loss_rate('up'):.2%}), "
            f"down {link.dropped_down}/{link.seen_down} ({link.loss_rate('down'):.2%})"
        )
    if report.leftovers:
        lines.append(f"LEFTOVER links after teardown: {report.leftovers}")
    if report.logs:
        lines.append(f"switch log and jobs file kept in {report.logs}")
    lines.append(f"{'OK' if report.ok else 'FAILED'} in {report.wall_s:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m lta.mininet_demo: the defaults, for a quick look
    if os.geteuid() != 0:
        sys.exit("run as root")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(format_report(run_demo(DemoConfig())))
