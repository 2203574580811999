#!/usr/bin/env bash
# Issue 37 (rate inf vs offline): profile `layerzero serve` (API process + engine core, py-spy --subprocesses,
# raw collapsed stacks) under bench-serve at $RATE req/s (default inf), on the device. Usage: OUT=dir
# [RATE=1] [HZ=200] tools/profile_serve.sh N  (rate 1 with N=64: where the server's ~8 ms over offline TTFT goes)
set -uo pipefail
# NVLink multicast off in every process, on every machine kind (harmless on one GPU; it can take a shared
# host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${1:-1000}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl_srv/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks TRITON_CACHE_DIR=$PWD/.fi_ws/triton PATH=/tmp/site/bin:$PATH
mkdir -p "$OUT/prof"
python3 benchmarks/serving/serve_and_bench.py --scale full --rates "${RATE:-inf}" --num-prompts "$N" --offline \
  --server-prefix "py-spy record --subprocesses --nonblocking -r ${HZ:-200} -f raw -o $OUT/prof/serve.raw --" \
  --out "$OUT/prof" > "$OUT/prof/run.log" 2>&1
echo "rc=$?"
tail -30 "$OUT/prof/run.log"
cd "$OUT" && tar czf prof.tgz prof && rm -rf prof
