# LayerZero: two commands from nothing (only Python 3.10+ needed).
#   make demo   - layerzero doctor, then tiny real Transformers models stock vs LayerZero (parity table)
#   make test   - the test suite (what .ci/run calls)
# Both create/reuse a local venv in .venv and install what they need. torch is pinned to the CPU build
# available on this machine's pip path (an unpinned torch would pull several GB of CUDA wheels).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.layerzero-installed

.PHONY: demo test install bench fuzz lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/layerzero doctor
	$(VENV)/bin/layerzero demo

test: $(STAMP)
	$(PY) -m pytest -q
	$(PY) -O -m pytest -q -p no:cacheprovider -m "not stress"  # validation must not rely on assert
	$(PY) fuzz/fuzz_policy.py --runs 300
	$(PY) fuzz/fuzz_validators.py --runs 300

bench: $(STAMP)
	$(PY) benchmarks/bench_dispatch.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks fuzz

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
