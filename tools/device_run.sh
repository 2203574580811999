#!/usr/bin/env bash
# One device call: install the carried wheels (.whl/, see ../shared/tools/gpu-wheels.sh) into /tmp/site, then run
# the named stages; everything lands under $OUT. Usage: tools/device_run.sh STAGE [STAGE ...]
#   gpu-new   pytest of the GPU files named in $GPU_FILES (default: the Triton and FlashInfer files)
#   gpu-all   pytest -m gpu tests (all GPU tests)
#   dispatch  benchmarks/bench_dispatch.py --device cuda
#   sweep     benchmarks/sweep.py (args in $SWEEP_ARGS)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    gpu-new) python3 -m pytest -q -p no:cacheprovider -rs --durations=15 ${GPU_FILES:-tests/gpu/test_gpu_triton.py tests/gpu/test_gpu_triton_paged.py} 2>&1 | tee "$OUT/gpu-new.txt" | tail -60 ;;
    gpu-all) python3 -m pytest -q -p no:cacheprovider -m gpu -rs --durations=20 ${GPU_ARGS:-} tests 2>&1 | tee "$OUT/gpu-all.txt" | tail -80 ;;
    dispatch) python3 benchmarks/bench_dispatch.py --device cuda 2>&1 | tee "$OUT/dispatch.txt" | tail -30 ;;
    sweep) python3 benchmarks/sweep.py --device cuda --out "$OUT/sweep" ${SWEEP_ARGS:-} 2>&1 | tail -120 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
