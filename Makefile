# `make test` is the README's test command and what .ci/run calls: it builds its own
# virtual environment from scratch, so a fresh clone needs nothing installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch: the CPU build unless told otherwise (PyPI's plain Linux wheel would pull several GB of
# CUDA libraries). On a CUDA machine: `make setup TORCH=torch==2.13.0` (PyPI's wheel bundles
# CUDA), or a build of PyTorch's index, e.g. TORCH=torch==2.13.0+cu128
# TORCH_INDEX=https://download.pytorch.org/whl/cu128. `make clean` first to change an existing venv.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# `make serve PORT=8100` serves there; unset, --port is not passed (ORDINAL_PORT or 8000 applies).
PORT ?=

.PHONY: setup test lint format serve checkpoints bench clean browser nginx compose cross ui mutation bench-train

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# $(TORCH) from the configured indexes and find-links (a CPU wheel on disk is found there),
	# else from $(TORCH_INDEX): PyPI itself has no +cpu builds.
	$(PY) -m pip install --quiet '$(TORCH)' || \
		$(PY) -m pip install --quiet '$(TORCH)' --extra-index-url '$(TORCH_INDEX)'
	$(PY) -m pip install --quiet -e '.[dev]'
	# The C++ kernels (model/kernels/): every variant this CPU runs, side by side, here rather
	# than in the first server's start; a build is shared by every checkout of the same code.
	# Without a compiler this says so, and the torch code runs instead.
	$(PY) -m model.kernels || echo "the kernels could not be built: the torch code will decode"
	touch $(STAMP)

setup: $(STAMP)

# mypy reads its settings (what to check, the pydantic plugin) from pyproject.toml's [tool.mypy].
test: $(STAMP) browser nginx compose cross
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest

# The playground's browser tests drive Debian's chromium (Playwright's own browser downloads
# are never used); installed here when missing. Without it (no apt-get) they skip, but not in CI.
browser:
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		echo "chromium is not installed: the browser tests will skip (they fail under CI)"

# The scale-out test runs Debian's nginx in front of two servers; installed here when missing.
# Without it (no apt-get) that test skips, but not in CI.
nginx:
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || { command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx; } || \
		echo "nginx is not installed: the nginx test will skip (it fails under CI)"

# The compose test runs Debian's docker-compose 1.29 (the v1 tool, which the compose file must
# suit as well as Compose v2); installed here when missing. Without it that test skips, not in CI.
compose:
	@command -v docker-compose >/dev/null || { command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; } || \
		echo "docker-compose is not installed: its compose test will skip (it fails under CI)"

# The kernels' aarch64 build check cross-compiles them with Debian's g++-aarch64-linux-gnu;
# installed here when missing. Without it (no apt-get) that test skips, but not in CI.
cross:
	@command -v aarch64-linux-gnu-g++ >/dev/null || { command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		g++-aarch64-linux-gnu; } || \
		echo "g++-aarch64-linux-gnu is not installed: the aarch64 check will skip (it fails under CI)"

# The playground has no build step; this refreshes its vendored chart libraries from npm.
D3_VERSION := 7.9.2
PLOT_VERSION := 0.6.17
# axe-core is not loaded by the page: the browser tests inject it to check accessibility.
AXE_VERSION := 4.14.1
ui:
	rm -rf .ui-vendor && mkdir .ui-vendor
	cd .ui-vendor && npm pack --silent d3@$(D3_VERSION) @observablehq/plot@$(PLOT_VERSION) && \
		for f in *.tgz; do mkdir -p $${f%.tgz} && tar xzf $$f -C $${f%.tgz}; done
	cp .ui-vendor/d3-$(D3_VERSION)/package/dist/d3.min.js server/static/vendor/d3.v$(D3_VERSION).min.js
	cp .ui-vendor/d3-$(D3_VERSION)/package/LICENSE server/static/vendor/LICENSE.d3
	cp .ui-vendor/observablehq-plot-$(PLOT_VERSION)/package/dist/plot.umd.min.js \
		server/static/vendor/plot.v$(PLOT_VERSION).umd.min.js
	cp .ui-vendor/observablehq-plot-$(PLOT_VERSION)/package/LICENSE server/static/vendor/LICENSE.plot
	cp .ui-vendor/axe-core-$(AXE_VERSION)/package/axe.min.js server/static/vendor/axe.v$(AXE_VERSION).min.js
	cp .ui-vendor/axe-core-$(AXE_VERSION)/package/LICENSE server/static/vendor/LICENSE.axe
	rm -rf .ui-vendor

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

serve: $(STAMP)
	$(VENV)/bin/ordinal serve $(if $(PORT),--port $(PORT))

# Rebuilds every shipped checkpoint with the recipe in the repo (the `shipped` preset of
# model/config.py; 7–10 minutes each on 2 idle CPU cores), then scores them. The variables
# let CI run this same recipe on the `tiny` preset in seconds (tests/model/test_train.py):
# `make -o $(STAMP) checkpoints PRESET=tiny SCHEMES="rope alibi" CHECKPOINT_DIR=... RUNS=...`.
# RECIPES are checkpoints that are not a scheme of their own (checkpoints/README.md):
# prope is rope keeping the fastest 75% of its frequencies (p-RoPE), drope the rope checkpoint
# with rope removed and recalibrated for DROPE_FLAGS, a fifth of the base's steps (DroPE; needs
# rope in SCHEMES or built).
SCHEMES := none integer binary sinusoidal learned rope alibi t5 mds lowrank fox cope fire irope \
	stickbreaking pope path
RECIPES ?= prope drope
DROPE_FLAGS ?= --steps 480 --warmup-steps 48
EVAL_FLAGS ?=
PRESET ?= shipped
CHECKPOINT_DIR ?= checkpoints
RUNS ?= runs
ORDINAL ?= $(VENV)/bin/ordinal
TRAIN = $(ORDINAL) train --preset $(PRESET) --tokenizer $(RUNS)/tokenizer.json
checkpoints: $(STAMP)
	for scheme in $(SCHEMES); do \
		$(TRAIN) --scheme $$scheme --out $(CHECKPOINT_DIR)/$$scheme --state-dir $(RUNS)/$$scheme \
			|| exit 1; \
	done
	$(if $(filter prope,$(RECIPES)),$(TRAIN) --scheme rope --positional '{"fraction": 0.75}' \
		--out $(CHECKPOINT_DIR)/prope --state-dir $(RUNS)/prope)
	$(if $(filter drope,$(RECIPES)),$(TRAIN) --scheme none --init $(CHECKPOINT_DIR)/rope \
		$(DROPE_FLAGS) --out $(CHECKPOINT_DIR)/drope --state-dir $(RUNS)/drope)
	$(ORDINAL) eval $(addprefix $(CHECKPOINT_DIR)/,$(SCHEMES) $(RECIPES)) $(EVAL_FLAGS) \
		--plot $(CHECKPOINT_DIR)/loss_by_position.png --table $(CHECKPOINT_DIR)/results.md --save
	$(PY) -m lab.curves $(addprefix $(CHECKPOINT_DIR)/,$(SCHEMES) $(RECIPES)) \
		--out $(CHECKPOINT_DIR)/training_curves.png

# Speed figures into docs/benchmarks.md (transformers is a bench-only extra).
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench.run

# Training step time: tokens/s over 20 steps of ordinal train's default preset (rope, one thread)
# after 3 warm-up steps; BENCH_TRAIN passes options, e.g. BENCH_TRAIN="--threads 0 --profile".
BENCH_TRAIN ?=
bench-train: $(STAMP)
	$(PY) -m bench.train $(BENCH_TRAIN)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache

# Mutation testing (mutmut, one worker) of the files in pyproject.toml's [tool.ordinal.mutation],
# each against its own tests; FILES="model/positional/rope.py" runs only those. docs/testing.md.
mutation: $(STAMP)
	$(PY) -m tools.mutation $(FILES)
