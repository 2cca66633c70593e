# `make test` is the README's test command and what .ci/run calls: it builds its own
# virtual environment from scratch, so a fresh clone needs nothing installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint format serve checkpoints bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU machines: this takes the CPU build of torch that lies on disk (no CUDA download).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

serve: $(STAMP)
	$(VENV)/bin/ordinal serve

# Rebuilds every shipped checkpoint (about 9 minutes each on 2 CPU cores), then scores them.
SCHEMES := none integer binary sinusoidal learned rope alibi t5 mds lowrank
checkpoints: $(STAMP)
	for scheme in $(SCHEMES); do \
		$(VENV)/bin/ordinal train --scheme $$scheme --out checkpoints/$$scheme || exit 1; \
	done
	$(VENV)/bin/ordinal eval $(addprefix checkpoints/,$(SCHEMES)) \
		--plot checkpoints/loss_by_position.png --table checkpoints/results.md

# Speed figures into docs/benchmarks.md (transformers is a bench-only extra).
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache
