"""Piecewise CUDA graphs (``CudaGraphKnobs.piecewise_max_tokens``) on a GPU: real captures of every family
(the MoE's graph-safe ``fused_moe`` inside the pieces), chunked prefill and mixed steps replayed piece by
piece, the tokens those of the same engine without them (fp32: padded GEMMs may round differently, so
logprobs within 1e-3 and the same tokens) and, in bf16, within vLLM's top-5 rule of the eager engine; strict
mode, so a capture that fails raises instead of running eager."""

from __future__ import annotations

import pytest
import torch

from ..conftest import assert_same_greedy, prompts

pytestmark = pytest.mark.gpu
NEW = 12


@pytest.fixture(autouse=True)
def _strict():
    import layerzero as lz

    lz.configure(strict=True)
    yield
    lz.configure(strict=False)


def _run(path, dtype, piecewise, ps):
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.config import CudaGraphKnobs

    llm = LLM(
        path,
        device="cuda",
        dtype=dtype,
        max_model_len=128,
        num_kv_blocks=128,
        max_num_seqs=16,
        max_num_batched_tokens=48,  # long prompts chunk, later steps mix decode rows in
        cuda_graph=CudaGraphKnobs(piecewise_max_tokens=piecewise),
    )
    ran = []
    pieces = llm.engine.runner.pieces
    if pieces is not None:
        run = pieces.run
        pieces.run = lambda batch: ran.append(batch.input_ids.shape[0]) or run(batch)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate(ps[:-1], sp, use_tqdm=False)  # full 48-token chunks, then mixed steps
    return outs + llm.generate(ps[-1:], sp, use_tqdm=False), ran, pieces  # alone: a ragged, padded step


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_pieces_equal_eager_prefill_fp32(checkpoints, family):
    ps = prompts(6, seed=61, lo=5, hi=70) + prompts(1, seed=7, lo=21, hi=21)
    want, _, none = _run(checkpoints[family], torch.float32, 0, ps)
    got, ran, pieces = _run(checkpoints[family], torch.float32, 48, ps)
    assert none is None and pieces is not None and sorted(pieces.graphs) == [16, 32, 48]
    assert ran and 21 in ran  # the lone 21-token prompt, padded to the 32 bucket
    assert_same_greedy(got, want, 1e-3)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_pieces_bf16_within_top5_of_eager(checkpoints, family):
    ps = prompts(6, seed=62, lo=5, hi=70) + prompts(1, seed=7, lo=21, hi=21)
    want, _, _ = _run(checkpoints[family], torch.bfloat16, 0, ps)
    got, ran, _ = _run(checkpoints[family], torch.bfloat16, 48, ps)
    assert ran
    for a, b in zip(got, want, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if s != t:  # each in the other's top 5; not compared past the first difference
                assert s in y.logprobs[i] and t in x.logprobs[i], (i, s, t)
                break
