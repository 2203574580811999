"""Issue 39, structured outputs: every JSON schema of :mod:`.schemas` gives output that parses and validates
(``jsonschema``, the independent oracle) in 20 of 20 seeded samples each. The checkpoint has random weights,
so only the grammar keeps the output valid: a missing or wrong mask fails at once. All schemas run in one
generate call (n=20 each), xgrammar and llguidance rows in the same batch."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ..conftest import deadline
from .schemas import SCHEMAS

pytestmark = pytest.mark.integration
SAMPLES = 20


@pytest.fixture(scope="module")
def llm(checkpoints):
    from layerzero.engine import LLM

    return LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=192,
        num_kv_blocks=4096,
        max_num_seqs=1024,
        async_scheduling=False,
    )


def test_schemas_are_many_and_cover_both_backends():
    from layerzero.engine.structured import select_backend
    from layerzero.engine.structured_params import StructuredOutputsParams

    assert len(SCHEMAS) >= 40
    backends = [select_backend(StructuredOutputsParams(json=s)).backend for s in SCHEMAS]
    assert backends.count("guidance") == 3 and backends.count("xgrammar") == len(SCHEMAS) - 3


def test_every_schema_validates_in_every_sample(llm):
    from layerzero.engine import SamplingParams
    from layerzero.engine.structured_params import StructuredOutputsParams

    params = [
        SamplingParams(
            n=SAMPLES,
            temperature=1.0,
            seed=1000 + i,
            max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=s),
        )
        for i, s in enumerate(SCHEMAS)
    ]
    with deadline(120):
        outs = llm.generate(["Answer in JSON:"] * len(SCHEMAS), params, use_tqdm=False)
    failures = []
    for schema, out in zip(SCHEMAS, outs, strict=True):
        assert len(out.outputs) == SAMPLES
        for c in out.outputs:
            try:
                assert c.finish_reason == "stop", f"finish_reason {c.finish_reason}"
                jsonschema.validate(json.loads(c.text), schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                failures.append((json.dumps(schema)[:80], c.text[:80], str(exc)[:120]))
    assert not failures, failures[:5]
    # the samples differ (the constraint does not force one output): the draw still samples
    assert len({c.text for out in outs for c in out.outputs}) > len(SCHEMAS) * 5
    assert llm.engine.structured.active == 0  # every matcher freed
