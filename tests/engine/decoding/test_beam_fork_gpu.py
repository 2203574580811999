"""Copy-on-write beam forks on a GPU (async scheduling and CUDA graphs on, the CUDA defaults): the forks'
device-side block copies give the beams that recomputing every beam's tokens gives, for the model's KV dtype
and an fp8 pool, and every block comes back (docs/decoding.md, "Beam search and n"). Not run in CI (no
GPU); the CPU tests are ``test_beam_fork.py``."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_cuda_forks_equal_recomputing(checkpoints, kv_dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from layerzero.engine import LLM, BeamSearchParams

    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(
        checkpoints["llama"],
        device="cuda",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=256,
        kv_cache_dtype=kv_dtype,
    )
    core = llm.engine
    assert core.async_scheduling
    copies = []
    execute = core.executor.execute_model

    def spy(out):
        copies.extend(out.blocks_to_copy)
        return execute(out)

    core.executor.execute_model = spy
    prompt = prompts(1, seed=91, lo=21, hi=21)[0]  # ends inside a 16-token block: the forks copy
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    (forked,) = llm.beam_search([prompt], params)
    assert copies  # the partial blocks were copied on the device
    add = core.add_request
    core.add_request = lambda req, *, fork_of=None, retain_kv=False: add(req, retain_kv=retain_kv)
    assert core.reset_prefix_cache()
    (recomputed,) = llm.beam_search([prompt], params)
    assert [s.tokens for s in forked.sequences] == [s.tokens for s in recomputed.sequences]
    assert [s.score for s in forked.sequences] == pytest.approx(
        [s.score for s in recomputed.sequences], abs=1e-3
    )
    kv = core.kv
    kv.check_invariants()
    assert kv.pool.num_referenced == 0 and not core.retained
