"""A star network of Linux network namespaces, without Mininet: workers and one aggregation host.

::

    worker h0 (10.77.0.1) ─eth0══p0─┐
    worker h1 (10.77.0.2) ─eth0══p1─┤ br0 in namespace "sw"
    ...                             │
    aggregator (10.77.0.254) ─eth0══pagg─┘

Each worker link is shaped by :class:`~mininet_topos.linkshape.LinkSpec`: tbf on the sending side of
each direction, random loss by netem where the kernel has it, else by nftables rules on the bridge's
forward path (invisible to both ends, so TCP meets real loss). The aggregator link has its own spec
(unlimited and lossless by default: it stands in for a switch whose ports are not a bottleneck).
A worker-to-worker packet (gloo's ring) crosses two worker links; a GRAD or a RESULT crosses one.
``mtu=9000`` gives every veth (and the bridge) jumbo frames; by default they keep the kernel's 1500.

With ``switch="raw"`` there is no bridge and no aggregator host: the switch namespace's ports
(``raw_ports()``, numbered from 1) are left for ``python -m softswitch.rawport`` to serve at
``switch_ip``, and loss rules sit on each host's interface (packet sockets would see a frame before
any switch-side hook could drop it).

Every name carries the owner's PID and a random tag, ``lta-<pid>-<tag>-<role>``, so concurrent runs
never collide and :func:`remove_stale` can reclaim the namespaces of a run that was killed. Links are
created directly inside the namespaces, so nothing appears in the root namespace.

Use it as a context manager: teardown runs whatever happens (exceptions, SIGTERM, the runtime bound),
kills the processes started in the namespaces by PID and deletes the namespaces by name::

    with NetnsNetwork(2, LinkSpec.symmetric(0.01)) as net:
        server = net.run_in(net.aggregator, ["lta", "softswitch", ...])
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Self

from mininet_topos.linkshape import (
    LinkSpec,
    LossCounters,
    loss_key,
    nft_bridge_loss_script,
    nft_device_loss_script,
    parse_loss_counters,
    per_datagram_env,
    resolve_backend,
    shape_egress,
)

DEFAULT_PREFIX = "lta"
HOST_DEV = "eth0"
BRIDGE = "br0"
LOSS_TABLE = "lta_loss"  # nftables table: family bridge in the switch namespace, netdev in raw hosts
SWITCH_KINDS = ("bridge", "raw")
COMMAND_TIMEOUT_S = 10.0
DEFAULT_MTU = 1500  # what the kernel gives a new veth
MAX_MTU = 65535 - 14  # a veth's limit: an IPv4 packet plus the Ethernet header
ETHERNET_HEADER_BYTES = 14  # what tbf counts besides the IP packet


class NetnsError(RuntimeError):
    """A namespace command failed; the message says which and what the kernel answered."""


@dataclass(frozen=True)
class Host:
    """One emulated host: a network namespace with one interface ``dev`` at ``ip``."""

    role: str  # "h0", "h1", ..., "agg"
    netns: str
    ip: str
    dev: str = HOST_DEV


NETNS_TOOLS = ("ip", "tc", "nft")  # iproute2 (namespaces, veth, tbf) and nftables (loss)


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError("network namespaces need root: run as root (e.g. sudo .venv/bin/lta ...)")


def missing_tools() -> list[str]:
    """Which of the programs the namespace harness runs are not installed."""
    return [tool for tool in NETNS_TOOLS if shutil.which(tool) is None]


def run_checked(argv: Sequence[str], stdin: str | None = None, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Run a setup command; raise :class:`NetnsError` with its stderr when it fails."""
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as exc:
        raise NetnsError(f"{argv[0]} is not installed: apt-get install -y iproute2 nftables") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(argv)}` did not finish within {timeout_s:g} s") from exc
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces and root-namespace links whose names start with ``prefix`` (empty after a clean run)."""
    return [f"netns {n}" for n in list_namespaces() if n.startswith(prefix)] + [
        f"link {n}" for n in list_root_links() if n.startswith(prefix)
    ]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> list[str]:
    """Kill what still runs in ``ns`` (by PID: only our processes live there) and delete it."""
    errors = []
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
    if done.returncode != 0 and ns in list_namespaces():
        errors.append(f"ip netns del {ns}: {done.stderr.strip()}")
    return errors


def remove_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete the namespaces of runs whose owner process is gone (``<prefix>-<pid>-...``); returns them."""
    removed = []
    for ns in list_namespaces():
        parts = ns.split("-")
        if len(parts) >= 4 and parts[0] == prefix and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


class NamespaceSet:
    """What every namespace harness here shares: a tag for its names, the namespaces it created, the
    processes it started in them, a runtime bound, and a teardown that removes all of them by PID and by
    name whatever happens (exceptions, SIGTERM, the bound). Subclasses build their links in
    :meth:`setup` (creating namespaces with :meth:`add_namespace`, then calling
    :meth:`start_watchdog`)."""

    def __init__(self, prefix: str, max_runtime_s: float) -> None:
        if "-" in prefix or not prefix:
            raise ValueError(f"prefix must be a non-empty name without '-', got {prefix!r}")
        self.tag = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.max_runtime_s = max_runtime_s
        self.use_netem = False
        self.expired = False
        self._procs: list[subprocess.Popen[Any]] = []
        self._procs_lock = threading.Lock()  # the watchdog thread stops processes too
        self._created: list[str] = []
        self._watchdog: threading.Timer | None = None
        self._old_sigterm: Any = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            # SIGTERM would otherwise skip __exit__ and leave the namespaces behind.
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            self.setup()
        except BaseException:
            self.teardown()
            self._restore_sigterm()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.teardown()
        finally:
            self._restore_sigterm()
        if self.expired and exc_type is None:
            raise TimeoutError(
                f"network {self.tag} ran past its {self.max_runtime_s:g} s bound; its processes were "
                "killed (raise max_runtime_s for longer runs)"
            )

    def setup(self) -> None:
        raise NotImplementedError

    def add_namespace(self, ns: str) -> None:
        """Create ``ns`` (removed by teardown), loopback up, no IPv6 chatter (router solicitations, DAD)."""
        run_checked(["ip", "netns", "add", ns])
        self._created.append(ns)
        self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        self._ns(ns, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")

    def start_watchdog(self) -> None:
        self._watchdog = threading.Timer(self.max_runtime_s, self._on_deadline)
        self._watchdog.daemon = True
        self._watchdog.start()

    def teardown(self) -> None:
        """Kill every process started here, delete every namespace; safe to call twice."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._stop_processes()
        errors: list[str] = []
        for ns in reversed(self._created):
            errors += _delete_namespace(ns)
        self._created.clear()
        if errors:
            raise NetnsError("teardown left namespaces behind: " + "; ".join(errors))

    # ---- running things ------------------------------------------------------------------------
    def loss_before_segmentation(self) -> bool:
        """Whether loss is applied before the kernel segments a UDP GSO train (see per_datagram_env)."""
        return self.use_netem

    def run_in(self, host: Host | str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace; teardown (or the runtime bound) kills it."""
        ns = host.netns if isinstance(host, Host) else host
        with self._procs_lock:
            if self.expired:
                raise TimeoutError(f"network {self.tag} is past its {self.max_runtime_s:g} s bound")
            argv = ["ip", "netns", "exec", ns, *argv]
            # Loss before segmentation (netem, device hooks) would drop a GSO train whole: one datagram
            # per message there (linkshape.per_datagram_env).
            env = per_datagram_env(self.loss_before_segmentation())
            if env is not None and "env" not in popen_kwargs:
                popen_kwargs["env"] = env
            proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
            self._procs.append(proc)
        return proc

    def check(self, host: Host | str, argv: Sequence[str], stdin: str | None = None) -> str:
        """Run a short command inside the host's namespace and return its stdout."""
        ns = host.netns if isinstance(host, Host) else host
        return run_checked(["ip", "netns", "exec", ns, *argv], stdin)

    # ---- internals -----------------------------------------------------------------------------
    def _ns(self, ns: str, *argv: str, stdin: str | None = None) -> str:
        return run_checked(["ip", "netns", "exec", ns, *argv], stdin)

    def _stop_processes(self) -> None:
        with self._procs_lock:
            live = [p for p in self._procs if p.poll() is None]
            self._procs.clear()
        for sig, grace_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            for proc in live:
                try:
                    os.killpg(proc.pid, sig)  # the session we started: the process and its children
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            for proc in live:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            live = [p for p in live if p.poll() is None]
            if not live:
                break

    def _on_deadline(self) -> None:
        with self._procs_lock:
            self.expired = True
        self._stop_processes()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


class NetnsNetwork(NamespaceSet):
    """``n_workers`` worker hosts and one aggregator, bridged in a switch namespace. See the module doc."""

    def __init__(
        self,
        n_workers: int,
        link: LinkSpec | None = None,
        aggregator_link: LinkSpec | None = None,
        *,
        subnet: str = "10.77.0",
        prefix: str = DEFAULT_PREFIX,
        max_runtime_s: float = 600.0,
        loss_backend: str = "auto",
        switch: str = "bridge",
        mtu: int | None = None,
    ) -> None:
        if not 1 <= n_workers <= 250:
            raise ValueError(f"n_workers must be in 1..250 (one /24), got {n_workers}")
        super().__init__(prefix, max_runtime_s)
        if switch not in SWITCH_KINDS:
            raise ValueError(f"switch must be one of {SWITCH_KINDS}, got {switch!r}")
        self.link = link or LinkSpec()
        self.aggregator_link = aggregator_link or LinkSpec(rate_mbit=None)
        if mtu is not None:
            _check_mtu(mtu, [self.link, self.aggregator_link])
        self.mtu = mtu  # None: the kernel's default (1500)
        self.loss_backend = loss_backend
        self.switch_ns = f"{self.tag}-sw"
        self.workers = [Host(f"h{i}", f"{self.tag}-h{i}", f"{subnet}.{i + 1}") for i in range(n_workers)]
        self.switch = switch
        # bridge: an aggregation host on the bridge; raw: the switch namespace itself aggregates
        # (run softswitch.rawport there on raw_ports(), reachable at switch_ip).
        self.aggregator = Host("agg", f"{self.tag}-agg", f"{subnet}.254") if switch == "bridge" else None
        self.switch_ip = f"{subnet}.253"

    @property
    def hosts(self) -> list[Host]:
        return [*self.workers, self.aggregator] if self.aggregator else list(self.workers)

    def raw_ports(self) -> dict[int, str]:
        """Switch port numbers (1-based, as in Mininet) to interfaces in the switch namespace."""
        return {i + 1: self.port_of(h) for i, h in enumerate(self.workers)}

    def setup(self) -> None:
        require_root()
        self.use_netem = resolve_backend(self.loss_backend)
        for ns in [self.switch_ns, *(h.netns for h in self.hosts)]:
            self.add_namespace(ns)
        if self.switch == "bridge":
            self._ns(self.switch_ns, "ip", "link", "add", BRIDGE, "type", "bridge")
            self._ns(self.switch_ns, "ip", "link", "set", BRIDGE, "up")
        for host in self.hosts:
            self._attach(host)
        if self.switch == "bridge" and self.mtu is not None:
            self._ns(self.switch_ns, "ip", "link", "set", BRIDGE, "mtu", str(self.mtu))
        if self.use_netem:
            pass
        elif self.switch == "bridge":
            links = {self.port_of(h): self.link_of(h) for h in self.hosts}
            self._ns(self.switch_ns, "nft", "-f", "-", stdin=nft_bridge_loss_script(LOSS_TABLE, links))
        else:
            # Packet sockets see a frame before any hook on the switch side: drop at the host's interface.
            for host in self.hosts:
                script = nft_device_loss_script(LOSS_TABLE, host.dev, self.link_of(host))
                self._ns(host.netns, "nft", "-f", "-", stdin=script)
        self.start_watchdog()

    def loss_before_segmentation(self) -> bool:
        return self.use_netem or self.switch != "bridge"

    def port_of(self, host: Host) -> str:
        """The bridge port (in the switch namespace) that the host's link ends on."""
        return "pagg" if host == self.aggregator else f"p{self.workers.index(host)}"

    def link_of(self, host: Host) -> LinkSpec:
        return self.aggregator_link if host == self.aggregator else self.link

    def loss_counters(self, host: Host) -> LossCounters:
        """TCP/UDP packets seen and dropped on the host's link, per direction (nftables backend only)."""
        if self.use_netem:
            raise NetnsError("loss counters exist only with the nftables backend; this run uses netem")
        if self.switch == "bridge":
            listing = self.check(self.switch_ns, ["nft", "-j", "list", "table", "bridge", LOSS_TABLE])
            return parse_loss_counters(listing)[loss_key(self.port_of(host))]
        listing = self.check(host, ["nft", "-j", "list", "table", "netdev", LOSS_TABLE])
        return parse_loss_counters(listing)[loss_key(host.dev)]

    def qdisc_stats(self, host: Host) -> str:
        return self.check(host, ["tc", "-s", "qdisc", "show", "dev", host.dev])

    def _attach(self, host: Host) -> None:
        port, spec = self.port_of(host), self.link_of(host)
        run_checked(["ip", "link", "add", host.dev, "netns", host.netns, "type", "veth",
                     "peer", "name", port, "netns", self.switch_ns])  # fmt: skip
        if self.mtu is not None:  # both ends before enslaving: the bridge takes its ports' smallest MTU
            self._ns(self.switch_ns, "ip", "link", "set", port, "mtu", str(self.mtu))
            self._ns(host.netns, "ip", "link", "set", host.dev, "mtu", str(self.mtu))
        if self.switch == "bridge":
            self._ns(self.switch_ns, "ip", "link", "set", port, "master", BRIDGE)
        self._ns(self.switch_ns, "ip", "link", "set", port, "up")
        self._ns(host.netns, "ip", "addr", "add", f"{host.ip}/24", "dev", host.dev)
        self._ns(host.netns, "ip", "link", "set", host.dev, "up")
        # Up is shaped where the host sends (its eth0), down where the bridge sends (its port).
        mtu = self.mtu or DEFAULT_MTU
        shape_egress(lambda argv, stdin: self._ns(host.netns, *argv, stdin=stdin),
                     host.dev, spec, spec.loss_up, self.use_netem, mtu)  # fmt: skip
        shape_egress(lambda argv, stdin: self._ns(self.switch_ns, *argv, stdin=stdin),
                     port, spec, spec.loss_down, self.use_netem, mtu)  # fmt: skip


def _check_mtu(mtu: int, links: Sequence[LinkSpec]) -> None:
    """A jumbo MTU must fit the veth and every shaped link's tbf bucket (tbf drops larger frames)."""
    if not 68 <= mtu <= MAX_MTU:
        raise ValueError(f"mtu must be in 68..{MAX_MTU} bytes (IPv4 on a veth), got {mtu}")
    for spec in links:
        if spec.rate_mbit is not None and mtu + ETHERNET_HEADER_BYTES > spec.burst:
            raise ValueError(
                f"mtu {mtu} does not fit the tbf bucket of {spec.burst} bytes (tbf drops larger frames): "
                f"give the LinkSpec burst_bytes >= {mtu + ETHERNET_HEADER_BYTES}"
            )


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
