"""Builds the optional C extension hostlib._batchio and names the packages; the rest is in pyproject.toml.

The extension is optional: where it does not compile (no compiler, not Linux), the install goes on and
hostlib.batchio falls back to its ctypes or plain socket paths.

The compiled P4 program (``p4/build/lta.json``, ``p4/build/lta.p4info.txtpb``: what ``lta ctl load`` pushes
and the softswitch's P4Runtime server reads) ships in the wheel as ``hostlib/p4build/``: a data-only package
whose source folder is ``p4/build``, so the files stay where p4/README.md and the tests expect them.
``hostlib.p4.schema`` looks there first and falls back to ``p4/build`` of a checkout.
"""

from setuptools import Extension, find_packages, setup

_QUANTIZE = ["hostlib/_quantize.h", "hostlib/_hotloop.h"]
TOP_LEVEL = ["lta", "hostlib", "softswitch", "controlplane", "mininet_topos"]
PACKAGES = find_packages(include=[name for top in TOP_LEVEL for name in (top, f"{top}.*")])

setup(
    packages=[*PACKAGES, "hostlib.p4build"],
    package_dir={"hostlib.p4build": "p4/build"},
    ext_modules=[
        Extension("hostlib._batchio", ["hostlib/_batchio.c"], optional=True),
        # _codec and _engine share the quantize loop (hostlib/_quantize.h)
        Extension("hostlib._codec", ["hostlib/_codec.c"], depends=_QUANTIZE, optional=True),
        Extension("hostlib._engine", ["hostlib/_engine.c"], depends=_QUANTIZE, optional=True),
        # the switch's per-element loops share hostlib/_hotloop.h's vector copies
        Extension(
            "softswitch._swcore",
            ["softswitch/_swcore.c"],
            include_dirs=["hostlib"],
            depends=["hostlib/_hotloop.h"],
            optional=True,
        ),
    ],
)
