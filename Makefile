# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned and installed first so that the project's `torch>=2.6` is already met by the local CPU wheel.
setup: $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/python examples/demo_gpt2.py

# two workers, one test file each at a time (a file's module fixtures stay in one process): most files are one
# process on one core, so two of them fill the 2-core CI host; a gloo test's ranks share the cores with the other.
# xdist hands the files out by their count of tests, most first (its default reorder). Measured against handing
# the seven longest files out first (--no-loadscope-reorder and that order): 1073 s against 1224 s for the whole
# suite on this 2-core host; the long files are the multi-rank ones, and run together they oversubscribe the cores.
test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -ra -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
