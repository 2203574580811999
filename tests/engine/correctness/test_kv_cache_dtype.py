"""``LLM(kv_cache_dtype="fp8" | "int8")``: a quantized KV pool. Greedy tokens against ``"auto"`` (the model's
dtype, float32 here) on the tiny test checkpoints, the logprob drift measured and bounded, the pool's block
count for the same bytes, and option validation.

Measured on this CPU (float32 model, 6 prompts x 16 greedy tokens; see the report printed with ``-s``): the
bounds below are those numbers with margin, not the quantization's worst case."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration
NEW = 16


def _llm(checkpoints, family, **kw):
    from layerzero.engine import LLM

    opts = dict(device="cpu", dtype=torch.float32, max_model_len=96, num_kv_blocks=64, max_num_seqs=8)
    opts.update(kw)
    return LLM(checkpoints[family], **opts)


def _greedy(llm, ps, new=NEW):
    """Per prompt: (greedy tokens, the chosen tokens' raw logprobs, each step's top-5 token ids)."""
    from layerzero.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=5)
    out = []
    for o in llm.generate(ps, sp, use_tqdm=False):
        c = o.outputs[0]
        out.append(
            (
                c.token_ids,
                [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
                [set(lp) for lp in c.logprobs],
            )
        )
    return out


def _compare(ref, got):
    """vLLM's top-5 rule (tests/models/utils.py ``check_logprobs_close``), per sequence up to its first
    divergence: at every step each run's token is in the other's top 5; after a divergence the continuations
    condition on different tokens, so nothing further is compared. Returns (rule holds, fraction of tokens
    before the first divergence, max |logprob drift| and its mean over the steps before each first
    divergence)."""
    ok, before, total, drifts = True, 0, 0, []
    for (rt, rl, rtop), (gt, gl, gtop) in zip(ref, got, strict=True):
        total += len(rt)
        for a, b, la, lb, ta, tb in zip(rt, gt, rl, gl, rtop, gtop, strict=True):
            if a != b:
                ok = ok and a in tb and b in ta
                break
            before += 1
            drifts.append(abs(la - lb))
    return ok, before / total, max(drifts), sum(drifts) / len(drifts)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize(("kv", "max_drift", "min_forced"), [("fp8", 0.5, 0.8), ("int8", 0.25, 0.9)])
def test_quantized_pool_greedy_close_to_auto(checkpoints, family, kv, max_drift, min_forced):
    ps = prompts(6, seed=21, lo=5, hi=60)
    ref = _greedy(_llm(checkpoints, family), ps)
    llm = _llm(checkpoints, family, kv_cache_dtype=kv)
    assert all(
        c.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv] for c in llm.engine.runner.kv_caches
    )
    got = _greedy(llm, ps)
    ok, agree, drift_max, drift_mean = _compare(ref, got)
    # teacher-forced: the next greedy token after every prefix (prompt + the "auto" run's first i tokens)
    forced = [p + ref[j][0][:i] for j, p in enumerate(ps) for i in range(NEW)]
    a, b = _greedy(_llm(checkpoints, family), forced, 1), _greedy(llm, forced, 1)
    tf = sum(x[0][0] == y[0][0] for x, y in zip(a, b, strict=True)) / len(forced)
    tf_drift = [abs(x[1][0] - y[1][0]) for x, y in zip(a, b, strict=True) if x[0][0] == y[0][0]]
    print(
        f"\n{family} kv_cache_dtype={kv}: free-running tokens before first divergence {agree:.3f}, logprob "
        f"drift there max {drift_max:.4f} mean {drift_mean:.5f}, top-5 rule {ok}; teacher-forced next token "
        f"equal {tf:.3f} of {len(forced)}, drift max {max(tf_drift):.4f} mean "
        f"{sum(tf_drift) / len(tf_drift):.5f}"
    )
    assert ok
    assert drift_max <= max_drift and max(tf_drift) <= max_drift
    assert tf >= min_forced


def test_pool_holds_more_blocks_for_the_same_bytes(checkpoints):
    """CPU sizing: cpu_kv_cache_bytes / bytes per block: 1-byte pools get 4x the float32 and 2x the bf16
    blocks."""
    fp32 = _llm(checkpoints, "qwen3", num_kv_blocks=None, max_num_seqs=256, cpu_kv_cache_bytes=1 << 20)
    n32 = fp32.engine.runner.num_blocks
    n16 = _llm(
        checkpoints,
        "qwen3",
        dtype=torch.bfloat16,
        num_kv_blocks=None,
        max_num_seqs=256,
        cpu_kv_cache_bytes=1 << 20,
    ).engine.runner.num_blocks
    counts = {
        kv: _llm(
            checkpoints,
            "qwen3",
            num_kv_blocks=None,
            max_num_seqs=256,
            cpu_kv_cache_bytes=1 << 20,
            kv_cache_dtype=kv,
        ).engine.runner.num_blocks
        for kv in ("fp8", "int8")
    }
    print(f"\nblocks for 1 MiB: float32 {n32}, bfloat16 {n16}, fp8 {counts['fp8']}, int8 {counts['int8']}")
    for n in counts.values():
        assert n == 4 * n32 and n == 2 * n16  # exact: the cap (max_num_seqs sequences) is far above
    same = _llm(checkpoints, "qwen3", num_kv_blocks=n32, kv_cache_dtype="fp8").engine.runner.kv_caches[0]
    assert fp32.engine.runner.kv_caches[0].nbytes == 4 * same.nbytes


@pytest.mark.parametrize("bad", ["fp16", "FP8", None, torch.float8_e4m3fn, "e5m2"])
def test_bad_kv_cache_dtype(checkpoints, bad):
    import layerzero as lz

    with pytest.raises(lz.ConfigurationError, match="kv_cache_dtype"):
        _llm(checkpoints, "qwen3", kv_cache_dtype=bad)


def test_int8_scales_calibrated_on_first_prefill(checkpoints):
    from layerzero.engine.layers.attention import KVScales

    llm = _llm(checkpoints, "qwen3", kv_cache_dtype="int8")
    scales = [m for m in llm.engine.runner.model.modules() if isinstance(m, KVScales)]
    assert scales and all(m.calibrate and float(m.k_scale) == 1.0 for m in scales)
    _greedy(llm, prompts(1, seed=3, lo=20, hi=20))
    assert all(not m.calibrate and 0 < float(m.k_scale) < 1.0 for m in scales)
    fp8 = _llm(checkpoints, "qwen3", kv_cache_dtype="fp8")
    fs = [m for m in fp8.engine.runner.model.modules() if isinstance(m, KVScales)]
    assert all(not m.calibrate for m in fs)
    _greedy(fp8, prompts(1, seed=3, lo=20, hi=20))
    assert all(float(m.k_scale) == 1.0 and float(m.v_scale) == 1.0 for m in fs)
