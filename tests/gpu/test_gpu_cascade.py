"""Cascade attention's kernels on a CUDA GPU (``pytest -m gpu``; skipped on CPU): every
``paged_attention_lse`` kernel that can run here (``triton.paged_decode_lse``, ``triton.paged_prefill_lse``,
``flashinfer.paged_attention_lse`` when installed: its base-2 lse converted) and
``triton.merge_attention_states``, locked one at a time, against the float64 oracle of
``tests/correctness/test_cascade_ops.py`` (its CPU helpers, inputs moved to CUDA); the cascade identity at a
serving shape; the shared level at the engine's graph shape (256 rows, groups of 1-256 members, the rest
empty) against a float64 einsum; the kernels LayerZero picks by default and under
``lz.capture_selection()``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from test_cascade_ops import case, oracle  # noqa: E402
from test_paged_quant_kv import locked  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _cuda(*ts):
    return [None if t is None else t.cuda() for t in ts]


def _einsum_reference(q_rows, cache, table_row, n, causal):
    """float64 ``(out [M, Hq, D], lse [M, Hq])`` of M query rows over the first ``n`` keys of one sequence
    (NHD cache ``[N, 2, P, Hkv, D]``, block ids ``table_row``), bottom-right causal or none, written with
    einsum."""
    page, hkv, d = cache.shape[2], cache.shape[3], cache.shape[4]
    hq, m = q_rows.shape[1], q_rows.shape[0]
    kv = cache[table_row[: -(-n // page)].long()].double().transpose(1, 0).reshape(2, -1, hkv, d)[:, :n]
    k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in kv)  # [n, Hq, D]
    scores = torch.einsum("mhd,nhd->mhn", q_rows.double(), k) / d**0.5
    if causal:
        seen = (
            torch.arange(n, device=q_rows.device)[None, :]
            <= n - m + torch.arange(m, device=q_rows.device)[:, None]
        )
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    return torch.einsum("mhn,nhd->mhd", scores.softmax(-1), v), scores.logsumexp(-1)


@pytest.mark.parametrize(
    "kernel, decode",
    [
        ("triton.paged_decode_lse", True),
        ("triton.paged_prefill_lse", True),
        ("triton.paged_prefill_lse", False),
        ("flashinfer.paged_attention_lse", True),
        ("flashinfer.paged_attention_lse", False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_lse_kernels_match_the_oracle(kernel, decode, dtype, causal, seed):
    if kernel.startswith("flashinfer"):
        pytest.importorskip("flashinfer")
        if dtype == torch.float32:
            pytest.skip("FlashInfer runs fp16/bf16 only")
    q, cache, tables, lens, cu = case(
        seed, "NHD", decode=decode, head_dim=64 if kernel.startswith("flashinfer") else None
    )  # FlashInfer: head dims 64/128/256
    if decode and causal is False:
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32) if kernel.endswith("prefill_lse") else None
    qc, cc, tc, lc, cuc = _cuda(q.to(dtype), cache.to(dtype), tables, lens, cu)
    with locked("paged_attention_lse", kernel):
        out, lse = lz.paged_attention(qc, cc, tc, lc, cu_seqlens_q=cuc, is_causal=causal, return_lse=True)
    tol = TOL[dtype]
    ref_out, ref_lse = oracle(q.to(dtype).float(), cache.to(dtype).float(), tables, lens, cu, "NHD", causal)
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_serving_shape_cascade_identity(dtype):
    """16 decode queries sharing a 2048-token prefix (Qwen3-0.6B heads: 16 q / 8 kv, D 128, pages of 16):
    shared level (not causal, one group) + unique level (decode) merged == plain paged decode over the whole
    sequences, with the kernels picked by default and as captured."""
    g = torch.Generator(device="cuda").manual_seed(0)
    page, hkv, hq, d, members = 16, 8, 16, 128, 16
    cache = torch.randn(160 + members * 8, 2, page, hkv, d, device="cuda", dtype=dtype, generator=g)
    prefix = torch.arange(128, dtype=torch.int32, device="cuda")  # 2048 tokens
    own = 128 + torch.arange(members * 8, dtype=torch.int32, device="cuda").view(members, 8)
    full = torch.cat([prefix.expand(members, -1), own], 1).contiguous()
    lens = 2048 + torch.randint(1, 8 * page, (members,), dtype=torch.int32, device="cuda", generator=g)
    q = torch.randn(members, hq, d, device="cuda", dtype=dtype, generator=g)
    for captured in (False, True):
        ctx = lz.capture_selection() if captured else torch.no_grad()
        with ctx:
            whole = lz.paged_attention(q, cache, full, lens)
            shared, shared_lse = lz.paged_attention(
                q,
                cache,
                prefix[None],
                torch.tensor([2048], dtype=torch.int32, device="cuda"),
                cu_seqlens_q=torch.tensor([0, members], dtype=torch.int32, device="cuda"),
                is_causal=False,
                return_lse=True,
            )
            mine, mine_lse = lz.paged_attention(q, cache, own, lens - 2048, return_lse=True)
            merged, _ = lz.merge_attention_states(shared, shared_lse, mine, mine_lse)
        torch.testing.assert_close(merged.float(), whole.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("groups, members", [(64, 4), (16, 16), (4, 64), (1, 256), (200, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_level_at_the_engine_graph_shape(groups, members, dtype):
    """``triton.paged_prefill_lse`` as the engine's decode graphs call it for the shared level: a bucket of
    256 rows (T = B = 256), G groups of M members first, the other "groups" empty (no rows, no keys), prefixes
    of 512-1000 tokens in pages of 16, Qwen3-0.6B heads. The kernel derives its items and splits on the device
    (a big group's token tiles spread over programs); every member row must equal a float64 softmax over its
    group's prefix computed here with einsum, and the rows past the groups must be 0 with lse -inf."""
    from layerzero.backends.triton.cascade import paged_prefill_lse

    g = torch.Generator(device="cuda").manual_seed(groups)
    page, hkv, hq, d, b, width = 16, 8, 16, 128, 256, 64
    cache = torch.randn(groups * width + 4, 2, page, hkv, d, device="cuda", dtype=dtype, generator=g)
    tables = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    tables[:groups] = (
        torch.randperm(groups * width, device="cuda", generator=g).view(groups, width).to(torch.int32)
    )
    lens = torch.zeros(b, dtype=torch.int32, device="cuda")
    lens[:groups] = torch.randint(512, 1001, (groups,), device="cuda", generator=g).to(torch.int32)
    cu = torch.full((b + 1,), groups * members, dtype=torch.int32, device="cuda")
    cu[: groups + 1] = torch.arange(groups + 1, device="cuda") * members
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype, generator=g)
    out, lse = paged_prefill_lse(q, cache, tables, lens, cu, None, False, "NHD")
    rows = groups * members
    for i in range(groups):
        ref, ref_lse = _einsum_reference(
            q[i * members : (i + 1) * members], cache, tables[i], int(lens[i]), False
        )
        tol = TOL[dtype]
        torch.testing.assert_close(out[i * members : (i + 1) * members].double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[i * members : (i + 1) * members].double(), ref_lse, rtol=tol, atol=tol)
    assert bool((out[rows:] == 0).all()) and bool((lse[rows:] == float("-inf")).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_kernel_at_a_mixed_step_shape(dtype):
    """``triton.paged_prefill`` (op ``paged_attention``) as an engine's mixed step calls it: Qwen3-0.6B heads
    (16 q / 8 kv, D 128), pages of 16, whole prompts (q_len == kv_len, up to 2100 tokens), chunks appended to
    cached tokens and decode rows in one call. Each row must equal a float64 bottom-right causal softmax
    computed here with einsum. Without FlashInfer, LayerZero picks this kernel by default for such a call (not
    the per-sequence SDPA loop)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    page, hkv, hq, d = 16, 8, 16, 128
    q_lens = [700, 1, 513, 1, 37, 2100, 1]
    kv_lens = [700, 40, 1513, 2000, 37, 2100, 1]
    width = max(-(-n // page) for n in kv_lens)
    cache = torch.randn(len(q_lens) * width + 3, 2, page, hkv, d, device="cuda", dtype=dtype, generator=g)
    tables = torch.randperm(cache.shape[0], device="cuda", generator=g)[: len(q_lens) * width]
    tables = tables.view(len(q_lens), width).to(torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dtype, generator=g)
    with locked("paged_attention", "triton.paged_prefill"):
        out = lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu)
    for i, n in enumerate(kv_lens):
        ref, _ = _einsum_reference(q[int(cu[i]) : int(cu[i + 1])], cache, tables[i], n, True)
        torch.testing.assert_close(
            out[int(cu[i]) : int(cu[i + 1])].double(), ref, rtol=TOL[dtype], atol=TOL[dtype]
        )
    if importlib.util.find_spec("flashinfer") is None:
        assert (
            lz.explain("paged_attention", q, cache, tables, lens, cu_seqlens_q=cu).chosen
            == "triton.paged_prefill"
        )


def test_merge_kernel_matches_reference():
    from layerzero.backends.reference.paged import merge_attention_states as ref_merge

    g = torch.Generator(device="cuda").manual_seed(1)
    oa, ob = (torch.randn(300, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    la, lb = (torch.randn(300, 16, device="cuda", generator=g) * 5 for _ in range(2))
    la[:3] = float("-inf")
    lb[:2] = float("-inf")
    with locked("merge_attention_states", "triton.merge_attention_states"):
        out, lse = lz.merge_attention_states(oa, la, ob, lb)
    ref, ref_lse = ref_merge(oa, la, ob, lb)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse)
    assert lz.which("merge_attention_states", oa, la, ob, lb) == "triton.merge_attention_states"
