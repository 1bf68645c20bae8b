"""Emulated-loss policies on the switch: one table per direction (up / down / param), per job, for all
workers (worker_id wildcard) or one worker (exact worker_id, higher priority, so it wins).

Probabilities travel as 32-bit thresholds: the P4 program drops when a uniform draw in [0, 2^32 - 2]
is below ``round(p * (2^32 - 1))``, so p = 0 never drops and p = 1 always does.
"""

from __future__ import annotations

from controlplane.entries import Entry
from controlplane.p4info import policy_action, policy_table
from hostlib.dropmodels import DIRECTIONS, NO_LOSS, DropPolicy

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
    worker = entry.match["worker_id"][0] if "worker_id" in entry.match else None
    model = entry.action.rsplit(".", 1)[-1]
    if model == "no_loss":
        policy = NO_LOSS
    elif model == "bernoulli":
        policy = DropPolicy("bernoulli", p=probability(entry.params["loss"]))
    else:
        policy = DropPolicy("gilbert_elliott", **{n: probability(entry.params[n]) for n in _GE_PARAMS})
    return direction, entry.match["job_id"], worker, policy


def describe(policy: DropPolicy) -> str:
    if policy == NO_LOSS:
        return "no loss"
    if policy.model == "bernoulli":
        return f"bernoulli(p={policy.p:g})"
    return (
        f"gilbert_elliott(p={policy.p:g}, r={policy.r:g}, loss_good={policy.loss_good:g}, "
        f"loss_bad={policy.loss_bad:g})"
    )
