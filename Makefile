# The two commands of the README: `make run` starts the daemon, `make test` runs every check.
# Both create .venv and install the three packages (editable) on first use.

# The first Python >= 3.11 that really runs (a pyenv shim may exist for a missing version).
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.11; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The packages of every virtualenv here, run from its folder; each adds its kvd-client and mlx-lm.
PIP_INSTALL := bin/python -m pip install --quiet --disable-pip-version-check -e ./protocol -e ".[dev]"
# What depends on mlx-lm's version: the server, the ColdTier and the codecs of its cache classes.
MLX_LM_TESTS := tests/server tests/client/test_mlx_lm_cache.py tests/client/test_codecs.py

.PHONY: run test lint bench remote-demo clean

$(STAMP): pyproject.toml protocol/pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/$(PIP_INSTALL) -e "./client[mlx-lm]"
	touch $(STAMP)

# Another mlx-lm than .venv's, in a virtualenv of its own: make test-mlx-lm-0.32.0
# (.ci/mlx-lm-versions picks the versions).
.venv-mlx-lm-%/.installed: pyproject.toml protocol/pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(@D)
	$(@D)/$(PIP_INSTALL) -e ./client "mlx-lm==$*"
	touch $@

.PRECIOUS: .venv-mlx-lm-%/.installed

test-mlx-lm-%: .venv-mlx-lm-%/.installed
	.venv-mlx-lm-$*/bin/pytest -q $(MLX_LM_TESTS)

# kvd-vllm-mlx and a vllm-mlx release in a virtualenv of their own: make test-vllm-mlx-0.6.0
# (.ci/vllm-mlx picks the versions). vllm-mlx without its dependencies (off macOS they bring
# torch, through torchvision), then what its text server imports.
.venv-vllm-mlx-%/.installed: pyproject.toml protocol/pyproject.toml client/pyproject.toml \
		tests/kvd_vllm_mlx/requirements.txt
	$(PYTHON) -m venv $(@D)
	$(@D)/$(PIP_INSTALL) -e ./client -r tests/kvd_vllm_mlx/requirements.txt
	$(@D)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "vllm-mlx==$*"
	touch $@

.PRECIOUS: .venv-vllm-mlx-%/.installed

test-vllm-mlx-%: .venv-vllm-mlx-%/.installed
	.venv-vllm-mlx-$*/bin/pytest -q tests/kvd_vllm_mlx

run: $(STAMP)
	$(BIN)/kvd serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

bench: $(STAMP)
	@for b in bench/[!_]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# SeaweedFS on loopback and two daemons sharing it, until Ctrl-C (docs/remote.md, "On one machine").
remote-demo: $(STAMP)
	$(BIN)/python scripts/remote_demo.py

clean:
	rm -rf $(VENV) .venv-mlx-lm-* .venv-vllm-mlx-* .mypy_cache .pytest_cache .ruff_cache .hypothesis
