"""The P4 program's schema, shared by the switch and its client: where the compiled program is, the
names of its tables, actions, counters and registers, table entries by name, and how a drop policy is
written as a table entry.

Neither the softswitch's P4Runtime server nor ``controlplane`` owns this: both import it, so the two ends
cannot disagree on a name or an encoding. Standard library (and :mod:`hostlib.emulation.dropmodels`) only; the
P4Info lookups and protobuf conversions that need the ``p4rt`` extra are in :mod:`hostlib.p4.info`.
Every name here exists in ``p4/build/lta.p4info.txtpb`` (``tests/test_controlplane.py`` checks it).

Drop-policy probabilities travel as 32-bit thresholds: the P4 program drops when a uniform draw in
[0, 2^32 - 2] is below ``round(p * (2^32 - 1))``, so p = 0 never drops and p = 1 always does. A policy
for one worker (exact ``worker_id``, higher priority) wins over the job-wide one (wildcard).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hostlib.emulation.dropmodels import DIRECTIONS, NO_LOSS, DropPolicy
from hostlib.protocol import COUNTERS


def _build_dir() -> Path:
    """The compiled program: ``hostlib/p4build/`` in an installed wheel (setup.py ships ``p4/build`` there),
    else ``p4/build/`` of the checkout this module runs from."""
    package = Path(__file__).resolve().parent.parent  # hostlib/
    installed = package / "p4build"
    return installed if (installed / "lta.p4info.txtpb").is_file() else package.parent / "p4" / "build"


BUILD_DIR = _build_dir()
P4INFO_PATH = BUILD_DIR / "lta.p4info.txtpb"
BMV2_JSON_PATH = BUILD_DIR / "lta.json"

JOBS_TABLE = "LtaIngress.job_lookup.jobs"
SET_JOB = "LtaIngress.job_lookup.set_job"
WORKER_PORTS_TABLE = "LtaIngress.worker_check.worker_ports"
EXPECT_PORT = "LtaIngress.worker_check.expect_port"
WORKER_ADDRESSES_TABLE = "LtaEgress.worker_address.worker_addresses"
SET_ADDRESS = "LtaEgress.worker_address.set_address"
# A job's role in a hierarchy (docs/protocol.md, "Hierarchy"): no entry is a flat job.
JOB_ROLES_TABLE = "LtaIngress.job_lookup.job_roles"
SET_LEAF = "LtaIngress.job_lookup.leaf"  # params uplink_port, leaf_id
SET_SPINE = "LtaIngress.job_lookup.spine"
# Only a program with roles has these (the v1model one; not the Tofino one): not in required_names().
ROLE_NAMES = {"tables": [JOB_ROLES_TABLE], "actions": [SET_LEAF, SET_SPINE]}
# The worker_addresses key (worker_id) of a leaf's uplink: where its partials are addressed to
# (p4/v1model/headers.p4 LTA_UPLINK; above every worker id).
UPLINK_WORKER_ID = 0xFF
# One DropPolicy control instance per direction (see p4/v1model/drop_policy.p4).
POLICY_CONTROLS = {
    "up": "LtaIngress.up_loss",
    "down": "LtaEgress.down_loss",
    "param": "LtaEgress.param_loss",
}
SLOT_REGISTER = "LtaIngress.slot_update.slot_seq"  # its size is the switch's slot capacity


def policy_table(direction: str) -> str:
    return f"{POLICY_CONTROLS[direction]}.policy"


def policy_action(direction: str, model: str) -> str:
    return f"{POLICY_CONTROLS[direction]}.{model}"


def required_names() -> dict[str, list[str]]:
    """Every P4Info object the control plane (and the softswitch's P4Runtime server) relies on."""
    tables = [JOBS_TABLE, WORKER_PORTS_TABLE, WORKER_ADDRESSES_TABLE]
    tables += [policy_table(d) for d in POLICY_CONTROLS]
    actions = [SET_JOB, EXPECT_PORT, SET_ADDRESS]
    actions += [
        policy_action(d, m) for d in POLICY_CONTROLS for m in ("no_loss", "bernoulli", "gilbert_elliott")
    ]
    return {
        "tables": tables,
        "actions": actions,
        "counters": list(COUNTERS),
        "registers": [SLOT_REGISTER],
    }


def encode(value: int, bitwidth: int) -> bytes:
    """An unsigned integer as a canonical P4Runtime bytestring (shortest big-endian, at least 1 byte)."""
    if not 0 <= value < (1 << bitwidth):
        raise ValueError(f"{value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode(data: bytes) -> int:
    return int.from_bytes(data, "big")


Ternary = tuple[int, int]  # (value, mask)


@dataclass(frozen=True)
class Entry:
    """One table entry. ``match`` maps a key field to an int (exact) or (value, mask) (ternary); a
    ternary field left out matches anything. ``action`` is the full action name."""

    table: str
    match: Mapping[str, int | Ternary]
    action: str = ""
    params: dict[str, int] = field(default_factory=dict)
    priority: int = 0

    def key(self) -> tuple:
        """What identifies the entry in its table (P4Runtime: match fields and priority)."""
        return (self.table, tuple(sorted(self.match.items())), self.priority)


THRESHOLD_MAX = 0xFFFFFFFF
PRIORITY_ONE_WORKER = 2
PRIORITY_ALL_WORKERS = 1
_GE_PARAMS = ("p", "r", "loss_good", "loss_bad")


def threshold(probability: float) -> int:
    return round(probability * THRESHOLD_MAX)


def probability(threshold_value: int) -> float:
    # Rounded so that a policy read back equals the one written (p = 0.1 stays 0.1).
    return round(threshold_value / THRESHOLD_MAX, 9)


def policy_entry(job_id: int, direction: str, policy: DropPolicy | None, worker: int | None = None) -> Entry:
    """The table entry for one policy; ``policy`` None gives the entry's key only (for a DELETE)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    match: dict = {"job_id": job_id}
    if worker is None:
        priority = PRIORITY_ALL_WORKERS
    else:
        match["worker_id"] = (worker, 0xFF)
        priority = PRIORITY_ONE_WORKER
    if policy is None:
        return Entry(policy_table(direction), match, priority=priority)
    if policy == NO_LOSS:
        return Entry(policy_table(direction), match, policy_action(direction, "no_loss"), {}, priority)
    if policy.model == "bernoulli":
        params = {"loss": threshold(policy.p)}
    else:
        params = {name: threshold(getattr(policy, name)) for name in _GE_PARAMS}
    return Entry(policy_table(direction), match, policy_action(direction, policy.model), params, priority)


def policy_of(entry: Entry) -> tuple[str, int, int | None, DropPolicy]:
    """(direction, job_id, worker or None, policy) of a policy table entry."""
    direction = next(d for d in DIRECTIONS if entry.table == policy_table(d))
    job_id, worker_key = entry.match["job_id"], entry.match.get("worker_id")
    if isinstance(job_id, tuple) or isinstance(worker_key, int):
        raise ValueError(f"{entry.table}: job_id must be exact and worker_id ternary, got {entry.match}")
    worker = None if worker_key is None else worker_key[0]
    model = entry.action.rsplit(".", 1)[-1]
    if model == "no_loss":
        policy = NO_LOSS
    elif model == "bernoulli":
        policy = DropPolicy("bernoulli", p=probability(entry.params["loss"]))
    else:
        policy = DropPolicy("gilbert_elliott", **{n: probability(entry.params[n]) for n in _GE_PARAMS})
    return direction, job_id, worker, policy


def describe(policy: DropPolicy) -> str:
    if policy == NO_LOSS:
        return "no loss"
    if policy.model == "bernoulli":
        return f"bernoulli(p={policy.p:g})"
    return (
        f"gilbert_elliott(p={policy.p:g}, r={policy.r:g}, loss_good={policy.loss_good:g}, "
        f"loss_bad={policy.loss_bad:g})"
    )
