# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Each bootstraps .venv from nothing but python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
# The package and its runtime dependencies only: all the demo needs. The dev
# install includes it, so after `make test` the demo installs nothing.
RUNTIME_STAMP := $(VENV)/.installed-runtime

.PHONY: demo test lint typecheck unit compat-matrix netns-test bench bench-quick fuzz chaos clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP) $(RUNTIME_STAMP)

$(RUNTIME_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME_STAMP)

demo: $(RUNTIME_STAMP)
	$(BIN)/dp-coordinator demo $(ARGS)

test: $(STAMP) lint typecheck
	$(BIN)/coverage erase
	$(BIN)/coverage run -m pytest $(PYTEST_ARGS)
	$(BIN)/coverage report --include='coordinator/core/*,coordinator/protocol/*' --fail-under=95

lint: $(STAMP)
	$(BIN)/ruff check coordinator tests bench tools

typecheck: $(STAMP)
	$(BIN)/mypy --strict coordinator

unit: $(STAMP)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# The version-parametrised compat tests against every pinned vLLM release (each
# wheel fetched on first use); `make test` runs 0.29.0 and 0.33.0 only.
compat-matrix: $(STAMP)
	$(BIN)/python -m tools.vllm_wheel fetch --version all
	DP_VLLM_VERSIONS=all $(BIN)/pytest tests/compat/test_vllm_versions.py \
		tests/compat/test_dropin_versions.py $(PYTEST_ARGS)

# Multi-host tests in network namespaces (root, iproute2); `make test` runs them
# too, but skips them where namespaces cannot be built. Here that is a failure.
netns-test: $(STAMP)
	DPC_NETNS_REQUIRED=1 $(BIN)/pytest tests/netns $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench --peer vllm $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m bench --quick $(ARGS)

fuzz: $(STAMP)
	$(BIN)/python -m tools.fuzz --seconds 600 $(ARGS)

chaos: $(STAMP)
	$(BIN)/python -m tools.chaos --seconds 600 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage .hypothesis
