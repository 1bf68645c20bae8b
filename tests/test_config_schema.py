"""The jobs file (hostlib/jobconfig.py): one schema for `lta softswitch --config` and `lta ctl apply`.

Every expectation is written out by hand from the file text; both readers are checked against it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controlplane import deployment
from controlplane.jobs import JobSpec, WorkerSpec
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import ConfigError
from hostlib.jobconfig import WorkerEntry, default_worker, load_jobs, parse_jobs
from softswitch.config import load_switch

REPO = Path(__file__).resolve().parent.parent

BOTH = """
seed = 11

[[jobs]]
job_id = 3
quorum = 2
pool_size = 64
workers = [
    { ip = "127.0.0.1", udp_port = 41001, port = 1, mac = "02:00:00:00:00:0a" },
    { ip = "127.0.0.1", udp_port = 41002, port = 2, mac = "02:00:00:00:00:0B" },
    { ip = "10.1.2.3", udp_port = 41003, port = 7 },
]

[[jobs.drop]]
direction = "up"
worker = 1
p = 0.25

[[jobs.drop]]
direction = "down"
model = "gilbert_elliott"
p = 0.01
r = 0.5
"""


def write(tmp_path: Path, text: str, name: str = "jobs.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- one file, two readers, the same jobs ------------------------------------------------------------
def test_one_file_gives_the_same_job_to_the_softswitch_and_to_ctl(tmp_path):
    path = write(tmp_path, BOTH)
    # What the file says, by hand: worker w's (ip, udp_port, port, mac); the third leaves mac out, so
    # it is worker 2's default 02:00:00:00:00:03.
    workers = [
        ("127.0.0.1", 41001, 1, "02:00:00:00:00:0a"),
        ("127.0.0.1", 41002, 2, "02:00:00:00:00:0b"),
        ("10.1.2.3", 41003, 7, "02:00:00:00:00:03"),
    ]
    policies = {
        ("up", 1): DropPolicy("bernoulli", p=0.25),
        ("down", None): DropPolicy("gilbert_elliott", p=0.01, r=0.5),
    }

    switch = load_switch(path)
    assert switch.seed == 11 and sorted(switch.jobs) == [3]
    cfg = switch.jobs[3].cfg
    assert cfg.workers == [(ip, udp) for ip, udp, _, _ in workers]
    assert (cfg.quorum, cfg.pool_size, cfg.elems_per_packet) == (2, 64, 64)
    assert switch.jobs[3].policies == policies

    plan = deployment.load(path, target="127.0.0.1:9999")
    assert list(plan.switches) == ["127.0.0.1:9999"]  # no [[switches]]: the jobs go to --target
    (job,) = plan.jobs["127.0.0.1:9999"]
    assert isinstance(job, JobSpec)
    assert [(w.ip, w.udp_port, w.port, w.mac) for w in job.workers] == workers
    assert (job.job_id, job.quorum, job.pool_size, job.slot_base) == (3, 2, 64, None)
    drops = {(d.direction, d.worker): d.policy for d in plan.drops["127.0.0.1:9999"]}
    assert drops == policies and all(d.job_id == 3 for d in plan.drops["127.0.0.1:9999"])


def test_the_documented_examples_parse_in_both_readers(tmp_path):
    """docs/jobs_file.md's first example is a complete file: both readers take it."""
    doc = (REPO / "docs" / "jobs_file.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", doc, re.S)
    # the third and fourth are a leaf's and a spine's (tests/test_hierarchy.py), the last the parameter
    # server's (tests/test_rough_edges.py)
    assert len(blocks) == 5
    full, shortest = (write(tmp_path, b, f"doc{i}.toml") for i, b in enumerate(blocks[:2]))
    assert load_switch(full).jobs[1].cfg.workers == [("127.0.0.1", 41001), ("127.0.0.1", 41002)]
    plan = deployment.load(full)
    assert [w.port for w in plan.jobs["s1"][0].workers] == [1, 2]
    assert plan.switches["s1"].target == "127.0.0.1:9559"
    assert load_switch(shortest).jobs[1].cfg.workers == [("127.0.0.1", 41001), ("127.0.0.1", 41002)]
    # The shortest softswitch file names no switch port: lta ctl needs one.
    with pytest.raises(ConfigError, match=r"doc1.toml: jobs\[0\] \(job_id 1\).workers\[0\]: .*port = N"):
        deployment.load(shortest)


# ---- unknown keys ----------------------------------------------------------------------------------
JOB = '[[jobs]]\njob_id = 1\nworkers = ["127.0.0.1:41001"]\n'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (JOB + "quroum = 1\n", r"jobs\[0\] \(job_id 1\): unknown key 'quroum' \(did you mean 'quorum'\?\)"),
        (
            JOB + "elems_per_packt = 32\n",
            r"jobs\[0\] \(job_id 1\): unknown key 'elems_per_packt' \(did you mean 'elems_per_packet'\?\)",
        ),
        (
            '[[jobz]]\njob_id = 1\nworkers = ["127.0.0.1:41001"]\n',
            r"unknown table \[\[jobz\]\] \(did you mean \[\[jobs\]\]\?\)",
        ),
        ("quroum = 1\n" + JOB, r"the top level: unknown key 'quroum'"),
        (
            JOB + '[[jobs.drops]]\ndirection = "up"\n',
            r"unknown table \[\[jobs.drops\]\] \(did you mean \[\[jobs.drop\]\]\?\)",
        ),
        (
            JOB + '[[jobs.drop]]\ndirection = "up"\nprob = 0.1\n',
            r"jobs\[0\] \(job_id 1\).drop\[0\]: unknown key 'prob'",
        ),
        (
            '[[jobs]]\njob_id = 1\nworkers = [{ ip = "127.0.0.1", udp = 41001 }]\n',
            r"jobs\[0\] \(job_id 1\).workers\[0\]: unknown key 'udp' \(did you mean 'udp_port'\?\)",
        ),
        ('[[switches]]\nadress = "127.0.0.1:1"\n', r"switches\[0\]: unknown key 'adress'"),
        (
            '[[switch]]\ntarget = "127.0.0.1:1"\n',
            r"unknown table \[\[switch\]\] \(did you mean \[\[switches\]\]\?\)",
        ),
        ("[jobs]\njob_id = 1\n", r"jobs must be written as \[\[jobs\]\] tables"),
    ],
)
def test_unknown_keys_are_refused_by_both_readers_naming_file_table_and_key(tmp_path, text, expected):
    path = write(tmp_path, text, "mistyped.toml")
    for reader in (load_switch, deployment.load):
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: .*{expected}"):
            reader(path)


# ---- types and ranges ------------------------------------------------------------------------------
def job_with(**fields: str) -> str:
    lines = {"job_id": "1", "workers": '["127.0.0.1:41001", "127.0.0.1:41002"]', **fields}
    return "[[jobs]]\n" + "".join(f"{k} = {v}\n" for k, v in lines.items())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (job_with(quorum='"2"'), 'quorum must be an integer, got "2"'),
        (job_with(job_id="true"), "job_id must be an integer, got true"),
        (job_with(pool_size="1.5"), "pool_size must be an integer, got 1.5"),
        (job_with(workers='"127.0.0.1:41001"'), "workers is missing"),
        (job_with(workers="[]"), "workers is missing"),
        (job_with(quorum="3"), "quorum must be 1..2, got 3"),
        (job_with(job_id="64"), "job_id must be 1..63, got 64"),
        (job_with(job_id="0"), "job_id must be 1..63, got 0"),
        (job_with(pool_size="0"), "pool_size must be 1..65535, got 0"),
        (job_with(elems_per_packet="0"), "elems_per_packet must be 1.."),
        (job_with(workers='["localhost:41001"]'), "ip 'localhost' is not an IPv4 address"),
        (job_with(workers='["127.0.0.1:99999"]'), "not HOST:PORT with a port in 1..65535"),
        (job_with(workers="[511]"), "port must be 0..510, got 511"),
        (job_with(workers='[{ ip = "127.0.0.1", udp_port = 0 }]'), "udp_port must be 1..65535, got 0"),
        (job_with(workers='[{ ip = "127.0.0.1", udp_port = 1, mac = "02:00" }]'), "mac '02:00' is not a MAC"),
        (job_with(workers='[{ ip = "127.0.0.1", udp_port = 1, mac = "zz:00:00:00:00:01" }]'), "is not a MAC"),
        (job_with(workers="[true]"), 'a worker is "IP:UDP_PORT", a port number or a table .*, got true'),
        (job_with(workers='["127.0.0.1:41001", "127.0.0.1:41001"]'), "workers 0 and 1 both have address"),
        ("seed = -1\n", "seed must be 0.."),
        (job_with() + job_with(), "job_id 1 appears twice"),
        ('[[switches]]\ntarget = "nowhere"\n', "target: address 'nowhere' is not HOST:PORT"),
        ('[[switches]]\nname = "a"\n[[switches]]\nname = "a"\n', "two switches are named 'a'"),
        ('[[switches]]\nname = "a"\n[[switches]]\nname = "b"\n' + job_with(), "say which switch"),
        (job_with(switch='"s9"'), "switch = 's9' names no \\[\\[switches\\]\\] table"),
    ],
)
def test_wrong_types_and_ranges_are_refused(text, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_jobs(text, "bad.toml")


@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        ('direction = "sideways"', "direction must be one of up, down, param; got 'sideways'"),
        ("p = 0.1", "direction must be one of up, down, param; it is missing"),
        ('direction = "up"\np = 1.5', r"p must be a probability in \[0, 1\], got 1.5"),
        ('direction = "up"\np = "0.1"', 'p must be a number, got "0.1"'),
        ('direction = "up"\nmodel = "pareto"', "model must be one of bernoulli, gilbert_elliott, none"),
        ('direction = "up"\nr = 0.5', 'r applies to model = "gilbert_elliott" only'),
        ('direction = "up"\nmodel = "none"\np = 0.5', 'model = "none" takes no parameters'),
        ('direction = "up"\nworker = 2', "worker must be 0..1, got 2"),
        ('direction = "up"\n[[jobs.drop]]\ndirection = "up"', "a second up policy for all workers"),
    ],
)
def test_drop_tables_are_checked(drop, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_jobs(job_with() + "[[jobs.drop]]\n" + drop + "\n", "bad.toml")


def test_a_missing_or_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        load_jobs(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot read jobs file"):
        load_jobs(tmp_path)  # a folder
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_jobs(write(tmp_path, "[[jobs]\n", "broken.toml"))


# ---- worker forms and defaults ---------------------------------------------------------------------
def test_worker_short_forms_and_defaults():
    job_file = parse_jobs(
        "[[jobs]]\njob_id = 2\n"
        'workers = ["127.0.0.1:5000", 4, "1@10.0.0.9", { port = 3, mac = "02:AA:00:00:00:01" }]\n'
    )
    assert job_file.jobs[0].workers == (
        WorkerEntry(ip="127.0.0.1", udp_port=5000),
        WorkerEntry(port=4),
        WorkerEntry(ip="10.0.0.9", port=1),
        WorkerEntry(port=3, mac="02:aa:00:00:00:01"),
    )
    # Mininet's addressing (mininet_topos/addressing.py): h(w+1) at 10.0.0.(w+1), mac (w+1) in two bytes.
    assert default_worker(0) == WorkerEntry(ip="10.0.0.1", udp_port=40000, port=1, mac="02:00:00:00:00:01")
    assert default_worker(63) == WorkerEntry(ip="10.0.0.64", udp_port=40063, port=64, mac="02:00:00:00:00:40")
    assert WorkerEntry(port=4).filled(1) == WorkerEntry(
        ip="10.0.0.2", udp_port=40001, port=4, mac="02:00:00:00:00:02"
    )


def test_each_reader_insists_on_what_it_needs(tmp_path):
    by_port = write(tmp_path, "[[jobs]]\njob_id = 1\nworkers = [1, 2]\n", "ports.toml")
    with pytest.raises(
        ConfigError, match=r"ports.toml: jobs\[0\] \(job_id 1\).workers\[0\]: the softswitch tells"
    ):
        load_switch(by_port)
    plan = deployment.load(by_port)
    assert plan.jobs[deployment.DEFAULT_TARGET][0].workers == (
        WorkerSpec(1, mac="02:00:00:00:00:01", ip="10.0.0.1", udp_port=40000),
        WorkerSpec(2, mac="02:00:00:00:00:02", ip="10.0.0.2", udp_port=40001),
    )
    big_k = write(tmp_path, job_with(elems_per_packet="32"), "k32.toml")
    assert load_switch(big_k).jobs[1].cfg.elems_per_packet == 32
    with pytest.raises(ConfigError, match="elems_per_packet = 32: a P4 switch runs its compiled K = 64"):
        deployment.load(big_k)
    # A default address that collides with one written out is caught after filling in.
    clash = write(
        tmp_path, '[[jobs]]\njob_id = 1\nworkers = [{ port = 1, ip = "10.0.0.2", udp_port = 40001 }, 2]\n'
    )
    with pytest.raises(ConfigError, match="workers 0 and 1 both have address 10.0.0.2:40001"):
        deployment.load(clash)
    workers = '[{ ip = "127.0.0.1", udp_port = 41001, port = 1 }]'
    two = write(
        tmp_path,
        '[[switches]]\nname = "a"\n[[switches]]\nname = "b"\n' + job_with(switch='"a"', workers=workers),
    )
    with pytest.raises(ConfigError, match="spreads its jobs over 2 switches"):
        load_switch(two)
    assert [j.job_id for j in deployment.load(two).jobs["a"]] == [1] and deployment.load(two).jobs["b"] == []


def test_the_docstring_examples_parse(tmp_path):
    """The examples in the modules' docstrings (what `lta ctl apply --help` shows) are valid files."""
    import controlplane.deployment
    import hostlib.jobconfig
    import softswitch.config

    def example(module) -> Path:
        text = module.__doc__.split("::\n", 1)[1]
        block = []
        for line in text.splitlines()[1:]:
            if line and not line.startswith("    "):
                break
            block.append(line[4:])
        return write(tmp_path, "\n".join(block), f"{module.__name__}.toml")

    schema = parse_jobs(example(hostlib.jobconfig).read_text())
    assert [s.name for s in schema.switches] == ["s1"] and schema.jobs[0].workers[1] == WorkerEntry(
        ip="127.0.0.1", udp_port=41002
    )
    assert load_switch(example(softswitch.config)).jobs[1].cfg.workers == [
        ("127.0.0.1", 41001),
        ("127.0.0.1", 41002),
    ]
    plan = deployment.load(example(controlplane.deployment))
    assert [(w.port, w.ip, w.udp_port) for w in plan.jobs["s1"][0].workers] == [
        (1, "10.0.0.1", 40000),
        (2, "10.0.0.2", 40001),
        (3, "10.0.0.3", 40002),
    ]
