"""The jobs file: one TOML schema for the jobs a switch serves, read by ``lta softswitch --config FILE``
and by ``lta ctl apply FILE`` alike (the two cannot import each other, so the schema lives here)::

    seed = 7                        # optional: seeds the softswitch's drop decisions (a run replays)

    [[switches]]                    # optional; lta ctl apply uses `lta ctl --target` when there is none
    name = "s1"
    target = "127.0.0.1:9559"       # P4Runtime: simple_switch_grpc or `lta softswitch --p4runtime`
    device_id = 0

    [[jobs]]
    job_id = 1
    switch = "s1"                   # optional when the file names at most one switch
    quorum = 2                      # optional: close a round at this count (default: all workers)
    pool_size = 2048                # optional: slots of the job (default: 2048, 512 for K > 1024)
    slot_base = 0                   # optional: its first slot (default: placed in the first free range)
    elems_per_packet = 64           # optional: K (a P4 switch runs its compiled K = 64)
    workers = [                     # worker w is workers[w]
        { ip = "127.0.0.1", udp_port = 41001, port = 1, mac = "02:00:00:00:00:01" },
        "127.0.0.1:41002",          # short for { ip = "127.0.0.1", udp_port = 41002 }
    ]

    [[jobs.drop]]                   # emulated loss; as many tables as needed
    direction = "up"                # up = GRAD by sender; down = RESULT, param = PARAM by receiver
    model = "bernoulli"             # or "gilbert_elliott" (p, r, loss_good, loss_bad), or "none"
    p = 0.1
    worker = 0                      # optional: this worker only (wins over the job-wide policy)

A worker's ``ip`` and ``udp_port`` are where it sends from and receives on: the softswitch tells workers
apart by them, so it needs both. ``port`` is the switch port the worker is wired to, checked by a P4
switch on every packet, so ``lta ctl`` needs it; ``mac`` is its Ethernet address. Short forms:
``"IP:UDP_PORT"``, a port number, and ``"PORT@IP"`` (several workers behind one port). A field a reader
does not insist on, left out, takes the addressing of the repository's Mininet topologies for worker
``w`` (:func:`default_worker`): port w + 1, ip 10.0.0.(w + 1), mac 02:00:00:00:00:(w + 1) (as two bytes),
udp_port 40000 + w.

Every key is checked. An unknown one (``quroum``, ``elems_per_packt``, ``[[jobz]]``), a value of the
wrong type or out of range raises :class:`~hostlib.errors.ConfigError` naming the file, the table and
the key. Standard library (``tomllib``) and :mod:`hostlib` only.
"""

from __future__ import annotations

import difflib
import ipaddress
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostlib.emulation.dropmodels import DIRECTIONS, DropPolicy
from hostlib.errors import ConfigError
from hostlib.job import MAX_POOL_SIZE, MIN_POOL_SIZE, Job
from hostlib.job import pool_size as resolve_pool_size
from hostlib.protocol import (
    DEFAULT_ELEMS_PER_PACKET,
    MAX_ELEMS_PER_PACKET,
    MAX_JOBS,
    MAX_LEAVES,
    MAX_WORKERS,
    parse_address,
)

DEFAULT_P4RUNTIME_TARGET = "127.0.0.1:9559"  # P4Runtime's registered port
DEFAULT_POOL_SIZE = resolve_pool_size(None, DEFAULT_ELEMS_PER_PACKET)  # the P4 format's (K = 64): 2048
MAX_SWITCH_PORT = 510  # BMv2's ports are 9 bits and 511 is its drop port
DEFAULT_SUBNET = "10.0.0"
DEFAULT_UDP_BASE = 40000
DROP_MODELS = ("bernoulli", "gilbert_elliott", "none")

_TOP_KEYS = ("seed", "switches", "jobs")
_SWITCH_KEYS = ("name", "target", "device_id")
_JOB_KEYS = (
    "job_id", "switch", "workers", "quorum", "pool_size", "slot_base", "elems_per_packet", "drop",
    "role", "uplink", "leaf_id", "worker_base",
)  # fmt: skip
ROLES = ("flat", "leaf", "spine")  # hostlib.protocol.Role, by name (docs/protocol.md, "Hierarchy")
_WORKER_KEYS = ("ip", "udp_port", "port", "mac")
_DROP_KEYS = ("direction", "model", "worker", "p", "r", "loss_good", "loss_bad")
_GILBERT_ELLIOTT_ONLY = ("r", "loss_good", "loss_bad")
_TABLE_ARRAYS = {"": ("switches", "jobs"), "jobs": ("drop",)}  # path -> keys written as [[...]]


@dataclass(frozen=True)
class WorkerEntry:
    """One worker of a job as the file gives it; a field left out is None (see :meth:`filled`)."""

    ip: str | None = None
    udp_port: int | None = None
    port: int | None = None
    mac: str | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """``(ip, udp_port)`` when both are known: how the softswitch tells workers apart."""
        if self.ip is None or self.udp_port is None:
            return None
        return self.ip, self.udp_port

    def filled(self, w: int) -> WorkerEntry:
        """This worker with every field left out taken from :func:`default_worker` for worker ``w``."""
        d = default_worker(w)
        return WorkerEntry(
            ip=d.ip if self.ip is None else self.ip,
            udp_port=d.udp_port if self.udp_port is None else self.udp_port,
            port=d.port if self.port is None else self.port,
            mac=d.mac if self.mac is None else self.mac,
        )


def default_worker(w: int) -> WorkerEntry:
    """Worker ``w``'s addresses in the repository's Mininet topologies (``mininet_topos/addressing.py``):
    the values a field left out takes."""
    return WorkerEntry(
        ip=f"{DEFAULT_SUBNET}.{w + 1}",
        udp_port=DEFAULT_UDP_BASE + w,
        port=w + 1,
        mac=f"02:00:00:00:{(w + 1) >> 8:02x}:{(w + 1) & 0xFF:02x}",
    )


@dataclass(frozen=True)
class DropEntry:
    """An emulated-loss policy of one job; ``policy`` None is ``model = "none"`` (no policy)."""

    direction: str
    policy: DropPolicy | None
    worker: int | None = None


@dataclass(frozen=True)
class JobEntry:
    """One ``[[jobs]]`` table. ``quorum`` None: all workers; ``slot_base`` None: placed by the reader;
    ``switch`` None: the file's only switch (or the reader's own)."""

    job_id: int
    workers: tuple[WorkerEntry, ...]
    quorum: int | None = None
    pool_size: int = DEFAULT_POOL_SIZE
    slot_base: int | None = None
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET
    switch: str | None = None
    drops: tuple[DropEntry, ...] = ()
    index: int = field(default=0, compare=False)  # position in the file, for messages
    # The hierarchy (docs/protocol.md, "Hierarchy"): a leaf's workers are global ids worker_base,
    # worker_base + 1, ...; it sends closed rounds to uplink as contributor leaf_id. A spine's workers
    # are its leaves (workers[j] = leaf j's address).
    role: str = "flat"
    uplink: tuple[str, int] | None = None
    leaf_id: int = 0
    worker_base: int = 0
    # A leaf's switch port toward the spine and the spine's MAC (uplink = { ip, udp_port, port, mac }):
    # a P4 switch (lta ctl) needs the port; the softswitch sends to the address alone.
    uplink_port: int | None = None
    uplink_mac: str | None = None

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    def as_job(self) -> Job:
        """This entry as the one job type (hostlib.job), checked as every job is."""
        return Job.of(
            self.job_id,
            self.workers,
            quorum=self.quorum,
            pool_size=self.pool_size,
            elems_per_packet=self.elems_per_packet,
            role=ROLES.index(self.role),
            uplink=self.uplink,
            leaf_id=self.leaf_id,
        )

    @property
    def where(self) -> str:
        """How messages name this job's table: ``jobs[0] (job_id 5)``."""
        return f"jobs[{self.index}] (job_id {self.job_id})"


@dataclass(frozen=True)
class SwitchEntry:
    """One ``[[switches]]`` table: a P4Runtime target ``lta ctl apply`` configures."""

    name: str
    target: str = DEFAULT_P4RUNTIME_TARGET
    device_id: int = 0


@dataclass(frozen=True)
class JobFile:
    """A whole jobs file. ``source`` names it in messages (:meth:`error`)."""

    source: str
    seed: int = 0
    switches: tuple[SwitchEntry, ...] = ()
    jobs: tuple[JobEntry, ...] = ()

    def error(self, where: str, message: str) -> ConfigError:
        """A ConfigError about the table ``where`` of this file, for readers that check more."""
        return ConfigError(f"{self.source}: {where}: {message}")

    def jobs_of(self, switch: str) -> list[JobEntry]:
        """The jobs that go to the switch named ``switch`` (a job naming none goes to the only one)."""
        return [job for job in self.jobs if job.switch in (None, switch)]


def load_jobs(path: str | Path) -> JobFile:
    """Read and check a jobs file; every problem is a :class:`ConfigError` naming the file."""
    return parse_jobs(read_text(path), str(path))


def read_text(path: str | Path, what: str = "jobs file") -> str:
    """A config file's text; a missing or unreadable file is a :class:`ConfigError` naming it (the
    softswitch's and the parameter server's jobs files are read alike)."""
    path = Path(path)
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML text as a dict; a syntax error is a :class:`ConfigError` naming ``source``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None


def parse_jobs(text: str, source: str = "<jobs file>") -> JobFile:
    """Check a jobs file's text against the schema (module docstring) and return it as dataclasses."""
    return TableReader(source).document(parse_toml(text, source))


class TableReader:
    """Checks one parsed document; ``where`` strings name tables as paths (``jobs[0].workers[1]``).
    The generic checks (keys, integers, strings, numbers, drop tables) also read the parameter
    server's jobs (``softswitch/ps/config.py``), so both files answer a mistake in the same words."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {where}: {message}")

    # ---- generic checks ----------------------------------------------------------------------------
    def only_keys(self, where: str, table: dict[str, Any], allowed: tuple[str, ...], path: str) -> None:
        """Refuse the first key of ``table`` that ``allowed`` lacks, suggesting the closest allowed one.
        ``path`` is the table's dotted TOML name ("" for the top level), to show keys as written."""
        for key in table:
            if key in allowed:
                continue
            shown = _toml_name(key, table[key], path)
            what = "table" if shown.startswith("[") else "key"
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            close = close or [k for k in allowed if k.startswith(key) or key.startswith(k)][:1]
            hint = f" (did you mean {_toml_name(close[0], None, path)}?)" if close else ""
            allowed_text = ", ".join(_toml_name(k, None, path) for k in allowed)
            raise self.fail(where, f"unknown {what} {shown}{hint}; allowed: {allowed_text}")

    def integer(
        self, where: str, table: dict[str, Any], key: str, low: int, high: int | None = None
    ) -> int | None:
        """``table[key]`` checked to be an integer in ``low..high``; None when the key is absent."""
        if key not in table:
            return None
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"{key} must be an integer, got {_toml_value(value)}")
        if value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise self.fail(where, f"{key} must be {span}, got {value}")
        return value

    def string(self, where: str, table: dict[str, Any], key: str) -> str | None:
        if key not in table:
            return None
        value = table[key]
        if not isinstance(value, str):
            raise self.fail(where, f"{key} must be a string, got {_toml_value(value)}")
        return value

    def number(self, where: str, table: dict[str, Any], key: str) -> float | None:
        """``table[key]`` as a float (an integer is accepted); None when the key is absent."""
        if key not in table:
            return None
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(where, f"{key} must be a number, got {_toml_value(value)}")
        return float(value)

    def boolean(self, where: str, table: dict[str, Any], key: str) -> bool | None:
        if key not in table:
            return None
        value = table[key]
        if not isinstance(value, bool):
            raise self.fail(where, f"{key} must be true or false, got {_toml_value(value)}")
        return value

    def probability(self, where: str, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(where, f"{key} must be a number, got {_toml_value(value)}")
        if not 0.0 <= value <= 1.0:
            raise self.fail(where, f"{key} must be a probability in [0, 1], got {value}")
        return float(value)

    def tables(self, where: str, doc: dict[str, Any], key: str, path: str) -> list[dict[str, Any]]:
        value = doc.get(key, [])
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise self.fail(where, f"{key} must be written as {_toml_name(key, None, path)} tables")
        return value

    # ---- the document --------------------------------------------------------------------------------
    def document(self, doc: dict[str, Any]) -> JobFile:
        top = "the top level"
        self.only_keys(top, doc, _TOP_KEYS, "")
        seed = self.integer(top, doc, "seed", 0, 2**63 - 1) or 0
        switches: list[SwitchEntry] = []
        for i, table in enumerate(self.tables(top, doc, "switches", "")):
            switch = self.switch(f"switches[{i}]", table, i)
            if any(s.name == switch.name for s in switches):
                raise self.fail(f"switches[{i}]", f"two switches are named {switch.name!r}")
            switches.append(switch)
        names = [s.name for s in switches]
        jobs: list[JobEntry] = []
        for i, table in enumerate(self.tables(top, doc, "jobs", "")):
            job = self.job(i, table, names)
            if any(j.job_id == job.job_id for j in jobs):
                raise self.fail(job.where, f"job_id {job.job_id} appears twice")
            jobs.append(job)
        return JobFile(self.source, seed, tuple(switches), tuple(jobs))

    def switch(self, where: str, table: dict[str, Any], i: int) -> SwitchEntry:
        self.only_keys(where, table, _SWITCH_KEYS, "switches")
        name = self.string(where, table, "name") or f"s{i + 1}"
        target = self.string(where, table, "target") or DEFAULT_P4RUNTIME_TARGET
        try:
            parse_address(target)
        except ValueError as exc:
            raise self.fail(where, f"target: {exc}") from None
        device_id = self.integer(where, table, "device_id", 0, 2**64 - 1) or 0
        return SwitchEntry(name, target, device_id)

    def job(self, i: int, table: dict[str, Any], switch_names: list[str]) -> JobEntry:
        given_id = table.get("job_id")
        named = isinstance(given_id, int) and not isinstance(given_id, bool)
        where = f"jobs[{i}] (job_id {given_id})" if named else f"jobs[{i}]"
        self.only_keys(where, table, _JOB_KEYS, "jobs")
        job_id = self.integer(where, table, "job_id", 1, MAX_JOBS - 1)
        if job_id is None:
            raise self.fail(where, "job_id = N is missing")
        raw_workers = table.get("workers")
        if not isinstance(raw_workers, list) or not raw_workers:
            raise self.fail(
                where,
                'workers is missing: workers = ["IP:UDP_PORT", ...] or tables { ip, udp_port, port, mac }',
            )
        if len(raw_workers) > MAX_WORKERS:
            raise self.fail(where, f"a job has at most {MAX_WORKERS} workers, got {len(raw_workers)}")
        workers = tuple(self.worker(f"{where}.workers[{w}]", value) for w, value in enumerate(raw_workers))
        seen: dict[tuple[str, int], int] = {}
        for w, worker in enumerate(workers):
            address = worker.address
            if address is None:
                continue
            if address in seen:
                raise self.fail(
                    where, f"workers {seen[address]} and {w} both have address {address[0]}:{address[1]}"
                )
            seen[address] = w
        n = len(workers)
        switch = self.string(where, table, "switch")
        if switch is not None and switch not in switch_names:
            have = f"the file has {switch_names}" if switch_names else "the file has none"
            raise self.fail(where, f"switch = {switch!r} names no [[switches]] table; {have}")
        if switch is None and len(switch_names) > 1:
            raise self.fail(
                where, f'say which switch holds the job (switch = "..."); the file has {switch_names}'
            )
        drops: list[DropEntry] = []
        for d, drop_table in enumerate(self.tables(where, table, "drop", "jobs")):
            drop = self.drop(f"{where}.drop[{d}]", drop_table, n)
            if any((x.direction, x.worker) == (drop.direction, drop.worker) for x in drops):
                who = "all workers" if drop.worker is None else f"worker {drop.worker}"
                raise self.fail(f"{where}.drop[{d}]", f"a second {drop.direction} policy for {who}")
            drops.append(drop)
        elems = self.integer(where, table, "elems_per_packet", 1, MAX_ELEMS_PER_PACKET)
        k = DEFAULT_ELEMS_PER_PACKET if elems is None else elems
        pool = self.integer(where, table, "pool_size", MIN_POOL_SIZE, MAX_POOL_SIZE)
        role, uplink_entry, leaf_id, worker_base = self.hierarchy(where, table, n)
        uplink = None if uplink_entry is None else uplink_entry.address
        entry = JobEntry(
            job_id=job_id,
            workers=workers,
            quorum=self.integer(where, table, "quorum", 1, n),
            pool_size=resolve_pool_size(pool, k),
            slot_base=self.integer(where, table, "slot_base", 0, MAX_POOL_SIZE - 1),
            elems_per_packet=k,
            switch=switch,
            drops=tuple(drops),
            index=i,
            role=role,
            uplink=uplink,
            leaf_id=leaf_id,
            worker_base=worker_base,
            uplink_port=None if uplink_entry is None else uplink_entry.port,
            uplink_mac=None if uplink_entry is None else uplink_entry.mac,
        )
        try:
            entry.as_job()  # the rules every job is checked by (hostlib.job), after the file's own
        except ValueError as exc:
            raise self.fail(where, str(exc)) from None
        return entry

    def hierarchy(
        self, where: str, table: dict[str, Any], n: int
    ) -> tuple[str, WorkerEntry | None, int, int]:
        """``role``, ``uplink``, ``leaf_id`` and ``worker_base`` of a job, checked together. ``uplink`` is
        "IP:UDP_PORT" or a table like a worker's ({ ip, udp_port, port, mac }; ip and udp_port needed)."""
        role = self.string(where, table, "role") or "flat"
        if role not in ROLES:
            raise self.fail(where, f"role = {role!r}: must be one of {', '.join(ROLES)}")
        leaf_only = [key for key in ("uplink", "leaf_id", "worker_base") if key in table]
        if role != "leaf" and leaf_only:
            raise self.fail(where, f'{", ".join(leaf_only)} only belong to a job with role = "leaf"')
        if role == "spine" and n > MAX_LEAVES:
            raise self.fail(where, f"a spine's workers are its leaves: at most {MAX_LEAVES}, got {n}")
        if role != "leaf":
            return role, None, 0, 0
        value = table.get("uplink")
        if value is None:
            raise self.fail(where, 'a leaf needs uplink = "IP:UDP_PORT" (the spine\'s address)')
        if isinstance(value, dict):
            uplink = self.worker(f"{where}.uplink", value)
            if uplink.address is None:
                raise self.fail(f"{where}.uplink", "give the spine's ip and udp_port")
        elif isinstance(value, str):
            try:
                host, udp_port = parse_address(value)
            except ValueError as exc:
                raise self.fail(f"{where}.uplink", str(exc)) from None
            uplink = WorkerEntry(ip=host, udp_port=udp_port)
        else:
            raise self.fail(
                where,
                f'uplink is "IP:UDP_PORT" or a table {{ ip, udp_port, port, mac }}, got {_toml_value(value)}',
            )
        leaf_id = self.integer(where, table, "leaf_id", 0, MAX_LEAVES - 1)
        worker_base = self.integer(where, table, "worker_base", 0, MAX_WORKERS - n)
        return role, uplink, leaf_id or 0, worker_base or 0

    def worker(self, where: str, value: Any) -> WorkerEntry:
        if isinstance(value, int) and not isinstance(value, bool):
            return WorkerEntry(port=self.integer(where, {"port": value}, "port", 0, MAX_SWITCH_PORT))
        if isinstance(value, str):
            return self.worker_text(where, value)
        if isinstance(value, dict):
            self.only_keys(where, value, _WORKER_KEYS, "jobs.workers")
            ip = self.string(where, value, "ip")
            mac = self.string(where, value, "mac")
            return WorkerEntry(
                ip=None if ip is None else self.ipv4(where, ip),
                udp_port=self.integer(where, value, "udp_port", 1, 65535),
                port=self.integer(where, value, "port", 0, MAX_SWITCH_PORT),
                mac=None if mac is None else self.mac(where, mac),
            )
        raise self.fail(
            where,
            f'a worker is "IP:UDP_PORT", a port number or a table {{ ip, udp_port, port, mac }}, '
            f"got {_toml_value(value)}",
        )

    def worker_text(self, where: str, text: str) -> WorkerEntry:
        port_text, at, ip = text.partition("@")
        if at:  # PORT@IP: workers that share a switch port, told apart by address
            if not port_text.isdigit():
                raise self.fail(where, f"{text!r} is not PORT@IP (e.g. 1@10.0.0.1)")
            port = self.integer(where, {"port": int(port_text)}, "port", 0, MAX_SWITCH_PORT)
            return WorkerEntry(ip=self.ipv4(where, ip), port=port)
        try:
            host, udp_port = parse_address(text)
        except ValueError as exc:
            raise self.fail(where, str(exc)) from None
        return WorkerEntry(ip=self.ipv4(where, host), udp_port=udp_port)

    def ipv4(self, where: str, text: str) -> str:
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            raise self.fail(
                where,
                f"ip {text!r} is not an IPv4 address; switches match workers by the address their "
                f"packets come from, so write the number (e.g. 127.0.0.1)",
            ) from None

    def mac(self, where: str, text: str) -> str:
        try:
            return format_mac(parse_mac(text))
        except ValueError as exc:
            raise self.fail(where, str(exc)) from None

    def drop(self, where: str, table: dict[str, Any], n_workers: int) -> DropEntry:
        self.only_keys(where, table, _DROP_KEYS, "jobs.drop")
        direction = self.string(where, table, "direction")
        if direction not in DIRECTIONS:
            got = "it is missing" if direction is None else f"got {direction!r}"
            raise self.fail(where, f"direction must be one of {', '.join(DIRECTIONS)}; {got}")
        model = self.string(where, table, "model") or "bernoulli"
        if model not in DROP_MODELS:
            raise self.fail(where, f"model must be one of {', '.join(DROP_MODELS)}, got {model!r}")
        worker = self.integer(where, table, "worker", 0, n_workers - 1)
        params = {k: self.probability(where, k, table[k]) for k in _DROP_KEYS[3:] if k in table}
        if model == "none" and params:
            raise self.fail(where, f'model = "none" takes no parameters, got {", ".join(params)}')
        extra = [k for k in _GILBERT_ELLIOTT_ONLY if k in params]
        if model == "bernoulli" and extra:
            verb = "applies" if len(extra) == 1 else "apply"
            raise self.fail(where, f'{", ".join(extra)} {verb} to model = "gilbert_elliott" only')
        return DropEntry(direction, None if model == "none" else DropPolicy(model, **params), worker)


def parse_mac(text: str) -> bytes:
    """``"02:00:00:00:00:01"`` -> 6 bytes; ValueError naming the text otherwise."""
    parts = text.split(":")
    if len(parts) != 6 or not all(len(p) == 2 for p in parts):
        raise ValueError(f"mac {text!r} is not a MAC address like 02:00:00:00:00:01")
    try:
        return bytes(int(p, 16) for p in parts)
    except ValueError:
        raise ValueError(f"mac {text!r} is not a MAC address like 02:00:00:00:00:01") from None


def format_mac(data: bytes) -> str:
    return ":".join(f"{b:02x}" for b in data)


def _toml_name(key: str, value: Any, path: str) -> str:
    """How a key of the table at dotted ``path`` looks in a file: ``[[jobs]]`` for an array of tables,
    ``[name]`` for a table, ``'quorum'`` for a plain key. ``value`` None: judge by the key's name."""
    dotted = f"{path}.{key}" if path else key
    if key in _TABLE_ARRAYS.get(path, ()) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)
    ):
        return f"[[{dotted}]]"
    if isinstance(value, dict):
        return f"[{dotted}]"
    return repr(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return str(value)
