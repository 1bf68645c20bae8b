"""Builds the optional C extension hostlib._batchio; everything else is configured in pyproject.toml.

The extension is optional: where it does not compile (no compiler, not Linux), the install goes on and
hostlib.batchio falls back to its ctypes or plain socket paths.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hostlib._batchio", ["hostlib/_batchio.c"], optional=True)])
