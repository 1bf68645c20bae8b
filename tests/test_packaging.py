"""What ``pip install .`` gives: the wheel's contents, the ``torch.backends`` entry point, and a fresh venv
with no extras where ``lta`` works and stock torch code reaches ``init_process_group("lta")`` with no LTA
import.

The wheel is built from the files a checkout has (``git ls-files``: tracked and untracked, not ignored),
copied to a temporary folder so the build leaves nothing in the working tree. The fresh-venv tests are
``slow`` (``pytest -m slow tests/test_packaging.py``); the entry point is also checked in the default run,
through torch's own loader, by a distribution that declares only it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from importlib import import_module
from pathlib import Path

import pytest

from hostlib.p4 import schema as p4schema

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
P4_BUILD_FILES = ("lta.json", "lta.p4info.txtpb")
TYPED_PACKAGES = ("hostlib", "softswitch", "controlplane", "mininet_topos")
TOP_LEVEL = ("lta", "hostlib", "softswitch", "controlplane", "mininet_topos")
# Modules that registering the backend name must not import (the transport, the switch, the app).
HEAVY = ("hostlib.torch_ext.backend", "hostlib.transport", "softswitch", "controlplane", "lta")
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would point a child at the checkout or at a switch."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("LTA_")
    }
    env.update(extra)
    return env


def _checkout_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"building the wheel copies the checkout's files with git ls-files, which failed: {exc}")
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [*PIP_WHEEL, "-w", str(dist), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, f"pip wheel failed:\n{build.stdout}\n{build.stderr}"
    (whl,) = dist.glob("lta-*.whl")
    return whl


# ---- the wheel -----------------------------------------------------------------------------------------


def test_wheel_carries_the_compiled_program_and_py_typed(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for name in P4_BUILD_FILES:
            assert f"hostlib/p4build/{name}" in names, f"the wheel lacks p4/build/{name}"
            assert zf.read(f"hostlib/p4build/{name}") == (ROOT / "p4" / "build" / name).read_bytes()
        for package in TYPED_PACKAGES:
            assert f"{package}/py.typed" in names
        assert "hostlib/_batchio.pyi" in names
        # Every package of the checkout is in the wheel (setup.py lists them by search, not by hand).
        for top in TOP_LEVEL:
            for init in (ROOT / top).rglob("__init__.py"):
                assert init.relative_to(ROOT).as_posix() in names
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert re.search(r"^\[torch\.backends\]\nlta = hostlib\.torch_ext\.entry:autoload$", entry_points, re.M)
    assert re.search(r"^\[console_scripts\]\nlta = lta\.cli:main$", entry_points, re.M)
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    plain = {re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert {"numpy", "torch", "rich", "matplotlib"} <= plain  # what train, demo, bench, softswitch import
    # Only ctl, the P4Runtime server, packet tools and tests use these: extras, not runtime dependencies.
    assert not plain & {"scapy", "grpcio", "protobuf", "finsy", "torchft", "pytest", "mypy"}
    assert any(r.startswith("scapy") and 'extra == "tools"' in r for r in requires)
    assert any(r.startswith("grpcio") and 'extra == "p4rt"' in r for r in requires)


def test_every_requirement_is_pinned_in_constraints() -> None:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    project = PYPROJECT["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += extra
    for requirement in wanted:
        name = re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0]
        assert re.sub(r"[-_.]+", "-", name).lower() in pins, f"{name} is not pinned in constraints.txt"
    assert pins["torch"] == "2.13.0"


def test_p4schema_finds_the_checkouts_build() -> None:
    assert p4schema.BUILD_DIR == ROOT / "p4" / "build"
    assert p4schema.P4INFO_PATH.is_file() and p4schema.BMV2_JSON_PATH.is_file()


# ---- the entry point -----------------------------------------------------------------------------------


def test_the_declared_entry_point_is_a_function_of_no_arguments() -> None:
    (target,) = PYPROJECT["project"]["entry-points"]["torch.backends"].values()
    module, _, attr = target.partition(":")
    assert module == "hostlib.torch_ext.entry"
    func = getattr(import_module(module), attr)
    assert callable(func)
    func()  # torch calls it so; idempotent
    import torch.distributed as dist

    assert dist.Backend.backend_list.count("lta") == 1


def test_autoload_logs_and_returns_when_registration_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hostlib.torch_ext import entry

    def broken() -> None:
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(entry, "register", broken)
    with caplog.at_level(logging.WARNING, logger="hostlib.torch_ext.entry"):
        assert entry.autoload() is None
    assert "simulated failure" in caplog.text and "'lta'" in caplog.text


def test_register_keeps_the_first_registration() -> None:
    import torch.distributed as dist

    from hostlib.torch_ext import entry, register_backend

    register_backend()
    plugin = dist.Backend._plugins["LTA"]
    entry.register()
    register_backend()
    assert dist.Backend._plugins["LTA"] is plugin
    assert dist.Backend.backend_list.count("lta") == 1
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # "lta" claims no device


def _probe(code: str, env: dict[str, str], cwd: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
import json, sys
{imports}
import torch.distributed as dist
heavy = [m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in {heavy!r})]
print(json.dumps({{"registered": "lta" in dist.Backend.backend_list, "heavy": sorted(heavy)}}))
"""


def test_import_torch_registers_lta_through_the_entry_point(tmp_path: Path) -> None:
    # A distribution whose only content is the declared entry point, on the path beside the checkout:
    # torch's own loader finds it and calls the function, as it does for the installed package.
    dist_info = tmp_path / "lta_entry_probe-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: lta-entry-probe\nVersion: 0\n")
    (target,) = PYPROJECT["project"]["entry-points"]["torch.backends"].values()
    (dist_info / "entry_points.txt").write_text(f"[torch.backends]\nlta = {target}\n")
    path = f"{tmp_path}{os.pathsep}{ROOT}"
    code = PROBE.format(imports="import torch", heavy=HEAVY)
    on = _probe(code, _clean_env(PYTHONPATH=path, TORCH_DEVICE_BACKEND_AUTOLOAD="1"), tmp_path)
    assert on == {"registered": True, "heavy": []}
    off = _probe(code, _clean_env(PYTHONPATH=path, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), tmp_path)
    assert off["registered"] is False  # so it was the entry point above


def test_importing_the_torch_layer_registers_lta(tmp_path: Path) -> None:
    code = PROBE.format(imports="import hostlib.torch_ext", heavy=HEAVY)
    seen = _probe(code, _clean_env(PYTHONPATH=str(ROOT), TORCH_DEVICE_BACKEND_AUTOLOAD="0"), tmp_path)
    assert seen == {"registered": True, "heavy": []}


# ---- a fresh venv: pip install <wheel>, no extras --------------------------------------------------------
# Marked slow: installing torch and the rest into a new venv takes 50-110 s on 2 cores (pip's cache warm).

STOCK_SCRIPT = """
import sys

import torch
import torch.distributed as dist

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("lta", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
inputs = [torch.randn(100_000, generator=torch.Generator().manual_seed(r)) for r in range(world)]
x = inputs[rank].clone()
dist.all_reduce(x, op=dist.ReduceOp.SUM)
expected = torch.stack(inputs).sum(0)
print(dist.get_backend(), dist.group.WORLD.lossy_calls, float((x - expected).abs().max()))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv that sees none of this one's packages, with the wheel installed from constraints.txt."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # torch==2.13.0 comes from the local wheel the pip configuration names; the rest from the index.
    install = _venv_run(
        venv, "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheel), timeout=900
    )
    assert install.returncode == 0, f"pip install of the wheel failed:\n{install.stdout}\n{install.stderr}"
    return venv


def _venv_run(venv: Path, program: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``venv/bin/<program> args`` from a neutral folder (not the checkout: it would shadow the install)."""
    return subprocess.run(
        [str(venv / "bin" / program), *args],
        env=_clean_env(),
        cwd=venv,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_fresh_venv_has_no_extras(fresh_venv: Path) -> None:
    for module in ("grpc", "finsy", "scapy"):
        out = _venv_run(fresh_venv, "python", "-c", f"import {module}")
        assert out.returncode != 0 and f"No module named '{module}'" in out.stderr


@pytest.mark.slow
def test_fresh_venv_reads_the_compiled_program_from_the_wheel(fresh_venv: Path) -> None:
    # named from the module imported above: a move of it fails this file's import in the default run
    code = f"import {p4schema.__name__} as s; print(s.P4INFO_PATH); print(s.BMV2_JSON_PATH)"
    out = _venv_run(fresh_venv, "python", "-c", code)
    assert out.returncode == 0, out.stderr
    for line, name in zip(out.stdout.split(), ("lta.p4info.txtpb", "lta.json"), strict=True):
        path = Path(line)
        assert path.is_relative_to(fresh_venv) and path.name == name
        assert path.read_bytes() == (ROOT / "p4" / "build" / name).read_bytes()


@pytest.mark.slow
def test_stock_torch_script_all_reduces_through_lta(fresh_venv: Path, tmp_path: Path) -> None:
    script = tmp_path / "stock.py"
    script.write_text(STOCK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    python = str(fresh_venv / "bin" / "python")
    ranks = [
        subprocess.Popen(
            [python, str(script), str(rank), "2", port],
            env=_clean_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=180) for proc in ranks]
    for proc, (stdout, stderr) in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, stderr
        backend, lossy_calls, max_error = stdout.split()
        assert backend == "lta"
        assert int(lossy_calls) == 1  # through the switch, not the reliable gloo path
        # No loss here: the sum of both inputs, within float32 and fixed-point rounding (|sum| < 10).
        assert float(max_error) < 1e-5


@pytest.mark.slow
def test_lta_commands_in_fresh_venv(fresh_venv: Path, wheel: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        out = _venv_run(fresh_venv, "lta", *args)
        assert out.returncode == 0, f"lta {' '.join(args)}:\n{out.stderr}"
        return out

    assert "softswitch" in run("--help").stdout
    version = wheel.name.split("-")[1]
    assert version in run("--version").stdout
    for command in ("train", "demo", "bench", "softswitch"):
        run(command, "--help")
    demo = run("demo", "--workers", "2", "--mib", "0.1", "--rounds", "2", "--json")
    assert json.loads(demo.stdout)["exact"] is True
