# `make run`: set up .venv and run the main job. `make test`: set up .venv and run the tests.
# Both work on a fresh clone: Python 3.11 and pip are all they need (every package is pinned in
# constraints.txt). As root, `make test` also installs Debian's mininet, bridge-utils and nftables so
# the Mininet/netns tests run; without root those tests skip and say why. `mypy` type-checks the
# library (settings in pyproject.toml).

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# The main job: 0/10/40% loss, renormalized vs prev, 3 seeds (15 runs, about 5 minutes on 2 cores).
# The full table (every drop rate, method and mechanism): README.md, "The full table".
MAIN_JOB ?= train --drops 0,0.1,0.4 --methods renorm,prev
# pytest-xdist: one process per core (4 at most), a test file's tests together (its module fixtures run
# once). About 9 minutes on 2 cores against 13 in one process; PYTEST_PARALLEL= runs them in one process.
PYTEST_PARALLEL ?= -n auto --maxprocesses 4 --dist loadfile

.PHONY: run test setup lint clean-venv

$(STAMP): pyproject.toml constraints.txt setup.py hostlib/_batchio.c hostlib/_codec.c hostlib/_engine.c hostlib/_quantize.h softswitch/_swcore.c
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[dev,p4rt,tools]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/lta $(MAIN_JOB) $(ARGS)

test: $(STAMP)
	@if [ "$$(id -u)" = 0 ] && [ -x mininet_topos/setup_deps.sh ]; then mininet_topos/setup_deps.sh; fi
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q -ra --durations=15 $(PYTEST_PARALLEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff format --check .

clean-venv:
	rm -rf $(VENV)
