"""Our P4 program's P4Info: where the committed files are, the names the control plane uses, and the
encoding of values into P4Runtime bytestrings.

Every name here is a name in ``p4/v1model`` (``tests/test_controlplane_p4info.py`` checks each one
exists in the committed P4Info); nothing depends on the numeric ids, which the compiler chooses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from p4.config.v1 import p4info_pb2
from p4runtime_sh.context import Context, P4Type

from controlplane.errors import PipelineMismatch
from hostlib.protocol import COUNTERS

BUILD_DIR = Path(__file__).resolve().parent.parent / "p4" / "build"
P4INFO_PATH = BUILD_DIR / "lta.p4info.txtpb"
BMV2_JSON_PATH = BUILD_DIR / "lta.json"

JOBS_TABLE = "LtaIngress.job_lookup.jobs"
SET_JOB = "LtaIngress.job_lookup.set_job"
WORKER_PORTS_TABLE = "LtaIngress.worker_check.worker_ports"
EXPECT_PORT = "LtaIngress.worker_check.expect_port"
WORKER_ADDRESSES_TABLE = "LtaEgress.worker_address.worker_addresses"
SET_ADDRESS = "LtaEgress.worker_address.set_address"
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


def load_p4info(path: Path = P4INFO_PATH) -> p4info_pb2.P4Info:
    if not path.exists():
        raise FileNotFoundError(f"no P4Info at {path}: compile p4/v1model/lta.p4 (see p4/build/README.md)")
    info = p4info_pb2.P4Info()
    text_format.Merge(path.read_text(), info, allow_unknown_field=True)
    return info


def p4info_fingerprint(info: p4info_pb2.P4Info) -> str:
    """A short digest of a P4Info, to tell two pipelines apart in messages."""
    return hashlib.sha256(info.SerializeToString(deterministic=True)).hexdigest()[:12]


def missing_names(info: p4info_pb2.P4Info) -> list[str]:
    """Names the control plane needs that ``info`` lacks ("" when it is our program)."""
    missing = []
    for kind, names in required_names().items():
        present = {obj.preamble.name for obj in getattr(info, kind)}
        missing += [f"{kind[:-1]} {name}" for name in names if name not in present]
    return missing


def encode(value: int, bitwidth: int) -> bytes:
    """An unsigned integer as a canonical P4Runtime bytestring (shortest big-endian, at least 1 byte)."""
    if not 0 <= value < (1 << bitwidth):
        raise ValueError(f"{value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode(data: bytes) -> int:
    return int.from_bytes(data, "big")


@dataclass
class P4Names:
    """Name <-> id lookups over one P4Info (a thin layer over p4runtime-shell's Context)."""

    info: p4info_pb2.P4Info

    def __post_init__(self) -> None:
        missing = missing_names(self.info)
        if missing:
            raise PipelineMismatch(
                "the P4Info is not LTA's v1model program; missing: "
                + ", ".join(missing[:6])
                + (" ..." if len(missing) > 6 else "")
                + " — recompile p4/v1model/lta.p4 and load p4/build/ (lta ctl apply)"
            )
        self.ctx = Context()
        self.ctx.set_p4info(self.info)

    def id(self, kind: P4Type, name: str) -> int:
        return self.ctx.get_obj_id(kind, name)

    def name(self, obj_id: int) -> str:
        return self.ctx.get_name_from_id(obj_id)

    def table(self, name: str):
        return self.ctx.get_obj(P4Type.table, name)

    def action(self, name: str):
        return self.ctx.get_obj(P4Type.action, name)

    def match_field(self, table: str, field: str):
        return self.ctx.get_mf(table, field)

    def param(self, action: str, param: str):
        return self.ctx.get_param(action, param)

    def counter_size(self, name: str) -> int:
        return self.ctx.get_obj(P4Type.counter, name).size

    def slot_capacity(self) -> int:
        return next(r.size for r in self.info.registers if r.preamble.name == SLOT_REGISTER)
