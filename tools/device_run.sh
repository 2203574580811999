#!/usr/bin/env bash
# One device call: install the carried wheels (.whl/, see ../shared/tools/gpu-wheels.sh) into /tmp/site, then run
# the named stages; everything lands under $OUT. Usage: tools/device_run.sh STAGE [STAGE ...]
#   gpu-new   pytest of the GPU files named in $GPU_FILES (default: the Triton and FlashInfer files)
#   gpu-all   pytest -m gpu tests (all GPU tests)
#   dispatch  benchmarks/bench_dispatch.py --device cuda
#   norms     benchmarks/bench_norm_rope.py --device cuda (rms_norm / rope / sampling kernels through lz.tune)
#   sweep     benchmarks/sweep.py (args in $SWEEP_ARGS)
#   sdpa-fill fill the sdpa_kernel column of the sweep CSV at $FILL_CSV (a run made before it was filled)
#   paged-tune benchmarks/tune_paged_decode.py (triton.paged_decode launch-config search; args in $TUNE_ARGS)
#   fi-export pack the FlashInfer modules (carried + built in this call) into $OUT/fi_aot.txz (carry it back as
#             .fi_aot/fi_aot.txz: xz shrinks them ~12x; at most 8 files come back from a call)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
# FlashInfer JIT modules built by an earlier call (stage fi-export, kept locally in the ignored .fi_aot/ and carried):
# FlashInfer loads <package>/data/aot/<name>/<name>.so instead of compiling (~6 s to minutes per kernel).
AOT=/tmp/site/flashinfer/data/aot
if [ -f .fi_aot/fi_aot.txz ] && [ -d /tmp/site/flashinfer ]; then mkdir -p $AOT && tar xJf .fi_aot/fi_aot.txz -C $AOT && echo "flashinfer AOT modules: $(ls $AOT | wc -l)"; fi
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n ${WORKERS:-6}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    gpu-new) timeout ${GPU_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs --durations=15 $XDIST ${GPU_K:+-k "$GPU_K"} ${GPU_FILES:-tests/gpu/test_gpu_triton.py tests/gpu/test_gpu_triton_paged.py} 2>&1 | tee "$OUT/gpu-new.txt" | tail -60 ;;
    gpu-all) timeout ${GPU_TIMEOUT:-470} python3 -m pytest -q -p no:cacheprovider -m gpu -rs --durations=25 $XDIST ${GPU_ARGS:-} tests 2>&1 | tee "$OUT/gpu-all.txt" | tail -80 ;;
    norms) timeout 150 python3 benchmarks/bench_norm_rope.py --device cuda --out "$OUT/norm_rope.md" 2>&1 | tail -5 ;;
    dispatch) python3 benchmarks/bench_dispatch.py --device cuda 2>&1 | tee "$OUT/dispatch.txt" | tail -30 ;;
    sdpa-fill) python3 benchmarks/sweep.py --device cuda --fill-sdpa-choice "$FILL_CSV" --out "$OUT/filled" 2>&1 | tail -3 ;;
    paged-tune) python3 benchmarks/tune_paged_decode.py --out "$OUT/paged_tune" ${TUNE_ARGS:-} 2>&1 | tail -40 ;;
    sweep) python3 benchmarks/sweep.py --device cuda --out "$OUT/sweep" ${SWEEP_ARGS:-} 2>&1 | tail -120 ;;
    fi-export) mkdir -p /tmp/fi_export && cp -r $AOT/. /tmp/fi_export/ 2>/dev/null
      find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' -path '*cached_ops*' | while read -r so; do
        n=$(basename "$so" .so); mkdir -p "/tmp/fi_export/$n"; cp "$so" "/tmp/fi_export/$n/"; done
      echo "modules: $(ls /tmp/fi_export | wc -l)"; XZ_OPT=-T0 tar cJf "$OUT/fi_aot.txz" -C /tmp/fi_export . && ls -la "$OUT/fi_aot.txz" ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
