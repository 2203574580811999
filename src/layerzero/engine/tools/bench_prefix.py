"""``layerzero bench-engine --workload prefix``: what prefix caching buys and what it costs.

- Shared prefix (the issue's workload): 64 groups x 16 requests; each group shares a 2048-token prefix, each
  request adds a 128-token question and generates 256 tokens (``ignore_eos``, greedy); run with prefix caching
  on and off; the speed-up is the ratio of wall times.
- Cost at a 0% hit rate: nano-vllm's workload (random prompts share no full block) with prefix caching on and
  off; the cost is ``time_on / time_off - 1``.

``scale="cpu"`` shrinks both (4 groups x 4 requests, 256-token prefix, 16-token questions, 16 outputs; the
nano-vllm CPU scale) for a CPU. Token ids are drawn with ``random.seed(0)`` in [0, 10000].
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path
from typing import Any

import torch

from .bench import build_checkpoint, make_workload

__all__ = ["PREFIX_SCALES", "run_prefix", "run_shared_once", "shared_prefix_workload", "warm_up"]

PREFIX_SCALES = {
    "full": {"groups": 64, "per_group": 16, "prefix": 2048, "question": 128, "output": 256, "budget": None},
    "cpu": {"groups": 4, "per_group": 4, "prefix": 256, "question": 16, "output": 16, "budget": 512},
}
"""``budget``: max_num_batched_tokens (None: the engine's 8192). Requests admitted in the same step cannot hit
each other's blocks (blocks are cached once computed), so the CPU scale uses a budget of two requests per
step, as the full scale's default budget admits about four 2176-token requests per step."""


def shared_prefix_workload(scale: str = "full") -> tuple[list[list[int]], int]:
    """(prompts, output tokens per request) of the shared-prefix workload, groups interleaved in arrival order
    (request i of every group, then request i + 1, ...), so a cache must keep several prefixes at once."""
    s = PREFIX_SCALES[scale]
    rng = random.Random(0)
    prefixes = [[rng.randint(0, 10000) for _ in range(s["prefix"])] for _ in range(s["groups"])]
    prompts = [
        prefixes[g] + [rng.randint(0, 10000) for _ in range(s["question"])]
        for _ in range(s["per_group"])
        for g in range(s["groups"])
    ]
    return prompts, s["output"]


def _timed(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    prompts: list[list[int]],
    max_tokens: list[int],
    caching: bool,
    max_model_len: int,
    budget: int | None = None,
    num_kv_blocks: int | None = None,
    warm_run: bool | None = None,
    **engine_options: Any,
) -> tuple[float, dict[str, Any]]:
    from .. import LLM, SamplingParams

    llm = LLM(
        path,
        device=str(device),
        dtype=dtype,
        enable_prefix_caching=caching,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        num_kv_blocks=num_kv_blocks,
        **engine_options,
    )
    warm_up(llm)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in max_tokens]
    if (
        warm_run if warm_run is not None else device.type == "cuda"
    ):  # the workload once, untimed (see warm_up)
        llm.generate(prompts, params, use_tqdm=False)
        if not llm.reset_prefix_cache():
            raise RuntimeError(
                "bench_prefix: the prefix cache kept blocks after the warm run (a request still holds them)"
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    before, kv_before = llm.stats(), llm.engine.kv.stats()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    took, stats, kv = time.perf_counter() - t0, llm.stats(), llm.engine.kv.stats()
    for k in (
        "steps",
        "preemptions",
        "cascade_steps",
        "cascade_saved_tokens",
    ):  # the timed run's, not the warm-up's
        stats[k] -= before[k]
    queried = kv.queries - kv_before.queries
    stats["prefix_hit_rate"] = (kv.hits - kv_before.hits) / queried if queried else 0.0
    # the next engine sizes its KV pool from free memory: this one's pool and graph pools must be gone first
    # (the first GPU run built its third engine before the second was collected, got a smaller pool and
    # preempted)
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return took, stats


def warm_up(llm: Any) -> None:
    """Run, before the timing, every kind of step the workload has, so first-use compiles (Triton kernels,
    FlashInfer modules) are not timed: a prompt that fills three blocks, then a batch of four prompts
    extending it (with prefix caching they hit its blocks: a prefill step on a cached prefix, cascade when on)
    and two new ones, decoding together. The same for every engine of a comparison. Not enough alone
    (first-use compiles still landed in timed runs: benchmarks/results/history.md), so on CUDA every timed run
    of this module also follows an untimed run of the same workload in the same engine, with the prefix cache
    emptied in between (``LLM.reset_prefix_cache``): the timed run starts as cold as a new engine's
    cache, with every kernel compiled."""
    from .. import SamplingParams

    prefix = [(7 * i) % 997 + 3 for i in range(3 * llm.engine.config.block_size)]
    llm.generate([prefix], SamplingParams(max_tokens=2), use_tqdm=False)
    batch = [prefix + [11 + i] * (i + 1) for i in range(4)] + [[13, 17, 19], [23] * 40]
    llm.generate(batch, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def run_prefix(
    *,
    scale: str = "full",
    model: str | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 1,
    zero_hit: bool = True,
) -> dict[str, Any]:
    """Both measurements (see the module docstring); returns seconds, ratios and the engine's stats.

    On CUDA the shared-prefix workload also runs with prefix caching and ``cascade_attention=True``
    (``seconds_cache_on_cascade``, ``speedup_cascade``, ``cascade_steps``): what cascade attention adds to the
    hits; and with ``scheduling_policy="lpm"`` on top (``seconds_cache_on_cascade_lpm``,
    ``speedup_cascade_lpm``): the groups admitted together (a wave of 16 groups x 16 members instead of 64 x 4
    in arrival order), so the shared level reads 4x fewer prefixes per step. The cache-off baseline does not
    depend on the policy (nothing is cached to group by; every request computes and reads its whole prompt
    either way). ``zero_hit=False`` skips the 0%-hit measurement (``"zero_hit"`` is then None).

    Every shared-prefix run gets the KV pool size of the first one (cache on), so every run has the same room
    and none preempts. (A later engine once found less free memory than the first:
    benchmarks/results/history.md.)

    ``repeats``: the 0%-hit pair runs this many times, interleaved (on, off, on, off, ...), every engine with
    the KV pool size of the first one (likewise); the cost is the median of the per-pair costs (each pair's
    runs are adjacent in time), and every pair's seconds are reported."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        from layerzero import InvalidInputError

        raise InvalidInputError(f"run_prefix: repeats: expected an int >= 1, got {repeats!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    path = (
        Path(model)
        if model
        else build_checkpoint(Path.home() / ".cache" / "layerzero" / f"qwen3-0.6b-{scale}", scale, dt)
    )
    prompts, out = shared_prefix_workload(scale)
    mml = len(prompts[0]) + out + 16
    budget = PREFIX_SCALES[scale]["budget"]
    on, on_stats = _timed(path, dev, dt, prompts, [out] * len(prompts), True, mml, budget)
    blocks = on_stats.get("num_kv_blocks")  # every later engine gets the first one's pool (see the docstring)
    off, off_stats = _timed(path, dev, dt, prompts, [out] * len(prompts), False, mml, budget, blocks)
    shared = {
        "requests": len(prompts),
        "seconds_cache_on": on,
        "seconds_cache_off": off,
        "speedup": off / on,
        "hit_rate": on_stats["prefix_hit_rate"],
        **_engine_facts(on_stats, off_stats),
    }
    if dev.type == "cuda":
        casc, casc_stats = _timed(
            path, dev, dt, prompts, [out] * len(prompts), True, mml, budget, blocks, cascade_attention=True
        )
        shared.update(
            seconds_cache_on_cascade=casc,
            speedup_cascade=off / casc,
            steps_cascade=casc_stats["steps"],
            cascade_steps=casc_stats["cascade_steps"],
            cascade_saved_tokens=casc_stats["cascade_saved_tokens"],
        )
        lpm, lpm_stats = _timed(
            path,
            dev,
            dt,
            prompts,
            [out] * len(prompts),
            True,
            mml,
            budget,
            blocks,
            cascade_attention=True,
            scheduling_policy="lpm",
        )
        shared.update(
            seconds_cache_on_cascade_lpm=lpm,
            speedup_cascade_lpm=off / lpm,
            steps_cascade_lpm=lpm_stats["steps"],
            hit_rate_cascade_lpm=lpm_stats["prefix_hit_rate"],
            cascade_saved_tokens_lpm=lpm_stats["cascade_saved_tokens"],
        )
    result = {"scale": scale, "device": str(dev), "dtype": str(dt), "shared_prefix": shared, "zero_hit": None}
    if zero_hit:
        result["zero_hit"] = _zero_hit(path, dev, dt, scale, repeats)
    return result


def run_shared_once(
    *,
    scale: str = "full",
    model: str | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    caching: bool = True,
    num_kv_blocks: int | None = None,
    warm_run: bool | None = None,
    **engine_options: Any,
) -> tuple[float, dict[str, Any]]:
    """One timed run of the shared-prefix workload (as :func:`run_prefix` times each of its runs) with
    ``engine_options`` passed to ``LLM`` (e.g. ``cascade_attention=True, scheduling_policy="lpm"``): (seconds,
    the timed run's engine stats). ``warm_run``: run the workload once untimed first (then empty the prefix
    cache); None: on CUDA (see :func:`warm_up`). For side-by-side variants in one device call
    (``benchmarks/engine/bench_variant.py --workload prefix``)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    path = (
        Path(model)
        if model
        else build_checkpoint(Path.home() / ".cache" / "layerzero" / f"qwen3-0.6b-{scale}", scale, dt)
    )
    prompts, out = shared_prefix_workload(scale)
    return _timed(
        path,
        dev,
        dt,
        prompts,
        [out] * len(prompts),
        caching,
        len(prompts[0]) + out + 16,
        PREFIX_SCALES[scale]["budget"],
        num_kv_blocks,
        warm_run,
        **engine_options,
    )


def _zero_hit(path: Path, dev: torch.device, dt: torch.dtype, scale: str, repeats: int) -> dict[str, Any]:
    """The 0%-hit cost: ``repeats`` interleaved on/off pairs of the nano-vllm workload (see
    :func:`run_prefix`)."""
    w = make_workload(scale)
    mml = max(len(p) for p in w.prompts) + max(w.max_tokens) + 16
    pairs: list[tuple[float, float]] = []
    blocks = None
    for _ in range(repeats):
        miss_on, miss_stats = _timed(path, dev, dt, w.prompts, w.max_tokens, True, mml, None, blocks)
        blocks = blocks or miss_stats.get("num_kv_blocks")
        miss_off, miss_off_stats = _timed(path, dev, dt, w.prompts, w.max_tokens, False, mml, None, blocks)
        pairs.append((miss_on, miss_off))
    costs = sorted(a / b - 1.0 for a, b in pairs)
    miss_on, miss_off = sorted(pairs, key=lambda p: p[0] / p[1])[len(pairs) // 2]
    return {
        "requests": len(w.prompts),
        "seconds_cache_on": miss_on,
        "seconds_cache_off": miss_off,
        "cost": costs[len(costs) // 2],
        "pair_costs": costs,
        "pairs_seconds": pairs,
        "hit_rate": miss_stats["prefix_hit_rate"],
        **_engine_facts(miss_stats, miss_off_stats),
    }


def _engine_facts(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """What makes two runs comparable: KV pool size, preemptions and steps of each (cache on / off)."""
    return {k: [on[k], off[k]] for k in ("num_kv_blocks", "preemptions", "steps") if k in on and k in off}
