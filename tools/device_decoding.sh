#!/usr/bin/env bash
# Issue 39 on the device, one call: STAGES among
#   tests   the decoding GPU tests (sampler kernels, penalty state, restrictions / plugins, structured, spec)
#   sample  benchmarks/engine/bench_sampling_settings.py (every sampling setting vs all-greedy, alternated)
#   struct  benchmarks/engine/bench_structured.py (64 JSON-schema requests vs unconstrained)
#   bitmask benchmarks/bench_token_bitmask.py (lz.apply_token_bitmask's kernels at the engine's step shapes)
#   spec    benchmarks/engine/bench_spec_decode.py (batch 1 / 8 / 32; ngram, draft, layer skip)
#   spec-c  the same with constructed weights (spec_constructed.py: a known greedy walk, drafts agreeing on
#           $SPEC_AGREE = 0.92 of tokens, about 0.8 acceptance at k = 4): plain, ngram, draft, layer skip
#   spec-t  the constructed engines (plain, layer skip, draft) at batch 1 with --timeline: torch.profiler GPU
#           timelines of a 64-token generate (idle gaps per verification round) into spec_timeline/
#   spec-a  the constructed draft and layer-skip engines at batch 1 / 8 / 32 with the next round's first draft
#           step launched ahead and not (--ahead-ab, alternated in one engine), plus the batch-1 timelines,
#           into spec_ahead/
#   prof    py-spy (raw collapsed stacks, 200 Hz, idle not sampled) of one structured run (--repeats 1) and of
#           the constructed layer-skip run at batch 1: where the host time of a step / a round goes
# Results under $OUT, packed into $OUT/decoding.tgz (a call brings back at most 8 files).
# Usage: OUT=dir tools/device_decoding.sh STAGE [STAGE ...]
set -uo pipefail
# NVLink multicast off in every process, on every machine kind (harmless on one GPU; it can take a shared
# host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# one folder at a time: a wheel in two folders (attrs) in one command is a resolution conflict, which installs nothing
for w in .whl .whl_srv .whl_dec; do
  [ -d $w ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w/*.whl 2>&1 | grep -v "already exists" | tail -2
done
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks TRITON_CACHE_DIR=$PWD/.fi_ws/triton
D="$OUT/decoding"; mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$D/gpu.txt" 2>&1; lscpu | grep -i "model name\|flags" > "$D/cpu.txt"
for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  case $stage in
    tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s \
        tests/gpu/test_gpu_sample_reject.py tests/engine/gpu/test_penalties_gpu.py tests/engine/decoding/test_decoding_gpu.py \
        tests/engine/structured/test_structured_gpu.py tests/gpu/test_gpu_token_bitmask.py \
        tests/engine/decoding/test_beam_fork_gpu.py ${SPEC_TESTS:-} 2>&1 | tee "$D/tests.txt" | tail -25 ;;
    sample) timeout ${SAMPLE_TIMEOUT:-480} python3 benchmarks/engine/bench_sampling_settings.py --out "$D/sampling" ${SAMPLE_ARGS:-} \
        2>&1 | tee "$D/sampling.log" | tail -25 ;;
    struct) timeout ${STRUCT_TIMEOUT:-240} python3 benchmarks/engine/bench_structured.py --out "$D/structured" 2>&1 \
        | tee "$D/structured.log" | tail -20 ;;
    bitmask) timeout 150 python3 benchmarks/bench_token_bitmask.py --out "$D/bitmask.md" 2>&1 | tail -20 ;;
    spec) timeout ${SPEC_TIMEOUT:-300} python3 benchmarks/engine/bench_spec_decode.py --out "$D/spec" ${SPEC_ARGS:-} 2>&1 \
        | tee "$D/spec.log" | tail -25 ;;
    spec-c) timeout ${SPEC_TIMEOUT:-300} python3 benchmarks/engine/bench_spec_decode.py --out "$D/spec_constructed" \
        --constructed ${SPEC_AGREE:-0.92} --configs ngram,draft,layer_skip 2>&1 | tee "$D/spec_constructed.log" | tail -25 ;;
    spec-t) timeout ${SPEC_TIMEOUT:-300} python3 benchmarks/engine/bench_spec_decode.py --out "$D/spec_timeline" \
        --constructed ${SPEC_AGREE:-0.92} --configs layer_skip,draft --batches 1 --max-tokens 128 --timeline 2>&1 \
        | tail -8 ;;
    spec-a) timeout ${SPEC_TIMEOUT:-420} python3 benchmarks/engine/bench_spec_decode.py --out "$D/spec_ahead" \
        --constructed ${SPEC_AGREE:-0.92} --configs draft,layer_skip --batches 1,8,32 --ahead-ab --timeline 2>&1 \
        | tail -16 ;;
    prof) SPY="py-spy record -r 200 -f raw --nonblocking"; export PATH=/tmp/site/bin:$PATH
        timeout ${STRUCT_TIMEOUT:-240} $SPY -o "$D/struct.raw" -- python3 benchmarks/engine/bench_structured.py \
            --repeats 1 --out "$D/structured_prof" 2>&1 | tail -6
        timeout ${SPEC_TIMEOUT:-300} $SPY -o "$D/spec_layer_skip.raw" -- python3 benchmarks/engine/bench_spec_decode.py \
            --out "$D/spec_prof" --constructed ${SPEC_AGREE:-0.92} --configs layer_skip --batches 1 2>&1 | tail -6 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
cd "$OUT" && tar czf decoding.tgz decoding && rm -rf decoding
