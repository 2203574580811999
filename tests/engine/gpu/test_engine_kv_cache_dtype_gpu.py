"""``LLM(kv_cache_dtype="fp8" | "int8")`` on a GPU (bf16 model): tokens close to ``"auto"`` under vLLM's top-5
rule, the drift printed; the decode graphs are captured (``triton.reshape_and_cache`` and
``triton.paged_decode`` read and write quantized pools, graph-safe), also in strict mode, and give the same
tokens as ``enforce_eager``."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz

from ..conftest import prompts

pytestmark = pytest.mark.gpu
NEW = 16


def _llm(path, **kw):
    from layerzero.engine import LLM

    return LLM(
        path, device="cuda", dtype=torch.bfloat16, max_model_len=128, num_kv_blocks=128, max_num_seqs=16, **kw
    )


def _gen(llm, ps):
    from layerzero.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate(ps, sp, use_tqdm=False)]


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_quantized_pool_on_gpu(checkpoints, family, kv):
    ps = prompts(6, seed=61)
    ref = _gen(_llm(checkpoints[family], enforce_eager=True), ps)
    llm = _llm(checkpoints[family], kv_cache_dtype=kv)
    assert llm.engine.runner.graphs is not None
    got = _gen(llm, ps)
    before = total = 0
    drift = []
    for a, b in zip(ref, got, strict=True):
        total += len(a.token_ids)
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                assert x in b.logprobs[i] and y in a.logprobs[i]
                break
            before += 1
            drift.append(abs(a.logprobs[i][x] - b.logprobs[i][y]))
    print(
        f"\n{family} {kv} (GPU, bf16): tokens before first divergence {before / total:.3f}, logprob drift "
        f"max {max(drift):.4f} mean {sum(drift) / len(drift):.5f}"
    )
    eager = _gen(_llm(checkpoints[family], kv_cache_dtype=kv, enforce_eager=True), ps)
    assert [o.token_ids for o in eager] == [o.token_ids for o in got]
    lz.configure(strict=True)
    try:
        assert _llm(checkpoints[family], kv_cache_dtype=kv).engine.runner.graphs is not None
    finally:
        lz.configure(strict=False)
