# LayerZero: two commands from nothing (only Python 3.10+ needed).
#   make demo   - layerzero doctor, tiny real Transformers models stock vs LayerZero (parity table), then the
#                 serving engine generating from a small checkpoint built here (tokenizer trained locally),
#                 then `layerzero serve` on it for a moment, talked to with the official openai client
#   make test   - the test suite (what .ci/run calls), then (on AVX-512 hosts) the kernel-correctness tests as AVX2
# Both create/reuse a local venv in .venv and install what they need. torch is pinned to the CPU build
# available on this machine's pip path (an unpinned torch would pull several GB of CUDA wheels).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.layerzero-installed

.PHONY: demo test install bench bench-serve fuzz lint clean

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
	$(PY) -m layerzero.engine.tools.demo
	$(PY) -m layerzero.engine.tools.demo_serve

# `make test`: the suite, then its validation tests again under python -O, then on AVX-512 hosts tests/correctness
# (without the Triton-interpreter tests) as an AVX2-only CI host dispatches (ATEN_CPU_CAPABILITY=avx2), then the
# fuzzers; tools/run_tests.sh says why
# and runs the passes in two balanced streams on machines with >= 2 cores (SERIAL=1: one after another).
test: $(STAMP)
	tools/run_tests.sh $(PY)

bench: $(STAMP)
	$(PY) benchmarks/bench_dispatch.py

# `make bench-serve`: `layerzero serve` on the CPU benchmark checkpoint, `layerzero bench-serve` at rates 1, 4, 16,
# 64 and inf against it, and LLM.generate on the same requests (benchmarks/serving/README.md; BENCH_SERVE_OUT=DIR)
BENCH_SERVE_OUT ?= /tmp/layerzero-bench-serve-cpu
bench-serve: $(STAMP)
	$(PY) benchmarks/serving/serve_and_bench.py --scale cpu --offline --out $(BENCH_SERVE_OUT)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check src tests benchmarks fuzz tools
	$(VENV)/bin/ruff check src tests benchmarks fuzz tools

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
