"""``flex_attention.paged_attention`` (lz.paged_attention on FlexAttention block masks) on CPU.

- 64 seeded cases (float32) against a float64 oracle written here and against ``reference.paged_attention``:
  page sizes 1/8/16/32, NHD and HND, GQA ratios 1/2/4, decode and append (prefill, chunks, empty and length-1
  sequences), causal and not, custom scales; the cache is NaN in every slot no sequence uses (other pages and
  the tail of each last page) and unread block_tables entries hold garbage ids (-1, N, N + 7): nothing may
  leak.
- float16 / bfloat16 / float64 on a subset; the kernel leaves the cache untouched.
- The CUDA path's block mask (``create_block_mask`` of the same mask_mod) gives the same output on CPU and
  skips tiles; the inverse page table by hand; duplicate block ids refused on CPU.
- Routing: opt-in (the default pick is unchanged), ``lz.lock`` serves it, ``lz.explain`` lists it eligible;
  the CUDA rules (SM, float64, head dims, fp32 <= 128) as reasons on fake CUDA contexts.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

import layerzero as lz
from layerzero.backends.flex_attention import paged as fp
from layerzero.backends.flex_attention.kernels import direct_eager
from layerzero.backends.reference.paged import paged_attention as reference_paged
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec, GPUGeneration, tensor_core_generation
from layerzero.core.errors import BackendNotAvailableError, InvalidInputError
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import kernel_reasons

pytestmark = pytest.mark.correctness

F64 = torch.float64
PAGES = (1, 8, 16, 32)
NUM_CASES = 64
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
KERNEL = fp.FlexPagedAttention(
    flex_module.flex_attention,
    flex_module.create_block_mask,
    flex_module.BlockMask,
    compiled=False,
    eager=direct_eager(flex_module),
)


def case(seed: int) -> dict:
    """Seeded case: cycles page size, layout and phase; GQA 1/2/4; lengths with 0 (append only), 1 and
    full."""
    rng = random.Random(seed * 6007 + 3)
    decode = seed % 2 == 0
    lens = []
    for _ in range(rng.randint(1, 4)):
        kv = rng.choice((1, 2, rng.randint(1, 12), rng.randint(10, 45)))
        if decode:
            lens.append((1, kv))
        else:
            kind = rng.random()
            lens.append(
                (0, 0)
                if kind < 0.15
                else (kv, kv)
                if kind < 0.4
                else (rng.randint(0 if kind < 0.5 else 1, kv), kv)
            )
    return dict(
        page=PAGES[(seed // 2) % 4],
        layout=("NHD", "HND")[(seed // 8) % 2],
        decode=decode,
        lens=lens,
        hkv=rng.choice((1, 2)),
        ratio=rng.choice((1, 2, 4)),
        d=rng.choice((4, 8, 16)),
        causal=rng.random() < 0.8,
        scale=rng.choice((None, None, 0.5)),
        spare_blocks=rng.randint(0, 3),
        spare_cols=rng.randint(0, 2),
    )


def inputs(seed: int, dtype: torch.dtype = torch.float32):
    """(q, kv_cache, block_tables, seq_lens, cu_seqlens_q) of ``case(seed)``: NaN everywhere no sequence
    reads, garbage in unread table entries, shuffled block ids."""
    c = case(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-kv // c["page"]) for _, kv in c["lens"]]
    nb = sum(need) + c["spare_blocks"] + (1 if sum(need) == 0 else 0)
    ids = list(range(nb))
    rng.shuffle(ids)
    cols = max(max(need), 1) + c["spare_cols"]
    p, hkv, d = c["page"], c["hkv"], c["d"]
    shape = (nb, 2, p, hkv, d) if c["layout"] == "NHD" else (nb, 2, hkv, p, d)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    table = torch.tensor(
        [[rng.choice((-1, nb, nb + 7, 0)) for _ in range(cols)] for _ in c["lens"]], dtype=torch.int32
    ).reshape(len(c["lens"]), cols)
    for s, ((_, kv), n) in enumerate(zip(c["lens"], need, strict=True)):
        for j in range(n):
            table[s, j] = ids.pop()
        for t in range(kv):
            blk, off = int(table[s, t // p]), t % p
            for which in (0, 1):
                val = torch.randn(hkv, d, generator=gen, dtype=F64).to(dtype)
                if c["layout"] == "NHD":
                    cache[blk, which, off] = val
                else:
                    cache[blk, which, :, off] = val
    tokens = sum(q for q, _ in c["lens"])
    q = torch.randn(tokens, hkv * c["ratio"], d, generator=gen, dtype=F64).to(dtype)
    seq_lens = torch.tensor([kv for _, kv in c["lens"]], dtype=torch.int32)
    cu = (
        None
        if c["decode"]
        else torch.tensor([0, *itertools.accumulate(q for q, _ in c["lens"])], dtype=torch.int32)
    )
    return q, cache, table, seq_lens, cu


def oracle(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float64 attention per sequence, K/V read token by token at ``table[s, t // P] * P + t % P``;
    bottom-right causal (query i of q_len sees keys j <= kv_len - q_len + i); GQA by head // ratio."""
    c = case(seed)
    q, cache, table, seq_lens, cu = inputs(seed, dtype)
    p = c["page"]
    starts = cu.tolist() if cu is not None else list(range(len(c["lens"]) + 1))
    scale = 1 / math.sqrt(c["d"]) if c["scale"] is None else c["scale"]
    out = torch.zeros(q.shape, dtype=F64)
    for s, (ql, kv) in enumerate(c["lens"]):
        q0 = starts[s]
        if ql == 0:
            continue
        slots = [(int(table[s, t // p]), t % p) for t in range(kv)]
        pick = (
            (lambda b, o, w: cache[b, w, o]) if c["layout"] == "NHD" else (lambda b, o, w: cache[b, w, :, o])
        )
        k = torch.stack([pick(b, o, 0) for b, o in slots]).to(F64)[:, torch.arange(q.shape[1]) // c["ratio"]]
        v = torch.stack([pick(b, o, 1) for b, o in slots]).to(F64)[:, torch.arange(q.shape[1]) // c["ratio"]]
        scores = torch.einsum("ihd,jhd->hij", q[q0 : q0 + ql].to(F64), k) * scale
        if c["causal"]:
            scores = scores.masked_fill(
                torch.arange(kv)[None] > kv - ql + torch.arange(ql)[:, None], -math.inf
            )
        out[q0 : q0 + ql] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v)
    return out


def run(seed: int, dtype: torch.dtype = torch.float32, kernel=KERNEL) -> torch.Tensor:
    c = case(seed)
    q, cache, table, seq_lens, cu = inputs(seed, dtype)
    return kernel(q, cache, table, seq_lens, cu, c["scale"], c["causal"], c["layout"])


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = TOL[dtype]
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    return bool(torch.isfinite(out).all()) and bool(((out.to(F64) - ref).abs() <= tol * scale).all())


# ------------------------------------------------------------------------------------------ correctness
def test_cases_cover_the_grid():
    cs = [case(s) for s in range(NUM_CASES)]
    assert {(c["page"], c["layout"], c["decode"]) for c in cs} == set(
        itertools.product(PAGES, ("NHD", "HND"), (True, False))
    )
    flat = [(c["decode"], ql, kv) for c in cs for ql, kv in c["lens"]]
    assert any(kv == 0 for _, _, kv in flat) and any(kv == 1 for _, _, kv in flat)
    assert any(not dec and 0 < ql < kv for dec, ql, kv in flat) and any(ql == kv > 1 for _, ql, kv in flat)
    assert {c["ratio"] for c in cs} == {1, 2, 4} and any(not c["causal"] for c in cs)
    assert any(kv % c["page"] for c in cs for _, kv in c["lens"] if c["page"] > 1), (
        "no partly filled last page"
    )


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_matches_float64_oracle_and_reference(seed):
    c = case(seed)
    q, cache, table, seq_lens, cu = inputs(seed)
    before = cache.clone()
    out = run(seed)
    ref = reference_paged(q, cache, table, seq_lens, cu, c["scale"], c["causal"], c["layout"])
    assert out.shape == q.shape and out.dtype == q.dtype
    assert close(out, oracle(seed), torch.float32), c
    assert torch.allclose(out, ref, atol=2e-5, rtol=2e-5), c
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0)), "the kernel modified the cache"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    for seed in range(0, NUM_CASES, 5):
        out = run(seed, dtype)
        assert out.dtype == dtype
        assert close(out, oracle(seed, dtype), dtype), (seed, case(seed))


def test_cuda_block_mask_path_matches_and_skips_tiles():
    """The mask built by create_block_mask (the compiled/CUDA path) matches the float64 oracle on CPU, and
    with many unused pages it marks tiles as skipped (fewer visited KV blocks than columns)."""
    real = fp.FlexPagedAttention(
        flex_module.flex_attention,
        flex_module.create_block_mask,
        flex_module.BlockMask,
        compiled=False,
        eager=direct_eager(flex_module),
    )
    built = []

    def create(mask_mod, num_tokens, num_slots, device):
        bm = flex_module.create_block_mask(
            mask_mod, None, None, num_tokens, num_slots, device=device, BLOCK_SIZE=fp.KV_BLOCK_SIZE
        )
        built.append(bm)
        return bm

    real.block_mask = create
    for seed in range(0, 24, 3):
        assert close(run(seed, kernel=real), oracle(seed), torch.float32), seed
    # one sequence of 3 tokens in block 40 of a 64-block cache (page 16): 1 of 8 tiles of 128 slots is visited
    cache = torch.full((64, 2, 16, 1, 8), float("nan"))
    cache[40, :, :3] = torch.randn(2, 3, 1, 8)
    q = torch.randn(1, 2, 8)
    out = real(
        q,
        cache,
        torch.tensor([[40]], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        None,
        None,
        True,
        "NHD",
    )
    assert int(built[-1].kv_num_blocks.sum()) + int(built[-1].full_kv_num_blocks.sum()) == 1
    k, v = cache[40, 0, :3, 0], cache[40, 1, :3, 0]  # [3, 8]
    ref = torch.softmax(q[0] @ k.T / math.sqrt(8), -1) @ v
    assert torch.allclose(out[0], ref, atol=1e-6)


def test_hand_worked_decode():
    """One KV head, D=1, page 2, keys [0, 0, ln 3] at tokens 0..2 (block 2 then block 0), values [1, 2, 10], q
    = 1, scale 1: weights 1:1:3 -> (1 + 2 + 30) / 5 = 6.6; NaN in the unused slot (block 0 offset 1),
    block 1."""
    cache = torch.full((3, 2, 2, 1, 1), float("nan"))
    for t, (blk, off) in enumerate([(2, 0), (2, 1), (0, 0)]):
        cache[blk, 0, off] = (0.0, 0.0, math.log(3.0))[t]
        cache[blk, 1, off] = (1.0, 2.0, 10.0)[t]
    out = KERNEL(
        torch.ones(1, 1, 1),
        cache,
        torch.tensor([[2, 0, 9]], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        None,
        1.0,
        True,
        "NHD",
    )
    assert out.item() == pytest.approx(6.6, rel=1e-6)


def test_paged_index_by_hand():
    """Page 4, N=6: seq 0 uses blocks [5, 1] (len 6), its third entry (garbage 99) is unread; seq 1 (len 0)
    none; seq 2 uses [1] (len 2: shared prefix block). Append: q_lens 2, 0, 1."""
    table = torch.tensor([[5, 1, 99], [-1, -1, -1], [1, 77, -5]], dtype=torch.int32)
    lens = torch.tensor([6, 0, 2], dtype=torch.int32)
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    inverse, seq_of_q, q_pos, used = fp.paged_index(table, lens, cu, 3, 6, 4, check_duplicates=True)
    assert inverse.tolist() == [[-1, 1, -1, -1, -1, 0], [-1] * 6, [-1, 0, -1, -1, -1, -1]]
    assert seq_of_q.tolist() == [0, 0, 2] and q_pos.tolist() == [4, 5, 1]
    want = [False] * 24
    for x in [20, 21, 22, 23, 4, 5]:
        want[x] = True
    assert used.tolist() == want
    table[1, 0] = 3  # decode: seq 1 now holds one token in block 3
    d_inv, d_seq, d_pos, _ = fp.paged_index(table, torch.tensor([6, 1, 2], dtype=torch.int32), None, 3, 6, 4)
    assert d_seq.tolist() == [0, 1, 2] and d_pos.tolist() == [5, 0, 1]
    assert d_inv[1].tolist() == [-1, -1, -1, 0, -1, -1]
    with pytest.raises(InvalidInputError, match="distinct block ids"):
        fp.paged_index(
            torch.tensor([[3, 3]], dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32),
            None,
            1,
            6,
            4,
            check_duplicates=True,
        )


def test_empty_batch_and_unavailable():
    out = KERNEL(
        torch.zeros(0, 4, 8),
        torch.zeros(1, 2, 4, 2, 8),
        torch.full((2, 1), -1, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32),
        None,
        True,
        "NHD",
    )
    assert out.shape == (0, 4, 8)
    spec = fp.paged_spec(None, None, "torch is too old")
    with pytest.raises(BackendNotAvailableError, match="torch is too old"):
        spec.fn(torch.zeros(1, 1, 8), torch.zeros(1, 2, 4, 1, 8), None, None, None, None, True, "NHD")


# ------------------------------------------------------------------------------------------ routing
def test_opt_in_lock_serves_it_and_explain_lists_it():
    q, cache, table, seq_lens, cu = inputs(1)
    c = case(1)
    kw = dict(cu_seqlens_q=cu, scale=c["scale"], is_causal=c["causal"], kv_layout=c["layout"])
    report = lz.explain("paged_attention", q, cache, table, seq_lens, **kw)
    assert report.chosen != fp.PAGED_KERNEL
    assert report.candidate(fp.PAGED_KERNEL).status.value == "eligible"
    with lz.trace() as tr:
        default = lz.paged_attention(q, cache, table, seq_lens, **kw)
    assert fp.PAGED_KERNEL not in tr.kernels_for("paged_attention")
    lz.lock("paged_attention", fp.PAGED_KERNEL)
    try:
        with lz.trace() as tr:
            out = lz.paged_attention(q, cache, table, seq_lens, **kw)
    finally:
        lz.unlock("paged_attention")
    assert tr.kernels_for("paged_attention") == [fp.PAGED_KERNEL]
    assert torch.allclose(out, default, atol=2e-5) and close(out, oracle(1), torch.float32)


def _cuda_ctx(*, sm=(9, 0), dtype=torch.bfloat16, d=128, layout="NHD") -> SelectionContext:
    gen = GPUGeneration.HOPPER if sm >= (9, 0) else GPUGeneration.TURING
    dev = DeviceSpec(
        device_type="cuda",
        index=0,
        name="Fake GPU",
        sm=sm,
        generation=gen,
        tensor_core_gen=tensor_core_generation(gen),
        supports_bf16=sm >= (8, 0),
        supports_fp8=sm >= (8, 9),
        total_memory_bytes=None,
        multiprocessor_count=None,
        torch_version=torch.__version__,
        cuda_version="13.0",
        driver_version=None,
        cudnn_version=None,
        cpu_vendor=None,
        cpu_isa=frozenset(),
    )
    return SelectionContext(
        op="paged_attention",
        device=dev,
        dtype=dtype,
        batch=4,
        num_heads_q=8,
        num_heads_kv=2,
        head_dim=d,
        head_dim_v=d,
        seq_len_q=1,
        seq_len_kv=1024,
        seq_equal=False,
        is_causal=True,
        kv_layout=layout,
        page_size=16,
    )


@pytest.mark.parametrize(
    ("ctx_kw", "code"),
    [
        (dict(), None),
        (dict(dtype=torch.float32, d=128), None),
        (dict(sm=(7, 5)), R.SM_TOO_OLD),
        (dict(dtype=torch.float64), R.DTYPE_UNSUPPORTED),
        (dict(d=8), R.HEAD_DIM_INVALID),
        (dict(d=512), R.HEAD_DIM_TOO_LARGE),
        (dict(dtype=torch.float32, d=192), R.HEAD_DIM_TOO_LARGE),
        (dict(layout="BOGUS"), R.KV_LAYOUT_UNSUPPORTED),
    ],
)
def test_cuda_rules_as_reasons(ctx_kw, code):
    RUNTIME.ensure_ready()
    spec = RUNTIME.registry.kernel(fp.PAGED_KERNEL, "paged_attention")
    assert spec.priority == -1 and not spec.graph_safe and spec.deterministic
    got = {r.code for r in kernel_reasons(RUNTIME.registry, spec, _cuda_ctx(**ctx_kw))}
    assert got == (set() if code is None else {code})
