#!/usr/bin/env bash
# `make test` (what .ci/run calls): the whole suite, then every test of validation and the engine again under
# `python -O`, then the kernel-correctness tests under two forced CPU ISAs, then the fuzzers' bounded runs.
#
# Why the extra passes: validation must not rely on `assert` (-O strips it), and torch's CPU kernels are dispatched
# per ISA (AVX-512, AVX2, scalar "default") and differ in rounding and NaN handling while CI hosts differ (AVX2-only
# vs AVX-512): a test that holds for one build's behaviour only must fail on every host, not only on some. torch reads
# ATEN_CPU_CAPABILITY at start-up and honours it only for an ISA the CPU has. The ISA subset is tests/correctness
# without the Triton-interpreter files (`*_interpret.py`: their kernels run in Triton's numpy interpreter, not in
# ATen's ISA-dispatched code, and they are the slowest files: ~3 min of each pass before 2026-11-27).
#
# Two streams when the machine has >= 2 cores (CI machines have 2): the main run (all but the Triton-interpreter
# files) in the foreground; the interpreter files, the -O and ISA passes beside it (every pass is single-threaded: conftest sets one torch thread), their output printed after it.
# Measured on the 2-core AVX2 CI machine (AMD EPYC), 2026-11-27: one after another 27.5 min in all (main 12.5 min,
# -O 4.5, ISA 5.1 + 4.2 with the interpreter files, venv and fuzzers the rest); see the closing note of that
# session for the two-stream figure. SERIAL=1 runs everything one after another.
# Usage: tools/run_tests.sh [PYTHON]   (default .venv/bin/python)
set -uo pipefail
PY=${1:-.venv/bin/python}
# The forced ISAs: those below this CPU's own (the main run already dispatches as this CPU does): on an AVX2-only
# host `default`, on an AVX-512 host `avx2 default`. ISA_CAPABILITIES overrides.
native=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null || echo DEFAULT)
case $native in
  AVX512*) lesser="avx2 default" ;;
  AVX2|SVE*|ZVECTOR*) lesser="default" ;;
  *) lesser="" ;;
esac
ISA_CAPABILITIES=${ISA_CAPABILITIES-$lesser}

side_passes() {
  echo "=== the Triton-interpreter tests (tests/correctness/*_interpret.py; left out of the main run to balance the streams)"
  "$PY" -m pytest -q -p no:cacheprovider tests/correctness/*_interpret.py || return 1
  echo "=== this CPU dispatches as $native; the kernel-correctness tests run again under: ${ISA_CAPABILITIES:-none}"
  echo "=== python -O: every test of validation and the engine (not tests/correctness, not stress)"
  "$PY" -O -m pytest -q -p no:cacheprovider -m "not stress" tests --ignore=tests/correctness || return 1
  for isa in $ISA_CAPABILITIES; do
    echo "=== kernel-correctness tests with ATEN_CPU_CAPABILITY=$isa"
    ATEN_CPU_CAPABILITY=$isa "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/correctness \
      --ignore-glob='*_interpret.py' || return 1
  done
}

cores=$(nproc 2>/dev/null || echo 1)
if [ "${SERIAL:-}" != 1 ] && [ "$cores" -ge 2 ]; then
  log=$(mktemp "${TMPDIR:-/tmp}/layerzero-side-passes.XXXXXX")
  echo "=== the -O and forced-ISA passes run beside the main run ($cores cores); their output follows it"
  side_passes >"$log" 2>&1 &
  side=$!
  "$PY" -m pytest -q --ignore-glob='*_interpret.py'
  main_rc=$?
  wait "$side"
  side_rc=$?
  cat "$log"
  rm -f "$log"
else
  "$PY" -m pytest -q --ignore-glob='*_interpret.py'
  main_rc=$?
  side_passes
  side_rc=$?
fi
"$PY" fuzz/fuzz_policy.py --runs 300 && "$PY" fuzz/fuzz_validators.py --runs 300
fuzz_rc=$?
echo "=== main run rc=$main_rc, -O / ISA passes rc=$side_rc, fuzzers rc=$fuzz_rc"
[ "$main_rc" = 0 ] && [ "$side_rc" = 0 ] && [ "$fuzz_rc" = 0 ]
