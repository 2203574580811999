"""Structured outputs on a GPU (bf16, CUDA-graph decode, async scheduling): every JSON schema of
:mod:`.schemas` validates in 20 of 20 seeded samples, a regex batch full-matches, and the device bitmask
apply equals the CPU one. Skipped without CUDA (the ``gpu`` marker)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from .schemas import SCHEMAS

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _strict():
    import layerzero as lz

    lz.configure(strict=True)
    yield
    lz.configure(strict=False)


def test_bitmask_apply_on_cuda_equals_cpu():
    from layerzero.engine.core.sched.output import GrammarBitmask, SamplingMetadata
    from layerzero.engine.worker.grammar_bitmask import apply_grammar_bitmask

    g = np.random.default_rng(1)
    v = 151936
    logits = torch.from_numpy(g.standard_normal((64, v)).astype(np.float32))
    rows = np.arange(0, 64, 2, dtype=np.int64)
    bits = g.integers(-(2**31), 2**31, size=(len(rows), (v + 31) // 32), dtype=np.int64).astype(np.int32)
    b = GrammarBitmask(rows, bits)
    cpu, gpu = logits.clone(), logits.cuda()
    apply_grammar_bitmask(cpu, SamplingMetadata(grammar_bitmask=b))
    apply_grammar_bitmask(gpu, SamplingMetadata(grammar_bitmask=b))
    assert torch.equal(gpu.cpu(), cpu) and torch.isinf(cpu).any()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_schemas_and_regexes_on_gpu(checkpoints, async_scheduling):
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.structured_params import StructuredOutputsParams as S

    llm = LLM(
        checkpoints["qwen3"],
        device="cuda",
        dtype=torch.bfloat16,
        max_model_len=192,
        num_kv_blocks=4096,
        max_num_seqs=1024,
        async_scheduling=async_scheduling,
    )
    params = [
        SamplingParams(n=20, temperature=1.0, seed=2000 + i, max_tokens=160, structured_outputs=S(json=s))
        for i, s in enumerate(SCHEMAS)
    ]
    rx = r"[a-z]{2,5}-[0-9]{3}"
    params.append(
        SamplingParams(n=20, temperature=1.0, seed=7, max_tokens=32, structured_outputs=S(regex=rx))
    )
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs, strict=False):
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
    assert all(re.fullmatch(rx, c.text) and c.finish_reason == "stop" for c in outs[-1].outputs)
