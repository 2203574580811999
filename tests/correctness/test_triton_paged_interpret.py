"""``triton.paged_decode`` on CPU: the Triton kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set below before any ``@triton.jit`` decorator runs when no CUDA device is visible),
plus the kernel's constraints and routing on hand-built contexts.

- seeded decode cases against a float64 oracle that gathers K/V token by token (page sizes 1, 5, 8, 16, 32;
  NHD and HND; GQA ratios 1..16; head dims 8..128 incl. odd ones; length-1 sequences; forced split counts,
  splits past a sequence's end); every unused page and slot is NaN and unread block-table entries hold garbage
  ids;
- a hand-worked case (q = 0: uniform attention, the output is the mean of the used V rows);
- split sizing (``choose_split_len``) and the workspace bound (brute force over the bucket);
- the KernelSpec: refuses prefill/append, CPU, SM < 8.0, GQA ratio > 16; accepts NHD and HND; wins over
  ``torch_sdpa.paged_attention`` on a hand-built CUDA context and is the graph-safe choice under capture.

The interpreter tests skip with a reason when triton is not importable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first @triton.jit of the session (kernels load lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _triton_interp import needs_interpreter  # noqa: E402

from layerzero.backends.reference.paged import paged_attention as reference_paged  # noqa: E402
from layerzero.backends.reference.paged import paged_attention_lse as reference_paged_lse  # noqa: E402
from layerzero.backends.torch_sdpa.paged import kernel_specs as sdpa_paged_specs  # noqa: E402
from layerzero.backends.triton import _paged_launch as tpl  # noqa: E402
from layerzero.backends.triton import paged as tp  # noqa: E402
from layerzero.core.context import SelectionContext  # noqa: E402
from layerzero.core.device import DeviceSpec  # noqa: E402
from layerzero.core.errors import BackendNotAvailableError, InvalidInputError  # noqa: E402
from layerzero.core.knobs import knobs  # noqa: E402
from layerzero.core.policy import Policy  # noqa: E402
from layerzero.core.reasons import ReasonCode as R  # noqa: E402
from layerzero.core.registry import KernelRegistry  # noqa: E402
from layerzero.core.runtime import RUNTIME  # noqa: E402
from layerzero.core.selection import SelectionInputs, select  # noqa: E402
from layerzero.core.specs import BackendSpec, Phase  # noqa: E402
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.correctness

needs_triton = needs_interpreter("tests/gpu/test_gpu_triton_paged.py")
F64 = torch.float64
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEFAULT = tp.PagedDecodeKnobs()


@pytest.fixture
def paged_knobs():
    """``paged_knobs(field=value, ...)``: set ``triton.paged_decode`` knobs until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(knobs(tp.KNOBS, **fields))


# ------------------------------------------------------------------------------------------------ inputs
def make_case(
    seed: int,
    *,
    layout: str,
    page: int,
    ratio: int,
    hkv: int,
    d: int,
    lens: list[int],
    dtype: torch.dtype = torch.float32,
    spare_cols: int = 2,
):
    """(q [B, Hq, D], cache, block_tables [B, M] int32, seq_lens [B] int32): used blocks shuffled, every
    unused slot and page NaN, block-table entries past the used ones garbage (-1, N, N + 7, 12345)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    nb = sum(need) + 2
    ids = list(range(nb))
    rng.shuffle(ids)
    m = max(need) + spare_cols
    shape = (nb, 2, page, hkv, d) if layout == "NHD" else (nb, 2, hkv, page, d)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    table = torch.tensor(
        [[rng.choice((-1, nb, nb + 7, 12345)) for _ in range(m)] for _ in lens], dtype=torch.int32
    )
    for s, (n, k) in enumerate(zip(lens, need, strict=True)):
        for j in range(k):
            table[s, j] = ids.pop()
        for t in range(n):
            blk, off = int(table[s, t // page]), t % page
            for which in (0, 1):
                val = torch.randn(hkv, d, generator=gen, dtype=F64).to(dtype)
                if layout == "NHD":
                    cache[blk, which, off] = val
                else:
                    cache[blk, which, :, off] = val
    q = torch.randn(len(lens), hkv * ratio, d, generator=gen, dtype=F64).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def oracle(q, cache, table, lens, layout, scale=None) -> torch.Tensor:
    """float64 decode attention: K/V gathered token by token by slot arithmetic; query head h reads KV head
    h // (Hq / Hkv); the one query token sees every key."""
    b, hq, d = q.shape
    page = cache.shape[3 if layout == "HND" else 2]
    hkv = cache.shape[2 if layout == "HND" else 3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(b, hq, d, dtype=F64)
    for s in range(b):
        n = int(lens[s])
        slots = [(int(table[s, t // page]), t % page) for t in range(n)]
        if layout == "NHD":
            k = torch.stack([cache[i, 0, o] for i, o in slots]).to(F64)  # [n, Hkv, D]
            v = torch.stack([cache[i, 1, o] for i, o in slots]).to(F64)
        else:
            k = torch.stack([cache[i, 0, :, o] for i, o in slots]).to(F64)
            v = torch.stack([cache[i, 1, :, o] for i, o in slots]).to(F64)
        for h in range(hq):
            kv = h // (hq // hkv)
            w = torch.softmax((k[:, kv] @ q[s, h].to(F64)) * scale, dim=0)
            out[s, h] = w @ v[:, kv]
    return out


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert bool(torch.isfinite(out).all()), "NaN/inf leaked into the output"
    tol = TOL[dtype]
    scale = float(ref.abs().max())
    torch.testing.assert_close(out.to(F64), ref, rtol=tol, atol=tol * scale)


# Each case: (seed, layout, page, ratio, hkv, d, lens, num_splits, block_n, dtype)
CASES = [
    (0, "NHD", 1, 1, 2, 16, [1, 5, 9], None, 16, torch.float32),
    (1, "HND", 1, 4, 1, 24, [3, 1], 2, 16, torch.float32),
    (2, "NHD", 8, 2, 2, 64, [1, 40, 17], 3, 16, torch.float32),
    (3, "HND", 8, 1, 3, 13, [33, 8], None, 16, torch.float32),
    (4, "NHD", 16, 8, 1, 32, [70, 1], 5, 16, torch.float32),
    (5, "HND", 16, 16, 1, 8, [16, 31, 2], 4, 16, torch.float32),
    (6, "NHD", 32, 7, 1, 40, [65, 3], 3, 32, torch.float32),
    (7, "HND", 32, 2, 2, 128, [1], None, 32, torch.float32),
    (8, "NHD", 5, 3, 2, 16, [23, 11], 4, 16, torch.float32),  # page size not a power of two
    (9, "HND", 16, 4, 2, 64, [48, 1, 30], 6, 16, torch.float16),
    (10, "NHD", 8, 1, 4, 64, [20, 9], 2, 16, torch.float16),
    (11, "HND", 1, 2, 2, 32, [7, 1], 3, 16, torch.bfloat16),
    (
        12,
        "NHD",
        16,
        16,
        1,
        16,
        [50],
        32,
        16,
        torch.bfloat16,
    ),  # more splits than tiles: clipped, empty ones merge
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}-{c[1]}-P{c[2]}-g{c[3]}-D{c[5]}" for c in CASES])
def test_decode_matches_float64_oracle(case):
    seed, layout, page, ratio, hkv, d, lens, splits, bn, dtype = case
    q, cache, table, lens_t = make_case(
        seed, layout=layout, page=page, ratio=ratio, hkv=hkv, d=d, lens=lens, dtype=dtype
    )
    out = tp.paged_decode(q, cache, table, lens_t, None, layout, num_splits=splits, block_n=bn)
    close(out, oracle(q, cache, table, lens_t, layout), dtype)


@needs_triton
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_canonical_entry_matches_the_reference_kernel(layout):
    """The registered callable (canonical args, explicit scale) vs reference.paged_attention in float64."""
    q, cache, table, lens = make_case(20, layout=layout, page=16, ratio=4, hkv=2, d=32, lens=[37, 1, 16])
    out = tp.paged_attention(q, cache, table, lens, None, 0.3, True, layout)
    ref = reference_paged(q.to(F64), cache.to(F64).nan_to_num(0.0), table, lens, None, 0.3, True, layout)
    close(out, ref, torch.float32)


@needs_triton
def test_uniform_attention_by_hand():
    """q = 0: every used key gets weight 1 / seq_len, so the output is the mean of the used V rows (worked out
    by hand, no softmax); NaN in the rest of the page and in the unused page must not leak."""
    d, page = 16, 8
    cache = torch.full((3, 2, page, 1, d), float("nan"))
    vals = torch.arange(10 * d, dtype=torch.float32).reshape(10, d)
    cache[2, 1, :, 0] = vals[:8]  # tokens 0..7 in block 2
    cache[0, 1, :2, 0] = vals[8:10]  # tokens 8, 9 in block 0 (slots 2..7 stay NaN)
    cache[2, 0] = 1.0
    cache[0, 0, :2] = -3.0
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)  # block 1: NaN everywhere, listed but unused
    out = tp.paged_decode(
        torch.zeros(1, 2, d), cache, table, torch.tensor([10], dtype=torch.int32), num_splits=2, block_n=16
    )
    expected = vals.mean(0)  # row means: (0 + 16 + ... + 144) / 10 + column index
    assert torch.equal(expected, torch.arange(d, dtype=torch.float32) + 72.0)
    torch.testing.assert_close(out[0, 0], expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out[0, 1], expected, rtol=1e-6, atol=1e-5)


@needs_triton
def test_splits_past_every_sequence_are_empty_without_nan():
    """M * P far above every seq_len: most splits see no key (lse -inf) and must weigh 0 in the merge."""
    q, cache, table, lens = make_case(
        30, layout="NHD", page=4, ratio=2, hkv=1, d=16, lens=[1, 3], spare_cols=30
    )
    split_len, splits = tp.choose_split_len(2, 1, table.shape[1] * 4, 1, 16, num_splits=8)
    assert splits == 8 and split_len == 16  # 128 positions, 8 tiles of 16: 7 of the 8 splits are empty
    out = tp.paged_decode(q, cache, table, lens, num_splits=8, block_n=16)
    close(out, oracle(q, cache, table, lens, "NHD"), torch.float32)


@needs_triton
def test_merge_drops_partials_of_empty_splits_whatever_their_slots_hold():
    """Stage 2 loads every split's partial together with the lse (no mask computed from the lse, which would
    cost a second round trip) and drops those whose lse is -inf: an empty split writes only its lse, cascade
    never writes its unused slots, so NaN left there must not leak. Worked against a float64 merge of the used
    partials."""
    kern = tp._KERNELS.get()
    hq, splits, d = 3, 5, 16
    gen = torch.Generator().manual_seed(7)
    ws_out = torch.randn(1, hq, splits, d, generator=gen)
    ws_lse = torch.randn(1, hq, splits, generator=gen) * 4
    empty = torch.zeros(hq, splits, dtype=torch.bool)
    empty[:, [1, 3]] = True
    empty[2] = True  # head 2 saw no key at all: output 0
    ws_lse[0][empty] = float("-inf")
    ws_out[0][empty] = float("nan")
    out = torch.full((1, hq, d), 7.0)
    kern.paged_decode_merge[(1, hq)](
        ws_out,
        ws_lse,
        out,
        out,
        hq * d,
        d,
        hq * splits * d,
        splits * d,
        d,
        hq,
        splits,
        HEAD_DIM=d,
        D_PAD=d,
        S_PAD=8,
    )
    want = torch.zeros(hq, d, dtype=F64)
    for h in range(hq):
        used = ~empty[h]
        if used.any():
            w = torch.exp2(ws_lse[0, h, used].to(F64))
            want[h] = (w[:, None] * ws_out[0, h, used].to(F64)).sum(0) / w.sum()
    torch.testing.assert_close(out[0].to(F64), want, rtol=1e-6, atol=1e-6)


@needs_triton
def test_split_count_does_not_change_the_result():
    q, cache, table, lens = make_case(31, layout="HND", page=8, ratio=2, hkv=2, d=32, lens=[60, 33])
    ref = oracle(q, cache, table, lens, "HND")
    for splits in (1, 2, 4):
        close(
            tp.paged_decode(q, cache, table, lens, None, "HND", num_splits=splits, block_n=16),
            ref,
            torch.float32,
        )


@needs_triton
def test_bad_launch_parameters_raise_typed_errors():
    q, cache, table, lens = make_case(32, layout="NHD", page=8, ratio=1, hkv=1, d=16, lens=[3])
    with pytest.raises(InvalidInputError, match="block_n"):
        tp.paged_decode(q, cache, table, lens, block_n=24)
    wide = torch.zeros(1, 32, 16)  # 32 query heads on 1 KV head
    with pytest.raises(InvalidInputError, match="GQA group"):
        tp.paged_decode(wide, cache, table, lens)
    with pytest.raises(InvalidInputError, match="cu_seqlens_q"):
        tp.paged_attention(q, cache, table, lens, torch.tensor([0, 1], dtype=torch.int32), None, True, "NHD")
    # the kernels read every last dim with a unit stride: a strided block table or seq_lens would read wrong
    # ids
    wide_table = torch.zeros(table.shape[0], 2 * table.shape[1], dtype=table.dtype)
    wide_table[:, ::2] = table
    with pytest.raises(
        InvalidInputError,
        match=r"last strides of q, kv_cache, block_tables, seq_lens: expected 1 "
        r"each .*got \(1, 1, 2, 1\)",
    ):
        tp.paged_decode(q, cache, wide_table[:, ::2], lens)
    with pytest.raises(InvalidInputError, match=r"got \(1, 1, 1, 2\)"):
        tp.paged_decode(q, cache, table, torch.stack([lens, lens], 1)[:, 0])


# ------------------------------------------------------------------------------------------------ sizing
@pytest.mark.unit
@pytest.mark.parametrize(
    "batch,hkv,kv,sms,bn",
    [
        (1, 8, 32768, 132, 64),
        (64, 8, 4096, 132, 64),
        (3, 1, 17, 1, 16),
        (2, 4, 1000, 108, 32),
        (1, 1, 1, 132, 64),
        (5, 2, 9000, 78, 64),
    ],
)
def test_split_sizing_covers_every_position(batch, hkv, kv, sms, bn):
    split_len, splits = tp.choose_split_len(batch, hkv, kv, sms, bn)
    most = DEFAULT.max_splits
    assert split_len % bn == 0 and 1 <= splits <= most
    assert splits * split_len >= kv > (splits - 1) * split_len  # every split but the last is full
    if kv >= 2 * bn * most and batch * hkv * most <= DEFAULT.waves * sms:
        assert splits == most  # long context, small batch: as many splits as allowed


@pytest.mark.unit
def test_split_sizing_hand_worked():
    assert DEFAULT.waves == 4
    assert tp.choose_split_len(1, 8, 32768, 132, 64) == (1024, 32)  # ceil(528 / 8) = 66 -> capped at 32
    # ceil(528 / 32) = 17 splits wanted; ceil(512 tiles / 17) = 31 tiles = 1984 tokens; ceil(512 / 31) = 17
    assert tp.choose_split_len(4, 8, 32768, 132, 64) == (1984, 17)
    assert tp.choose_split_len(64, 8, 4096, 132, 64) == (2048, 2)  # ceil(528 / 512) = 2
    assert tp.choose_split_len(128, 8, 4096, 132, 128) == (4096, 1)  # 1024 pairs fill 4 waves alone
    assert tp.choose_split_len(1, 1, 100, 132, 64, num_splits=8) == (64, 2)  # forced, clipped to 2 tiles
    # batch 1 of 8 KV heads, the engine's 2080-token table: 17 tiles, 8 splits by the two-tile minimum -> 6 of
    # 3
    assert tp.choose_split_len(1, 8, 2080, 132, 128) == (384, 6)


@pytest.mark.unit
def test_sizing_docstring_examples():
    import doctest

    from layerzero.backends.triton import _paged_geometry  # the sizing rules' home (re-exported by paged)

    result = doctest.testmod(_paged_geometry)
    assert result.attempted >= 3 and result.failed == 0


def _ctx(
    *,
    device=None,
    seq_len_q=1,
    batch=8,
    hq=8,
    hkv=2,
    d=128,
    kv=4096,
    layout="NHD",
    page=16,
    dtype=torch.float16,
    capture=False,
    sms=132,
):
    return SelectionContext(
        op="paged_attention",
        device=device or cuda_device((9, 0), sms),
        dtype=dtype,
        batch=batch,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim=d,
        head_dim_v=d,
        seq_len_q=seq_len_q,
        seq_len_kv=kv,
        seq_equal=False,
        is_causal=True,
        graph_capture=capture,
        kv_layout=layout,
        page_size=page,
    )


def cuda_device(sm: tuple[int, int], sms: int | None = 132) -> DeviceSpec:
    return fake_cuda_device(sm, sms=sms)


@pytest.mark.unit
@pytest.mark.parametrize(
    "batch,hq,hkv,d,kv,sms",
    [
        (8, 8, 2, 128, 4096, 132),
        (1, 32, 8, 64, 32768, 132),
        (64, 16, 16, 256, 512, 78),
        (2, 4, 4, 40, 64, None),
        (1, 16, 8, 64, 3000, 132),
    ],
)
def test_workspace_bound_covers_every_batch_of_the_bucket(batch, hq, hkv, d, kv, sms):
    """Brute force: the declared bytes >= what paged_decode allocates for every batch 1..bucket and every
    max_blocks * P up to the bucket's seq_len_kv (sampled)."""
    ctx = _ctx(batch=batch, hq=hq, hkv=hkv, d=d, kv=kv, sms=sms)
    bound = tp.workspace_bytes(ctx)
    for b in range(1, batch + 1):
        for length in (1, kv // 3, kv // 2 + 1, kv, 2048):
            # as paged_decode picks them (small_batch for the smallest batches and tables)
            bn, most = tp.tile_rule(b, max(1, length), d, 2)
            _, splits = tp.choose_split_len(b, hkv, max(1, length), sms or 1, bn, max_splits=most)
            assert b * hq * splits * (d + 1) * 4 <= bound, (b, length)


# ------------------------------------------------------------------------------------------------ routing
@pytest.fixture
def registry():
    """A fresh registry: the paged_attention op, the reference and torch_sdpa paged kernels, and the Triton
    paged kernel of an available (fake-installed) triton backend."""
    RUNTIME.ensure_ready()
    reg = KernelRegistry()
    reg.add_op(RUNTIME.registry.ops.get("paged_attention"))
    ref = next(
        s for s in RUNTIME.registry.for_op("paged_attention") if s.kernel_id == "reference.paged_attention"
    )
    reg.add_backend(RUNTIME.registry.backend("reference"))
    reg.add_kernel(ref)
    reg.add_backend(RUNTIME.registry.backend("torch_sdpa"))
    for spec in sdpa_paged_specs():
        reg.add_kernel(spec)
    reg.add_backend(BackendSpec("triton", "triton", "3.6.0", True, (), "fake-installed triton"))
    for spec in tp.kernel_specs(True, ""):
        if spec.op == "paged_attention":  # the lse / cascade kernels serve other ops
            reg.add_kernel(spec)
    return reg


def run_select(reg, ctx):
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


def codes(report, kernel_id=tp.KERNEL_ID):
    return {r.code for r in report.candidate(kernel_id).reasons}


@pytest.mark.unit
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_chosen_over_sdpa_for_cuda_decode(registry, layout, dtype):
    plan, report = run_select(registry, _ctx(layout=layout, dtype=dtype))
    assert plan.kernel_id == tp.KERNEL_ID and plan.transforms == ()
    assert report.candidate("torch_sdpa.paged_attention").status.value == "eligible"
    assert (
        report.candidate(tp.KERNEL_ID).score.total
        > report.candidate("torch_sdpa.paged_attention").score.total
    )


@pytest.mark.unit
def test_refuses_prefill_with_a_reason(registry):
    """Prefill / append (cu_seqlens_q given) is not triton.paged_decode's: it says why, and the prefill kernel
    (triton.paged_prefill) takes the call instead of the per-sequence SDPA loop."""
    ctx = _ctx(seq_len_q=64)
    assert ctx.phase is Phase.PREFILL
    plan, report = run_select(registry, ctx)
    assert codes(report) == {R.SEQ_LEN_TOO_LONG}
    assert "decode only" in str(report.candidate(tp.KERNEL_ID).reasons[0])
    assert plan.kernel_id == "triton.paged_prefill"
    assert report.candidate("torch_sdpa.paged_attention").status.value == "eligible"


@pytest.mark.unit
def test_prefill_kernel_only_where_it_applies(registry):
    """triton.paged_prefill serves prefill on CUDA SM >= 8.0, quantized caches too; decode stays on
    triton.paged_decode (higher priority), old GPUs go to torch_sdpa.paged_attention with the reason."""
    plan, report = run_select(registry, _ctx())
    assert (
        plan.kernel_id == tp.KERNEL_ID and report.candidate("triton.paged_prefill").status.value == "eligible"
    )
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        plan, _ = run_select(registry, dataclasses.replace(_ctx(seq_len_q=64), kv_dtype=kv_dtype))
        assert plan.kernel_id == "triton.paged_prefill"
    plan, report = run_select(registry, _ctx(seq_len_q=64, device=cuda_device((7, 5))))
    assert plan.kernel_id == "torch_sdpa.paged_attention"
    assert R.SM_TOO_OLD in codes(report, "triton.paged_prefill")


@pytest.mark.unit
def test_refuses_cpu_old_gpus_big_groups_and_fp64(registry):
    cpu = DeviceSpec.detect("cpu")
    _, report = run_select(registry, _ctx(device=cpu))
    assert R.DEVICE_TYPE_UNSUPPORTED in codes(report)
    _, report = run_select(registry, _ctx(device=cuda_device((7, 5))))
    assert codes(report) == {R.SM_TOO_OLD}
    _, report = run_select(registry, _ctx(hq=64, hkv=2))
    assert codes(report) == {R.GQA_RATIO_INVALID}
    _, report = run_select(registry, _ctx(dtype=torch.float64))
    assert codes(report) == {R.DTYPE_UNSUPPORTED}
    _, report = run_select(registry, _ctx(d=512))
    assert codes(report) == {R.HEAD_DIM_TOO_LARGE}


@pytest.mark.unit
def test_graph_safe_choice_under_capture(registry):
    plan, report = run_select(registry, _ctx(capture=True))
    assert plan.kernel_id == tp.KERNEL_ID
    assert R.CUDA_GRAPH_UNSAFE in codes(report, "torch_sdpa.paged_attention")


@pytest.mark.unit
def test_spec_data_and_unavailable_callable():
    specs = tp.kernel_specs(True, "")
    assert [s.kernel_id for s in specs] == [
        "triton.paged_decode",
        "triton.paged_decode_lse",
        "triton.paged_prefill_lse",
        "triton.merge_attention_states",
        "triton.paged_prefill",
    ]
    spec = specs[0]
    assert (spec.kernel_id, spec.op, spec.priority, spec.sm_min) == (
        "triton.paged_decode",
        "paged_attention",
        40,
        (8, 0),
    )
    assert spec.graph_safe and spec.deterministic and spec.device_types == frozenset({"cuda"})
    assert spec.workspace_bytes(_ctx()) > 0
    missing = tp.kernel_specs(False, "triton is not installed")[0]
    with pytest.raises(BackendNotAvailableError, match="triton is not installed"):
        missing.fn(None, None, None, None, None, None, True, "NHD")


# ------------------------------------------------------------------- the fused split merge (knob fused_merge)
@needs_triton
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_two_kernel_merges_agree_with_the_oracle(fused, return_lse, monkeypatch, paged_knobs):
    """With several splits, the split that counts last merges (one launch) or stage 2 does (two launches): the
    same result against the float64 oracle either way (and the same lse), and the fused form leaves every
    counter at 0."""
    paged_knobs(fused_merge=fused)
    launches: list[str] = []
    real = tpl.launch_pinned
    monkeypatch.setattr(
        tpl,
        "launch_pinned",
        lambda fn, pin, grid, *a, **k: (launches.append(fn.__name__), real(fn, pin, grid, *a, **k)),
    )
    q, cache, table, lens = make_case(41, layout="NHD", page=4, ratio=3, hkv=2, d=24, lens=[37, 1, 64, 13])
    res = tp.paged_decode(q, cache, table, lens, None, "NHD", num_splits=5, block_n=16, return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    close(out, oracle(q, cache, table, lens, "NHD"), torch.float32)
    assert launches == (["paged_decode_split"] if fused else ["paged_decode_split", "paged_decode_merge"])
    if fused:
        assert not tp.split_counters(q, 8)[
            :8
        ].any()  # reset by the merging program, ready for the next launch
    if return_lse:
        _, ref_lse = reference_paged_lse(
            q.to(F64), cache.to(F64).nan_to_num(0.0), table, lens, None, None, True, "NHD"
        )
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    again = tp.paged_decode(q, cache, table, lens, None, "NHD", num_splits=5, block_n=16)
    torch.testing.assert_close(
        again, out, rtol=0, atol=0
    )  # counters were back at 0: the second call merges too


@needs_triton
def test_split_counters_are_per_stream_and_outgrown_buffers_stay_alive():
    from layerzero.backends.triton import _paged_common

    q = torch.zeros(1, 2, 8)
    first = tp.split_counters(q, 16)
    assert first.dtype == torch.int32 and first.numel() >= 16 and not first.any()
    assert tp.split_counters(q, 16) is first  # reused: a captured graph keeps pointing at it
    big = tp.split_counters(q, first.numel() + 1)
    assert (
        big is not first and big.numel() > first.numel() and any(t is first for t in _paged_common._OUTGROWN)
    )


@needs_triton
def test_capture_selection_keeps_the_two_kernel_merge(monkeypatch):
    """Under CUDA-graph capture (and ``lz.capture_selection``, eager calls as captured) the merge stays a
    second kernel (it replays faster; the fused form is for eager calls)."""
    import layerzero as lz

    launches: list[str] = []
    real = tpl.launch_pinned
    monkeypatch.setattr(
        tpl,
        "launch_pinned",
        lambda fn, pin, grid, *a, **k: (launches.append(fn.__name__), real(fn, pin, grid, *a, **k)),
    )
    q, cache, table, lens = make_case(42, layout="HND", page=8, ratio=2, hkv=2, d=16, lens=[40, 9])
    eager = tp.paged_decode(q, cache, table, lens, None, "HND", num_splits=4, block_n=16)
    assert launches == ["paged_decode_split"]
    with lz.capture_selection():
        captured = tp.paged_decode(q, cache, table, lens, None, "HND", num_splits=4, block_n=16)
    assert launches == ["paged_decode_split", "paged_decode_split", "paged_decode_merge"]
    torch.testing.assert_close(captured, eager, rtol=1e-6, atol=1e-6)


@needs_triton
def test_tiles_interleave_over_the_splits_of_a_wide_block_table(monkeypatch, paged_knobs):
    """The split count comes from the block table's width (graph-safe); a sequence far shorter than that width
    has its tiles spread over the splits (split s takes tiles s, s + S, ...), not all in split 0: with 4
    splits over a 64-tile width, a 3-tile sequence fills the partials of splits 0, 1, 2 and leaves split 3
    empty (-inf); a 9-tile one fills all four. The merged output matches the float64 oracle."""
    paged_knobs(fused_merge=False)  # two kernels: the partials stay in the workspace to read
    seen = {}
    real = tpl.launch_pinned

    def spy(fn, pin, grid, *a, **k):
        if fn.__name__ == "paged_decode_split":
            seen["ws_lse"] = a[5]
        return real(fn, pin, grid, *a, **k)

    monkeypatch.setattr(tpl, "launch_pinned", spy)
    q, cache, table, lens = make_case(
        43, layout="NHD", page=4, ratio=2, hkv=1, d=16, lens=[40, 140], spare_cols=256 - 35
    )  # 256 blocks of 4 = 1024 tokens = 64 tiles of 16
    out = tp.paged_decode(q, cache, table, lens, None, "NHD", num_splits=4, block_n=16)
    close(out, oracle(q, cache, table, lens, "NHD"), torch.float32)
    used = torch.isfinite(seen["ws_lse"])  # [B, Hq, S]
    assert used[0].all(0).tolist() == [True, True, True, False]  # 40 tokens: tiles 0, 1, 2 on splits 0, 1, 2
    assert used[1].all(0).tolist() == [True, True, True, True]  # 140 tokens: 9 tiles over all four


@needs_triton
@pytest.mark.parametrize(
    "max_bytes, want", [(1 << 40, ["paged_decode_split"]), (0, ["paged_decode_split", "paged_decode_merge"])]
)
def test_auto_fuses_the_merge_only_for_small_reads(max_bytes, want, monkeypatch, paged_knobs):
    """``fused_merge="auto"`` (the default): one launch when the most K/V bytes the call can read is at most
    ``fused_merge_max_bytes`` (host-bound calls), two above it (GPU-bound: the merge kernel is cheaper); the
    same result either way."""
    assert DEFAULT.fused_merge == "auto"
    paged_knobs(fused_merge_max_bytes=max_bytes)
    launches: list[str] = []
    real = tpl.launch_pinned
    monkeypatch.setattr(
        tpl,
        "launch_pinned",
        lambda fn, pin, grid, *a, **k: (launches.append(fn.__name__), real(fn, pin, grid, *a, **k)),
    )
    q, cache, table, lens = make_case(44, layout="NHD", page=4, ratio=2, hkv=2, d=16, lens=[30, 7, 61])
    out = tp.paged_decode(q, cache, table, lens, None, "NHD", num_splits=3, block_n=16)
    assert launches == want
    close(out, oracle(q, cache, table, lens, "NHD"), torch.float32)


@needs_triton
def test_small_batch_tiles_only_for_one_sequence_in_a_short_table(monkeypatch, paged_knobs):
    """``small_batch`` (1 sequence, tables up to 2048 tokens: 32-position tiles, at most 32 splits): a batch-1
    call with a 1024-token table launches 32-position tiles; two sequences, a table wider than 2048 tokens, or
    one narrower than 4 general tiles (one program a head, no merge: 112 tokens here), the general tiles
    (``block_n_for``: 128 at D 16 in float32); every call matches the float64 oracle."""
    seen: list[int] = []
    real = tpl.launch_pinned
    monkeypatch.setattr(
        tpl,
        "launch_pinned",
        lambda fn, pin, grid, *a, **k: (
            seen.append(k["BLOCK_N"]) if fn.__name__ == "paged_decode_split" else None,
            real(fn, pin, grid, *a, **k),
        ),
    )
    for lens, spare, want in (([70], 59, 32), ([70, 9], 59, 128), ([70], 2048 // 16, 128), ([70], 2, 128)):
        q, cache, table, lens_t = make_case(
            60, layout="NHD", page=16, ratio=2, hkv=1, d=16, lens=lens, spare_cols=spare
        )
        out = tp.paged_decode(q, cache, table, lens_t)
        close(out, oracle(q, cache, table, lens_t, "NHD"), torch.float32)
        assert seen[-1] == want, (lens, table.shape)
    most = DEFAULT.max_splits
    assert tp.tile_rule(1, 2048, 128, 2) == (32, 32) and tp.tile_rule(1, 2049, 128, 2) == (128, most)
    assert tp.tile_rule(1, 385, 128, 2) == (32, 32) and tp.tile_rule(1, 384, 128, 2) == (128, most)
    paged_knobs(small_batch=None)
    assert tp.tile_rule(1, 64, 128, 2) == (128, most)
