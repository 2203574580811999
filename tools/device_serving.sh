#!/usr/bin/env bash
# Issue 37, the server's time to first token at 1 req/s against offline, split into its parts, on the device.
# Usage: OUT=dir tools/device_serving.sh [STAGE ...]   (carry .whl_srv; build it with tools/device_wheels.sh)
#   ttft   benchmarks/serving/ttft_sequential.py on the Qwen3-0.6B-shaped checkpoint (bf16, defaults), unique
#          160-token prompts, max_tokens=1: offline (LLM.generate) 0, 50 and 1,000 ms apart, then
#          `layerzero serve` with its log 50 and 1,000 ms apart (63 requests; 23 at 1,000 ms); the server's
#          ttft_breakdown_ms medians beside the client's TTFT, into $OUT/ttft/
#   idle   offline, unique prompts 200 ms apart, the gap asleep then busy (CPU idle states vs the GPU's)
#   prof   py-spy (--idle) of offline and of the server (both processes), unique prompts 50 ms apart, into
#          $OUT/prof.tgz (raw collapsed stacks: the core's step set against LLM.generate's)
#   rate1  serve_and_bench.py --scale full --rates 1 --num-prompts 64 (the target's own measurement; server.log
#          holds every request's ttft_breakdown_ms) into $OUT/rate1/
#   rate1ab  rate1 twice, the engine core's idle polling on (auto: 2 s on CUDA) then off (--idle-poll-s 0),
#          into $OUT/rate1_auto/ and $OUT/rate1_poll0/, beside offline back to back ($OUT/ttft/offline_gap0.json)
#   pack   tar $OUT/ttft and $OUT/rate1 into $OUT/serving.tgz (a call brings back at most 8 files)
set -uo pipefail
# NVLink multicast off in every process, on every machine kind (harmless on one GPU; it can take a shared
# host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_srv/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.fi_ws/triton}
MODEL=$(python3 -c "import torch; from layerzero.engine.tools.bench import default_checkpoint as d; print(d('full', torch.bfloat16))")
TS=benchmarks/serving/ttft_sequential.py
STAGES=("$@"); [ ${#STAGES[@]} -gt 0 ] || STAGES=(ttft rate1 pack)
rc=0
for stage in "${STAGES[@]}"; do
  case $stage in
    ttft)
      mkdir -p "$OUT/ttft"
      # offline: unique prompts with 0, 50 and 1,000 ms between requests (an idle engine starts cooler), shared
      for G in 0 50 1000; do
        N=63; [ $G = 1000 ] && N=23
        python3 $TS --offline "$MODEL" --device cuda --requests $N --prompt-len 160 --prompts unique --gap-ms $G \
          > "$OUT/ttft/offline_unique_gap$G.json" 2> "$OUT/ttft/offline_unique_gap$G.log" || rc=1
        echo "offline unique gap $G: $(tail -1 "$OUT/ttft/offline_unique_gap$G.json")"
      done
      python3 -m layerzero serve --model "$MODEL" --port 8011 > "$OUT/ttft/server.log" 2>&1 &
      SP=$!
      for _ in $(seq 1 300); do curl -sf 127.0.0.1:8011/health > /dev/null && break; kill -0 $SP || break; sleep 1; done
      for G in 50 1000; do
        N=63; [ $G = 1000 ] && N=23
        python3 $TS --port 8011 --requests $N --max-tokens 1 --prompt-len 160 --prompts unique --gap-ms $G \
          --server-log "$OUT/ttft/server.log" > "$OUT/ttft/server_unique_gap$G.json" || rc=1
        echo "server unique gap $G: $(tail -1 "$OUT/ttft/server_unique_gap$G.json")"
      done
      kill -INT $SP; wait $SP
      ;;
    idle)
      # the idle penalty: offline requests 200 ms apart, the gap asleep then spent busy on the CPU
      mkdir -p "$OUT/idle"
      for M in sleep spin; do
        python3 $TS --offline "$MODEL" --device cuda --requests 33 --prompt-len 160 --prompts unique --gap-ms 200 \
          --gap-mode $M > "$OUT/idle/offline_$M.json" 2> "$OUT/idle/offline_$M.log" || rc=1
        echo "offline gap 200 $M: $(tail -1 "$OUT/idle/offline_$M.json")"
      done
      ;;
    prof)
      # py-spy (--idle: waits too) of the offline engine and of the server's two processes, unique prompts 50 ms
      # apart, to set the core's step against LLM.generate's frame by frame (raw collapsed stacks)
      # its own target: pip --target skips a bin/ that exists already (the serve wheels made one)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyspy .whl/py_spy*.whl 2>&1 | tail -1
      SPY=/tmp/pyspy/bin/py-spy
      mkdir -p "$OUT/prof"
      $SPY record --idle --nonblocking -r 1000 -f raw -o "$OUT/prof/offline.raw" -- \
        python3 $TS --offline "$MODEL" --device cuda --requests 43 --prompt-len 160 --prompts unique \
        > "$OUT/prof/offline.json" 2> "$OUT/prof/offline.log" || rc=1
      echo "offline: $(tail -1 "$OUT/prof/offline.json")"
      $SPY record --idle --nonblocking --subprocesses -r 1000 -f raw -o "$OUT/prof/server.raw" -- \
        python3 -m layerzero serve --model "$MODEL" --port 8012 > "$OUT/prof/server.log" 2>&1 &
      SP=$!
      for _ in $(seq 1 300); do curl -sf 127.0.0.1:8012/health > /dev/null && break; kill -0 $SP || break; sleep 1; done
      python3 $TS --port 8012 --requests 43 --max-tokens 1 --prompt-len 160 --prompts unique \
        --server-log "$OUT/prof/server.log" > "$OUT/prof/server.json" || rc=1
      echo "server: $(tail -1 "$OUT/prof/server.json")"
      pkill -INT -f "^python3 -m layerzero serve --model $MODEL --port 8012"; wait $SP
      (cd "$OUT" && tar czf prof.tgz prof && rm -rf prof)
      ;;
    rate1)
      python3 benchmarks/serving/serve_and_bench.py --scale full --rates 1 --num-prompts 64 --out "$OUT/rate1" \
        > "$OUT/rate1.log" 2>&1 || rc=1
      tail -15 "$OUT/rate1.log"
      ;;
    rate1ab)
      mkdir -p "$OUT/ttft"
      python3 $TS --offline "$MODEL" --device cuda --requests 63 --prompt-len 160 --prompts unique --gap-ms 0 \
        > "$OUT/ttft/offline_gap0.json" 2> "$OUT/ttft/offline_gap0.log" || rc=1
      echo "offline unique gap 0: $(tail -1 "$OUT/ttft/offline_gap0.json")"
      for V in auto poll0; do
        EXTRA=(); [ $V = poll0 ] && EXTRA=(-- --idle-poll-s 0)
        python3 benchmarks/serving/serve_and_bench.py --scale full --rates 1 --num-prompts 64 \
          --out "$OUT/rate1_$V" "${EXTRA[@]}" > "$OUT/rate1_$V.log" 2>&1 || rc=1
        echo "rate1 $V:"; tail -6 "$OUT/rate1_$V.log"
      done
      ;;
    pack) (cd "$OUT" && tar czf serving.tgz ttft idle rate1* 2>/dev/null && rm -rf ttft idle rate1*) ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
