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
#   fi-build  tools/fi_prebuild.py: FlashInfer's decode / FA2 / FA3 prefill modules of $FI_DTYPES x $FI_DIMS in one ninja
#             run (every core busy; built one by one on first use they took 45-110 s each)
#   fi-export pack the FlashInfer modules (carried + built in this call) into $OUT/fi_aot.txz.NN, 15 MiB parts (carry
#             them back in .fi_aot/: xz shrinks them ~12x; at most 8 files of 16 MiB come back from a call)
#   ship      benchmarks/ship_timings.py $SHIP_ARGS --out $OUT/ship, its budget what is left of $CALL_BUDGET_S (packed
#             into $OUT/ship.tgz: a call brings back at most 8 files)
#   ship-merge merge the part files that `ship` calls of this (still warm) machine kept in .fi_ws/ship_parts into
#             $OUT/ship_merged (with $SHIP_MERGE_BASE, a whole earlier file, first) and install them into the checkout there (the `hidden` stage then uses them)
#   hidden    benchmarks/hidden_shapes.py $HIDDEN_ARGS --out $OUT/hidden, likewise (packed into $OUT/hidden.tgz)
#   engine-gpu pytest of the engine's GPU tests and the fused-MoE GPU tests (bf16, CUDA graphs vs eager)
#   bench-engine benchmarks/engine/bench_engine.py $BENCH_ARGS (nano-vllm workload, full scale) into $OUT/engine
#   bench-prefix `layerzero bench-engine --workload prefix $PREFIX_ARGS` into $OUT/engine
#   prefix-profile benchmarks/engine/prefix_profile.py $PROFILE_ARGS (shared-prefix step times and kernel table)
#   quant-ab  benchmarks/engine/bench_quantization.py on the Qwen3-0.6B shape in bf16, default kernels then the fused
#             triton.quantized_linear locked (into $OUT/quant_default.md, $OUT/quant_fused.md)
#   prefix-ab  the shared-prefix workload once per variant, one process each (bench_variant.py --workload prefix):
#             cache on; + cascade; + cascade + lpm; + lpm (into $OUT/prefix_ab.txt; the cache-off baseline: bench-prefix)
#   compiles  which kernels compile inside the shared-prefix run (cascade + lpm, bench_variant.py --count-compiles): once
#             with the benchmark's untimed warm run off, once with it (into $OUT/compiles.txt); first on a fresh machine
#   cascade-layer benchmarks/engine/cascade_layer.py at 16x16 and at 64x4 (interleaved rows), into $OUT/cascade_layer.txt
#   tune-cascade benchmarks/engine/tune_cascade_prefill.py $TUNE_ARGS into $OUT/tune_cascade.txt
#   bench-sample benchmarks/bench_sample.py (reference.sample vs triton.sample) into $OUT/sample.md
#   fused-merge benchmarks/bench_fused_merge.py in $FM_PROCS (3) processes one after another (the split merge fused
#             vs two kernels, in graphs and eager), into $OUT/fused_merge_N.md
#   launch    benchmarks/bench_launch.py (host cost of one eager paged-decode call: binder, launcher, pinned launch) into
#             $OUT/launch.md
#   batch1-ab benchmarks/engine/batch1_ab.py over $AB_VARIANTS (default base,packed,l2-prefetch: the variants the
#             2026-11-28 session wrote without a GPU) x $AB_ROUNDS, with the GPU timeline, into $OUT/ab/
#   fp8-gpu   tests/gpu/test_gpu_fp8_linear.py, then benchmarks/engine/bench_quantization.py (bf16 + int8 / int4 / fp8
#             / fp8_w8a8) into $OUT/fp8_gpu.txt, $OUT/quantization.md
#   ttft      benchmarks/engine/ttft_breakdown.py once per value of $TTFT_PIECEWISE (default "0 1024": eager prefill, then
#             piecewise graphs up to 1,024 tokens, the TTFT target's range), each a fresh process, into $OUT/ttft/ttft_piecewise<N>.md
#   piecewise-ab bench_engine.py (nano-vllm workload) once per value of $TTFT_PIECEWISE through
#             LAYERZERO_PIECEWISE_MAX_TOKENS, into $OUT/engine_pw<N>/
#   batch1    benchmarks/engine/batch1_breakdown.py (one request's decode step: whole step, graph replay, host
#             profile) into $OUT/batch1/
#   cold-start benchmarks/engine/cold_start.py $COLD_ARGS (bench-engine's workload twice per fresh process, warm-up on / off,
#             empty then populated Triton cache under /tmp/cold_caches; its own TRITON_CACHE_DIR per cell) into $OUT/cold_start.md
#   bench-isolation benchmarks/bench_isolation.py --device cuda (isolated-kernel call cost over CUDA IPC) into $OUT
#   (nvidia-h200-x2; NVLink multicast off; each part fits one 10-minute call, carry .whl (+ .whl_srv for dp);
#    results under $OUT/parallel_x2/, packed into $OUT/parallel_x2.tgz by the last stage of the call: x2-pack)
#   x2-tests  the two-GPU tests (engine TP / EP vs one GPU, graphs; collectives; selection sync), ~4 min
#   x2-micro  bench_collectives.py, bench_weight_load.py, tp_batch1.py at TP 2 then 1 (Qwen3-8B shape), ~4 min
#   x2-8b     bench-engine on the Qwen3-8B shape at TP 2 then 1 (load_format dummy), ~4 min
#   x2-push   symm_mem.one_shot_push: the collectives GPU test, the engine's TP 2 tests (Qwen3, graphs, pieces) with
#             it preferred, bench_collectives.py, tp_batch1.py at TP 2 with it preferred (into $P/push), ~6 min
#   x2-moe    bench-engine on Qwen3-30B-A3B at TP 2 + EP, TP 2, TP 1 ($MOE_RUNS to choose; 200 s each), ~8 min
#   x2-dp     serve_and_bench.py, Qwen3-0.6B shape, rate inf, 1,000 requests from $DP_CLIENTS (4) client processes:
#             --data-parallel-size 2 then 1
#   x2-dpc    benchmarks/parallel/dp_ceiling.py $DPC_ARGS: dp1, dp2, dp2 with two clients, two separate servers
#   x2-pack   tar $OUT/parallel_x2 into $OUT/parallel_x2.tgz (a call brings back at most 8 files)
# JIT caches (FlashInfer workspace, Triton) live in the ignored .fi_ws/ of the checkout there: a device machine that is
# still warm keeps them between calls.
set -uo pipefail
# NVLink multicast off in every process, on every machine kind (harmless on one GPU; it can take a shared
# host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# SKIP_INSTALL=1: another device_run.sh of this call installed them already (two installs into one target race)
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.fi_ws} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.fi_ws/triton}
T0=$(date +%s)
left_min() { python3 -c "print(max(0.5, (${CALL_BUDGET_S:-560} - ($(date +%s) - $T0)) / 60 - 0.3))"; }
# FlashInfer JIT modules built by an earlier call (stage fi-export, kept locally in the ignored .fi_aot/ and carried):
# FlashInfer loads <package>/data/aot/<name>/<name>.so instead of compiling (~6 s to minutes per kernel).
AOT=/tmp/site/flashinfer/data/aot
if ls .fi_aot/fi_aot.txz* >/dev/null 2>&1 && [ -d /tmp/site/flashinfer ]; then mkdir -p $AOT && cat .fi_aot/fi_aot.txz* | tar xJf - -C $AOT && echo "flashinfer AOT modules: $(ls $AOT | wc -l)"; fi
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
    ttft) for pw in ${TTFT_PIECEWISE:-0 1024}; do timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/engine/ttft_breakdown.py --out "$OUT/ttft" --piecewise $pw 2>&1 | tail -9; done ;;
    piecewise-ab) for pw in ${TTFT_PIECEWISE:-0 1024}; do echo "piecewise_max_tokens $pw"; LAYERZERO_PIECEWISE_MAX_TOKENS=$pw timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/engine/bench_engine.py --hf-batch 0 --out "$OUT/engine_pw$pw" 2>&1 | tail -4; done ;;
    batch1) timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/engine/batch1_breakdown.py --out "$OUT/batch1" 2>&1 | tail -8 ;;
    batch1-ab) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/engine timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/engine/batch1_ab.py --out "$OUT/ab" --variants "${AB_VARIANTS:-base,packed,l2-prefetch}" --rounds "${AB_ROUNDS:-2}" 2>&1 | grep -o "^[a-z0-9-]*: step.*replay [0-9]* µs" ;;
    fp8-gpu) timeout ${GPU_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fp8_linear.py 2>&1 | tee "$OUT/fp8_gpu.txt" | tail -15
             timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/engine/bench_quantization.py --device cuda --dtype bfloat16 \
               --shape qwen3-0.6b --prompts 32 --tokens 128 --repeat 2 --out "$OUT/quantization.md" 2>&1 | tail -12 ;;
    launch) python3 benchmarks/bench_launch.py --out "$OUT/launch.md" 2>&1 | tail -25 ;;
    dispatch) python3 benchmarks/bench_dispatch.py --device cuda 2>&1 | tee "$OUT/dispatch.txt" | tail -30 ;;
    sdpa-fill) python3 benchmarks/sweep.py --device cuda --fill-sdpa-choice "$FILL_CSV" --out "$OUT/filled" 2>&1 | tail -3 ;;
    paged-tune) python3 benchmarks/tune_paged_decode.py --out "$OUT/paged_tune" ${TUNE_ARGS:-} 2>&1 | tail -40 ;;
    sweep) python3 benchmarks/sweep.py --device cuda --out "$OUT/sweep" ${SWEEP_ARGS:-} 2>&1 | tail -120 ;;
    fi-export) mkdir -p /tmp/fi_export && cp -r $AOT/. /tmp/fi_export/ 2>/dev/null
      find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' -path '*cached_ops*' | while read -r so; do
        n=$(basename "$so" .so); mkdir -p "/tmp/fi_export/$n"; cp "$so" "/tmp/fi_export/$n/"; done
      echo "modules: $(ls /tmp/fi_export | wc -l)"; du -sh /tmp/fi_export
      XZ_OPT=-T0 tar cJf - -C /tmp/fi_export . | split -b 15M -d - "$OUT/fi_aot.txz." && ls -la "$OUT"/fi_aot.txz.* ;;
    fi-build) timeout ${FI_BUILD_TIMEOUT:-480} python3 tools/fi_prebuild.py --dtypes ${FI_DTYPES:-bfloat16} --head-dims ${FI_DIMS:-64 128 256} 2>&1 | tail -5 ;;
    ship) python3 benchmarks/ship_timings.py --out "$OUT/ship" --max-minutes "$(left_min)" ${SHIP_ARGS:-} 2>&1 | tee "$OUT/ship.log" | tail -25
      mkdir -p .fi_ws/ship_parts && cp "$OUT"/ship/timings/*.json .fi_ws/ship_parts/ 2>/dev/null
      tar czf "$OUT/ship.tgz" -C "$OUT" ship && rm -rf "$OUT/ship" ;;  # one file: at most 8 come back from a call
    ship-merge) python3 benchmarks/ship_timings.py --merge ${SHIP_MERGE_BASE:-} .fi_ws/ship_parts/*.part*.json --out "$OUT/ship_merged" 2>&1 | tail -8 ;;
    hidden) python3 benchmarks/hidden_shapes.py --out "$OUT/hidden" --max-minutes "$(left_min)" ${HIDDEN_ARGS:-} 2>&1 | tee "$OUT/hidden.log" | tail -40
      tar czf "$OUT/hidden.tgz" -C "$OUT" hidden && rm -rf "$OUT/hidden" ;;
    engine-gpu) timeout ${GPU_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs --durations=15 tests/engine/gpu tests/gpu/test_gpu_fused_moe.py 2>&1 | tee "$OUT/engine-gpu.txt" | tail -40 ;;
    bench-engine) timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/engine/bench_engine.py --out "$OUT/engine" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-engine.log" | tail -20 ;;
    bench-prefix) timeout ${BENCH_TIMEOUT:-400} python3 -m layerzero bench-engine --workload prefix --repeats ${PREFIX_REPEATS:-3} ${PREFIX_ARGS:-} --out "$OUT/engine" 2>&1 | tail -5 ;;
    prefix-profile) timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/engine/prefix_profile.py --out "$OUT/prefix" ${PROFILE_ARGS:-} 2>&1 | tail -60 ;;
    quant-ab) for v in default fused; do
        lock=""; [ $v = fused ] && lock="--lock quantized_linear=triton.quantized_linear"
        timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/engine/bench_quantization.py --device cuda --dtype bfloat16 \
          --shape qwen3-0.6b --prompts 32 --tokens 128 --repeat 2 $lock --out "$OUT/quant_$v.md" 2>&1 | tail -8; done ;;
    prefix-ab) for v in "on|" "cascade|--opt cascade_attention=True" "cascade-lpm|--opt cascade_attention=True --opt scheduling_policy='lpm'" "lpm|--opt scheduling_policy='lpm'"; do
        timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/engine/bench_variant.py "${v%%|*}" --workload prefix ${v#*|} 2>&1 | tail -1; done | tee "$OUT/prefix_ab.txt" ;;
    compiles) for w in False True; do
        timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/engine/bench_variant.py "warm_run=$w" --workload prefix --count-compiles \
          --opt warm_run=$w --opt cascade_attention=True --opt scheduling_policy="'lpm'" 2>&1 | grep -E "generate of|shared prefix"; done | tee "$OUT/compiles.txt" ;;
    cascade-layer) for a in "" "--groups 64 --members 4" "--groups 64 --members 4 --interleave"; do
        timeout 150 python3 benchmarks/engine/cascade_layer.py $a 2>&1 | tail -8; done | tee "$OUT/cascade_layer.txt" ;;
    tune-cascade) timeout ${BENCH_TIMEOUT:-480} python3 benchmarks/engine/tune_cascade_prefill.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune_cascade.txt" | tail -40 ;;
    fused-merge) for i in $(seq 1 ${FM_PROCS:-3}); do timeout ${FM_TIMEOUT:-90} python3 benchmarks/bench_fused_merge.py \
        ${FM_ARGS:-} > "$OUT/fused_merge_$i.md" 2>&1; tail -12 "$OUT/fused_merge_$i.md"; done ;;
    cold-start) timeout ${BENCH_TIMEOUT:-580} python3 benchmarks/engine/cold_start.py --cache-root /tmp/cold_caches \
        --out "$OUT/cold_start.md" ${COLD_ARGS:-} 2>&1 | tee "$OUT/cold_start.log" | grep "^|" | tail -12; rm -rf /tmp/cold_caches ;;
    bench-isolation) timeout 200 python3 benchmarks/bench_isolation.py --device cuda --out "$OUT/isolation_cuda.md" 2>&1 | tail -12 ;;
    x2-*) P="$OUT/parallel_x2"; mkdir -p "$P"; python3 benchmarks/parallel/shapes.py --out /tmp/shapes > /dev/null
        x2_bench() {  # name tp [flags...]: one bench-engine run, its log and JSON under $P
          local name=$1 tp=$2; shift 2; local tag="${name}_tp${tp}${1:+_ep}"
          timeout ${BENCH_TIMEOUT:-200} python3 -m layerzero bench-engine --model /tmp/shapes/$name --load-format dummy \
              --tensor-parallel-size $tp "$@" --hf-batch 0 --out "$P/$tag" > "$P/$tag.log" 2>&1; echo "$tag: $(grep -E '^(engine|one request)' "$P/$tag.log" | tr '\n' ' ')"; }
        case $stage in
          x2-tests) timeout ${GPU_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -m gpu -rs --durations=10 \
              tests/engine/gpu/test_engine_tp_gpu.py tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_distributed.py 2>&1 | tee "$P/tests.txt" | tail -15 ;;
          x2-micro) timeout 120 python3 benchmarks/parallel/bench_collectives.py --world 2 --out "$P" 2>&1 | tail -20
              timeout 150 python3 benchmarks/parallel/bench_weight_load.py --tp 1 2 --out "$P" 2>&1 | tail -6
              for tp in 2 1; do timeout 200 python3 benchmarks/parallel/tp_batch1.py --model /tmp/shapes/qwen3-8b --tp $tp --out "$P" 2>&1 | grep "^- "; done ;;
          x2-8b) for tp in 2 1; do x2_bench qwen3-8b $tp; done ;;
          x2-push) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu/test_gpu_collectives.py 2>&1 | tee "$P/tests_collectives.txt" | tail -4
              LAYERZERO_PREFER=symm_mem.one_shot_push timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
                  tests/engine/gpu/test_engine_tp_gpu.py -k "qwen3 and not moe or graphs" 2>&1 | tee "$P/tests_engine_push.txt" | tail -4
              timeout 150 python3 benchmarks/parallel/bench_collectives.py --world 2 --out "$P" 2>&1 | tail -20
              LAYERZERO_PREFER=symm_mem.one_shot_push timeout 200 python3 benchmarks/parallel/tp_batch1.py \
                  --model /tmp/shapes/qwen3-8b --tp 2 --out "$P/push" 2>&1 | grep "^- " ;;
          x2-moe) IFS=';' read -ra runs <<< "${MOE_RUNS:-2 --enable-expert-parallel;2;1}"
              for run in "${runs[@]}"; do x2_bench qwen3-30b-a3b $run; done ;;
          x2-dp) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_srv/*.whl 2>&1 | tail -2
              for dp in 2 1; do timeout ${DP_TIMEOUT:-280} python3 benchmarks/serving/serve_and_bench.py --scale full \
                  --rates inf --num-prompts 1000 --client-processes ${DP_CLIENTS:-4} --out "$P/dp$dp" \
                  -- --data-parallel-size $dp 2>&1 | tail -4; done ;;
          x2-dpc) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_srv/*.whl 2>&1 | tail -2
              timeout ${DP_TIMEOUT:-500} python3 benchmarks/parallel/dp_ceiling.py --out "$P/dp_ceiling" \
                  ${DPC_ARGS:-} 2>&1 | tail -8 ;;
          x2-pack) tar czf "$OUT/parallel_x2.tgz" -C "$OUT" parallel_x2 && rm -rf "$P" ;;
          *) echo "unknown stage $stage"; rc=2 ;;
        esac ;;
    bench-sample) timeout 150 python3 benchmarks/bench_sample.py --out "$OUT/sample.md" 2>&1 | tail -12 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
