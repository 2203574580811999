#!/usr/bin/env bash
# `make test` (what .ci/run calls): the whole suite; its validation tests again under `python -O`; the
# kernel-correctness tests again under each CPU ISA below this CPU's own; then the fuzzers' bounded runs.
#
# Why the extra passes: validation must not rely on `assert` (-O strips it), and torch's CPU kernels are dispatched
# per ISA (AVX-512, AVX2, scalar "default") and differ in rounding and NaN handling while CI hosts differ (AVX2-only
# vs AVX-512): a test that holds for one build's behaviour only must fail on every host, not only on some. torch
# reads ATEN_CPU_CAPABILITY at start-up and honours it only for an ISA the CPU has. An AVX-512 host therefore runs
# tests/correctness again with ATEN_CPU_CAPABILITY=avx2 (what an AVX2-only CI host dispatches as); an AVX2 host
# runs no ISA pass: it is the lesser CI host itself, and no CI host dispatches as `default` (its pass, 3.7 min of
# the side stream, went on 2026-11-30 for CI's 20-minute budget; ISA_CAPABILITIES=default or "avx2 default" runs
# such passes by hand). The ISA pass leaves out the tests that run a Triton kernel in Triton's interpreter (the
# `*_interpret.py` files and every test with a `needs_interpreter` mark: tests/conftest.py marks them
# `triton_interpreter`; their kernels run in numpy, not in ATen's ISA-dispatched code) and the sweep-coverage
# meta-test.
#
# Two streams when the machine has >= 2 cores (CI machines have 2; every pass is single-threaded: conftest sets one
# torch thread): the foreground runs the main run; the other stream one pytest run of the multi-process tests, the
# server's tests and (without an ISA pass) the stress tests, then the interpreter tests marked `side_stream` (the
# `*_interpret.py` files and the heaviest interpreter tests of tests/conftest.py's SIDE_STREAM_FILES), the -O pass
# and the ISA pass if any; the side stream's output is printed after the foreground's. Measured lengths (minutes,
# fresh-clone rehearsals of .ci/run on this 2-core VM dispatching as AVX2, 2026-11-30, both streams at once): main
# run 14.7 (5,075 tests); beside it the multi-process, server and stress run 7.9, interpreter 4.8, -O 1.4:
# `.ci/run` 18.2 with its install. (A rehearsal an hour earlier, before that run was merged, on a slower phase of
# the VM: main 16.4; multi-process 4.4, server 3.6, interpreter 5.2, -O 1.7, stress 1.3; 17.6 + a 3.3-minute
# install.) CI had measured 22.6 min on 2026-11-30 before these changes, with the `default` ISA pass (3.7 min).
# (Until 2026-11-30 the server's tests ran in the foreground and an AVX-512 host ran both ISA passes: 27.8 min in
# a slow phase. Until 2026-11-29 the -O pass and some interpreter files ran in the foreground, while the ISA
# passes still ran the interpreter tests.) SERIAL=1 runs everything one after another. The -O pass runs the
# validation tests of tests/unit and tests/engine/unit (see VALIDATION_K below); not the engine's end-to-end
# correctness, decoding or server tests (the suite outgrew CI's 20 minutes; the server validates with pydantic,
# not assert).
# Usage: tools/run_tests.sh [PYTHON]   (default .venv/bin/python)
set -uo pipefail
PY=${1:-.venv/bin/python}
native=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null || echo DEFAULT)
case $native in
  AVX512*) lesser="avx2" ;;  # what an AVX2-only CI host dispatches as
  *) lesser="" ;;  # an AVX2 host is the lesser CI host itself: no CI host dispatches as `default`
esac
ISA_CAPABILITIES=${ISA_CAPABILITIES-$lesser}
# The stress tests (threads and soaks; no ATen-ISA-dependent numerics) run in the side stream when it has no
# ISA pass (an AVX2 host), in the main run otherwise: ~1 min that balances the two streams.
if [ -z "$ISA_CAPABILITIES" ]; then stress_side=1; else stress_side=""; fi
interpreter_tests() {
  echo "=== the Triton-interpreter tests marked side_stream (tests/correctness/*_interpret.py and tests/conftest.py's SIDE_STREAM_FILES)"
  "$PY" -m pytest -q -p no:cacheprovider -m side_stream tests/correctness
}

# One pytest run for the multi-process tests, the server's tests and (without an ISA pass) the stress tests: one
# start-up (torch, collection) instead of three
multi_process_tests() {
  echo "=== the multi-process tests (tests/distributed, tests/engine/parallel: Gloo groups, engine ranks and" \
    "replicas), the server's tests (tests/engine/serving: live servers on 127.0.0.1, real clients)" \
    "${stress_side:+and the stress tests (tests/stress, tests/engine/stress: threads, soaks; bounded)}"
  "$PY" -m pytest -q -p no:cacheprovider tests/distributed tests/engine/parallel tests/engine/serving \
    ${stress_side:+tests/stress tests/engine/stress}
}

# The -O pass: the tests of tests/unit and tests/engine/unit whose names say they check input (bad / invalid /
# error / reject / refuse / validate / check / raise / typed: about half). -O strips only `assert` statements and
# `if __debug__` blocks, and tests/unit/test_no_assert_in_package.py fails on either anywhere in the package, so
# this pass is the second line (it ran the whole of tests/unit, tests/engine/unit and tests/property until
# 2026-11-29: 3.6 min; tests/property's validation half, 14 s, left it on 2026-11-30 for CI's budget).
VALIDATION_K="bad or invalid or error or reject or refus or validat or check or raise or typed"
optimized_tests() {
  echo "=== python -O: the validation tests (tests/unit, tests/engine/unit: -k '$VALIDATION_K')"
  "$PY" -O -m pytest -q -p no:cacheprovider -m "not stress" -k "$VALIDATION_K" tests/unit tests/engine/unit
}

main_stream() {
  "$PY" -m pytest -q -m "not side_stream" --ignore-glob='*_interpret.py' --ignore=tests/distributed \
    --ignore=tests/engine/parallel --ignore=tests/engine/serving \
    ${stress_side:+--ignore=tests/stress --ignore=tests/engine/stress}
}

side_stream() {
  multi_process_tests || return 1
  interpreter_tests || return 1
  optimized_tests || return 1
  echo "=== this CPU dispatches as $native; the kernel-correctness tests run again under: ${ISA_CAPABILITIES:-none}"
  for isa in $ISA_CAPABILITIES; do
    echo "=== kernel-correctness tests with ATEN_CPU_CAPABILITY=$isa"
    ATEN_CPU_CAPABILITY=$isa "$PY" -m pytest -q -p no:cacheprovider -m "not gpu and not triton_interpreter" \
      tests/correctness --ignore-glob='*_interpret.py' --ignore=tests/correctness/test_sweep_coverage.py || return 1
  done
}

cores=$(nproc 2>/dev/null || echo 1)
if [ "${SERIAL:-}" != 1 ] && [ "$cores" -ge 2 ]; then
  log=$(mktemp "${TMPDIR:-/tmp}/layerzero-side-stream.XXXXXX")
  echo "=== two streams ($cores cores): the multi-process, server, interpreter, -O and forced-ISA passes run beside the main" \
    "run; their output follows it"
  side_stream >"$log" 2>&1 &
  side=$!
  main_stream
  main_rc=$?
  wait "$side"
  side_rc=$?
  cat "$log"
  rm -f "$log"
else
  main_stream
  main_rc=$?
  side_stream
  side_rc=$?
fi
"$PY" fuzz/fuzz_policy.py --runs 300 && "$PY" fuzz/fuzz_validators.py --runs 300
fuzz_rc=$?
echo "=== main stream rc=$main_rc, -O / ISA stream rc=$side_rc, fuzzers rc=$fuzz_rc"
[ "$main_rc" = 0 ] && [ "$side_rc" = 0 ] && [ "$fuzz_rc" = 0 ]
