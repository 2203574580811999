"""``LLM(freeze_gc=...)``: after start-up the heap is frozen (``gc.freeze``, as vLLM does), so the cyclic
collector's full collections no longer scan the model and the engine (~330 ms once per shared-prefix run on
the H200); deleting the LLM unfreezes it, so the deleted engine's reference cycles are collected. Off by
default on CPU."""

from __future__ import annotations

import gc
import weakref

import pytest

from layerzero import ConfigurationError

pytestmark = pytest.mark.unit


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_after_start_and_unfreeze_on_delete(checkpoints, unfrozen):
    from layerzero.engine import LLM, SamplingParams

    llm = LLM(checkpoints["qwen3"], device="cpu", freeze_gc=True, num_kv_blocks=64)
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the model, torch and the engine
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and gc.get_freeze_count() > frozen // 2  # still frozen
    engine = weakref.ref(llm.engine)
    del llm, out
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engine() is None


def test_off_by_default_on_cpu(checkpoints, unfrozen):
    from layerzero.engine import LLM

    llm = LLM(checkpoints["qwen3"], device="cpu", num_kv_blocks=64)
    assert gc.get_freeze_count() == 0 and llm.engine is not None


def test_bad_value():
    from layerzero.engine.config import EngineConfig

    with pytest.raises(ConfigurationError, match="freeze_gc.*True, False or None"):
        EngineConfig("x", freeze_gc="yes")
