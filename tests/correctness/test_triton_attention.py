"""``triton.attention`` (FlashAttention-2 forward with in-kernel ALiBi) on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py when no CUDA device is visible), and its
selection on hand-built CUDA contexts.

The oracle is written here from the definitions, in float64, sharing no code with the library: scores
``scale q.k`` (GQA: query head h reads KV head ``h // (Hq / Hkv)``), the Gemma 2 soft-cap ``c tanh(s / c)``,
the ALiBi bias ``-slope[b, h] |i + Sk - Sq - j|`` (flash-attn's ``alibi_slopes`` docstring), lz.attention's
top-left causal mask ``j <= i`` and window ``i - left <= j <= i + right``, a softmax whose fully masked rows
are 0, times v. Tolerances per dtype (relative to the output's scale, as ``_shapes.mismatch``): float32 1e-5,
float16 1e-3, bfloat16 1e-2 (the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest).
Checks that the test can fail: the kernel's output is far from the oracle with the slope sign flipped, with no
slopes, and with top-left ALiBi positions (``|i - j|``) when Sq != Sk. The interpreter is slow, so shapes are
small (the whole file runs in well under a minute on 2 cores); tests/gpu/test_gpu_triton_attention.py covers
serving shapes on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _triton_interp import needs_interpreter  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.core.context import SelectionContext  # noqa: E402
from layerzero.core.errors import InvalidInputError  # noqa: E402
from layerzero.core.policy import Policy  # noqa: E402
from layerzero.core.reasons import ReasonCode as R  # noqa: E402
from layerzero.core.registry import KernelRegistry  # noqa: E402
from layerzero.core.runtime import RUNTIME  # noqa: E402
from layerzero.core.selection import SelectionInputs, select  # noqa: E402
from layerzero.core.specs import Layout, MaskKind  # noqa: E402
from layerzero.testing.devices import fake_cuda_device  # noqa: E402

pytestmark = pytest.mark.correctness
interp = needs_interpreter("tests/gpu/test_gpu_triton_attention.py")
KID = "triton.attention"
F64 = torch.float64
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------- oracle and cases


def oracle(q, k, v, slopes=None, causal=False, scale=None, window=None, softcap=None):
    """float64 attention from the definitions (module docstring); BHSD in, ``[B, Hq, Sq, Dv]`` float64 out, on
    q's device (the GPU tests run it there)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dev = q.device
    heads = torch.arange(hq, device=dev) // (hq // hkv)  # KV head of each query head
    qd, kd, vd = q.to(F64), k.to(F64)[:, heads], v.to(F64)[:, heads]
    s = torch.einsum("bhid,bhjd->bhij", qd, kd) * (1 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, dtype=F64, device=dev)[:, None]
    j = torch.arange(sk, dtype=F64, device=dev)[None, :]
    if slopes is not None:
        sl = slopes.to(device=dev, dtype=F64).reshape(-1, hq, 1, 1)  # [1 or B, Hq, 1, 1]
        s = s - sl * (i + (sk - sq) - j).abs()
    visible = torch.ones(sq, sk, dtype=torch.bool, device=dev)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a fully masked row: NaN -> 0
    return p @ vd


def slopes_for(hq: int, batch: int | None = None) -> torch.Tensor:
    """Press et al. 2022's ``2**(-8 (h + 1) / Hq)`` (float32); ``[B, Hq]`` with each batch row scaled when
    ``batch``."""
    s = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], dtype=torch.float32)
    return s if batch is None else torch.stack([s * (1 + 0.5 * r) for r in range(batch)])


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    dv: int
    causal: bool = False
    per_batch: bool = False
    scale: float | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None

    def tensors(self, seed: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(self.b, self.hq, self.sq, self.d, generator=g) * 1.5
        k = torch.randn(self.b, self.hkv, self.sk, self.d, generator=g) * 1.5
        v = torch.randn(self.b, self.hkv, self.sk, self.dv, generator=g)
        return q.to(dtype), k.to(dtype), v.to(dtype), slopes_for(self.hq, self.b if self.per_batch else None)


# every feature at least once: GQA / MQA, Sq != Sk both ways, decode, odd head dims, D != Dv, both slopes
CASES = [
    Case(2, 4, 2, 5, 9, 72, 72, causal=False, per_batch=True),
    Case(2, 4, 2, 5, 9, 72, 72, causal=True),
    Case(1, 6, 2, 13, 7, 80, 80, causal=True, per_batch=True),  # Sq > Sk, GQA 3
    Case(1, 4, 1, 1, 37, 64, 64),  # decode-like, MQA
    Case(3, 2, 2, 11, 11, 40, 24, causal=True, scale=0.3),  # D != Dv, explicit scale
    Case(1, 5, 5, 17, 30, 16, 16, per_batch=True),  # odd head count, Sq < Sk not causal
]


def mismatch(out, ref, dtype):
    """None when ``out`` is within TOL[dtype] of ``ref`` relative to ref's scale (per element, plus its own
    size)."""
    assert out.dtype == dtype and tuple(out.shape) == tuple(ref.shape), (out.dtype, out.shape, ref.shape)
    tol = TOL[dtype]
    scale = float(ref.abs().max()) or 1.0
    err = (out.to(F64) - ref).abs()
    bad = err > tol * scale + tol * ref.abs()
    return (
        None if not bool(bad.any()) else f"{int(bad.sum())}/{bad.numel()} off, worst {float(err.max()):.3g}"
    )


def run(case: Case, q, k, v, slopes, **kw):
    from layerzero.backends.triton.attention import attention

    return attention(q, k, v, None, case.causal, case.scale, 0.0, case.window, case.softcap, slopes, **kw)


# ----------------------------------------------------------------------------- kernel vs oracle


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_listed_cases_match_float64(dtype):
    failures = []
    for n, case in enumerate(CASES):
        q, k, v, slopes = case.tensors(n, dtype)
        want = oracle(q, k, v, slopes, case.causal, case.scale, case.window, case.softcap)
        msg = mismatch(run(case, q, k, v, slopes), want, dtype)
        if msg:
            failures.append(f"{case}: {msg}")
    assert not failures, "\n".join(failures)


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_seeded_random_shapes_match_float64(dtype):
    """Random odd shapes, flags, windows and soft-caps (seeded); each case once through the kernel."""
    rng = random.Random(1234)
    failures, seen = [], []
    for seed in range(10):
        hkv = rng.choice([1, 2, 3])
        causal = rng.random() < 0.5
        window = rng.choice([None, (rng.randint(0, 6), rng.choice([-1, rng.randint(0, 6)]))])
        if causal and window is not None:
            window = (window[0], 0)  # lz.attention's normalization under is_causal
        case = Case(
            rng.choice([1, 2]),
            hkv * rng.choice([1, 2, 4]),
            hkv,
            rng.randint(1, 23),
            rng.randint(1, 29),
            rng.choice([8, 24, 72, 80]),
            rng.choice([8, 24, 72, 80]),
            causal,
            rng.random() < 0.5,
            rng.choice([None, 0.2]),
            window,
            rng.choice([None, 4.0]),
        )
        q, k, v, slopes = case.tensors(seed, dtype)
        want = oracle(q, k, v, slopes, case.causal, case.scale, case.window, case.softcap)
        msg = mismatch(run(case, q, k, v, slopes), want, dtype)
        if msg:
            failures.append(f"{case}: {msg}")
        seen.append(case)
    assert not failures, "\n".join(failures)
    for what in (
        lambda c: c.hq > c.hkv,
        lambda c: c.sq != c.sk,
        lambda c: c.causal,
        lambda c: not c.causal,
        lambda c: c.per_batch,
        lambda c: c.window is not None,
        lambda c: c.softcap is not None,
        lambda c: c.d % 16 != 0,
    ):
        assert any(what(c) for c in seen)  # the seed covers every feature


@interp
def test_hand_worked_decode_row():
    """q = k = 0, one query over 3 keys, slope ln 2: the bias is ``-ln2 * |0 + 3 - 1 - j|`` = (-2 ln2, -ln2,
    0), so the weights are (1, 2, 4) / 7; v = identity rows gives them back."""
    q = torch.zeros(1, 1, 1, 16)
    k = torch.zeros(1, 1, 3, 16)
    v = torch.eye(3, 16)[None, None]
    out = run(Case(1, 1, 1, 1, 3, 16, 16), q, k, v, torch.tensor([math.log(2.0)]))
    torch.testing.assert_close(out[0, 0, 0, :3], torch.tensor([1 / 7, 2 / 7, 4 / 7]), rtol=1e-6, atol=1e-7)
    assert bool((out[0, 0, 0, 3:] == 0).all())


@interp
def test_the_checks_can_fail():
    """A wrong slope sign, no slopes, and top-left ALiBi positions (``|i - j|``) are each caught by the fp32
    tolerance. The alignment case is not causal: under the top-left causal mask with Sk >= Sq the two
    alignments differ by a constant per row (``Sk - Sq``), which the softmax cancels."""
    case = Case(1, 4, 2, 6, 11, 32, 32)
    q, k, v, slopes = case.tensors(3, torch.float32)
    out = run(case, q, k, v, slopes)
    assert mismatch(out, oracle(q, k, v, slopes), torch.float32) is None
    assert mismatch(out, oracle(q, k, v, -slopes), torch.float32) is not None
    assert mismatch(out, oracle(q, k, v, None), torch.float32) is not None
    i, j = torch.arange(case.sq, dtype=F64)[:, None], torch.arange(case.sk, dtype=F64)[None, :]
    bias = (
        -slopes.to(F64)[None, :, None, None] * (i - j).abs()
    )  # positions aligned top-left: wrong for Sq != Sk
    s = torch.einsum("bhid,bhjd->bhij", q.to(F64), k.to(F64)[:, [0, 0, 1, 1]]) / math.sqrt(case.d) + bias
    top_left = torch.softmax(s, -1) @ v.to(F64)[:, [0, 0, 1, 1]]
    assert mismatch(out, top_left, torch.float32) is not None
    causal = run(Case(1, 4, 2, 6, 11, 32, 32, causal=True), q, k, v, slopes)
    assert mismatch(causal, oracle(q, k, v, slopes, causal=True), torch.float32) is None
    assert mismatch(causal, oracle(q, k, v, slopes), torch.float32) is not None  # the causal mask is applied


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_matches_the_oracle_and_is_deterministic(dtype):
    """Forced KV splits (FlashDecoding) on a decode-like and a causal call: every split count gives the
    oracle's answer (more splits than key tiles leaves splits empty), and a call repeated gives the same
    bits."""
    for case in (Case(2, 4, 2, 1, 150, 64, 64, per_batch=True), Case(1, 2, 1, 9, 70, 24, 24, causal=True)):
        q, k, v, slopes = case.tensors(5, dtype)
        want = oracle(q, k, v, slopes, case.causal)
        for splits in (1, 3, 16):
            out = run(case, q, k, v, slopes, num_splits=splits)
            assert mismatch(out, want, dtype) is None, (case, splits)
        assert torch.equal(run(case, q, k, v, slopes, num_splits=3), run(case, q, k, v, slopes, num_splits=3))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_tiles_take_many_steps(dtype):
    """Forced 16 x 16 tiles (the smallest config_for may pick on a 99 KB GPU): many token tiles per head group
    and many key steps per tile, so the online softmax rescales across steps and the causal / window key
    ranges are cut per tile; an MQA group of 24 query heads, more than a tile's 16 rows, split into two
    sub-groups of 12."""
    from layerzero.backends.triton.attention import TileConfig

    for case in (
        Case(1, 4, 2, 37, 83, 24, 24, causal=True, per_batch=True),
        Case(1, 12, 2, 5, 60, 16, 16, window=(9, 4), softcap=2.0),
        Case(1, 24, 1, 3, 40, 16, 16, per_batch=True),
    ):
        q, k, v, slopes = case.tensors(11, dtype)
        want = oracle(q, k, v, slopes, case.causal, case.scale, case.window, case.softcap)
        out = run(case, q, k, v, slopes, config=TileConfig(16, 16, 4, 1))
        assert mismatch(out, want, dtype) is None, case


@interp
def test_window_softcap_and_fully_masked_rows():
    """A window that leaves rows with no key (Sq > Sk, window (0, 1)): those rows are 0, like the reference;
    with ALiBi and a soft-cap on; window alone without slopes too (the kernel takes alibi_slopes=None)."""
    case = Case(1, 4, 2, 12, 5, 24, 24, window=(0, 1), softcap=3.0)
    q, k, v, slopes = case.tensors(9, torch.float32)
    out = run(case, q, k, v, slopes)
    assert mismatch(out, oracle(q, k, v, slopes, False, None, (0, 1), 3.0), torch.float32) is None
    assert bool((out[:, :, 6:] == 0).all())  # query i >= 6 sees keys j in [i, i + 1], none < Sk = 5
    plain = run(case, q, k, v, None)
    assert mismatch(plain, oracle(q, k, v, None, False, None, (0, 1), 3.0), torch.float32) is None


@interp
def test_bshd_views_strided_rows_and_output_order():
    """BSHD memory passed as BHSD views (what lz.attention's layout adapter hands the kernel) and q rows that
    are slices of wider ones: same answer, and the output keeps q's memory order."""
    case = Case(2, 4, 2, 7, 10, 40, 40, causal=True, per_batch=True)
    q, k, v, slopes = case.tensors(2, torch.float16)
    want = oracle(q, k, v, slopes, True)
    qs = torch.zeros(2, 7, 4, 48, dtype=torch.float16)
    qs[..., :40] = q.transpose(1, 2)
    out = run(
        case,
        qs[..., :40].transpose(1, 2),
        k.transpose(1, 2).contiguous().transpose(1, 2),
        v.transpose(1, 2).contiguous().transpose(1, 2),
        slopes,
    )
    assert mismatch(out, want, torch.float16) is None
    assert out.transpose(1, 2).is_contiguous()


@interp
@pytest.mark.parametrize("dv", [8, 24])
def test_padded_value_head_dim_loads_mask_rows_only(dv, monkeypatch):
    """The H200 sweep's seed 15036 (B 3, Hq 6 / Hkv 3, Sq 31, Sk 63, D 72, Dv 8, BSHD, scale 0.0633; fp16 and
    bf16 wrong in almost every element) and its Dv 24 sibling: a V tile padded past Dv (Dv < 16, or not a
    power of two) is read with a row mask only, every column in bounds (columns >= Dv re-read column Dv - 1),
    because Triton 3.6's sm_90 code for a Dv-masked V tile feeding the P @ V wgmma was wrong (values, or an
    illegal address). The interpreter computes the masked load right, so the test records the loads that
    touch V's storage and checks their masks and addresses; and the answer against the oracle."""
    from triton.runtime import interpreter

    case = Case(3, 6, 3, 31, 63, 72, dv, scale=0.06325683461814241)
    q, k, v, slopes = case.tensors(15036, torch.float16)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # BSHD memory
    lo, size = v.data_ptr(), v.untyped_storage().nbytes()
    v_loads = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, other, *rest):
        # A load is V's when an address it really reads (mask true) lies in V's storage. Masked-off lanes are
        # never read and may point anywhere: K's D-padded columns past K's end can land in V's storage when
        # the allocator put V right after K (it did in CI), which is not a V load.
        addr, m = ptrs.data, mask.data
        if addr.ndim == 2 and ((addr >= lo) & (addr < lo + size) & m).any():
            v_loads.append((addr.copy(), m.copy()))
        return load(self, ptrs, mask, other, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", spy)
    out = run(case, q, k, v, slopes)
    monkeypatch.undo()
    assert v_loads
    es = v.element_size()
    for addr, mask in v_loads:
        assert (mask == mask[:, :1]).all(), "a V tile masked along Dv"
        rows = addr[mask[:, 0]]  # the loaded rows: each reads columns 0 .. Dv - 1 of one V row, no further
        first, last = rows.min(1), rows.max(1)
        assert rows.size and ((first - lo) % (dv * es) == 0).all() and (last - first == (dv - 1) * es).all()
    assert mismatch(out, oracle(q, k, v, slopes, scale=case.scale), torch.float16) is None


@interp
def test_direct_calls_refuse_what_the_kernel_does_not_do():
    case = Case(1, 2, 2, 3, 3, 16, 16)
    q, k, v, slopes = case.tensors(0, torch.float32)
    from layerzero.backends.triton.attention import attention

    with pytest.raises(InvalidInputError, match="attn_mask"):
        attention(q, k, v, torch.ones(3, 3, dtype=torch.bool), False, None, 0.0, None, None, slopes)
    with pytest.raises(InvalidInputError, match="dropout_p"):
        attention(q, k, v, None, False, None, 0.1, None, None, slopes)
    big = torch.zeros(1, 2, 3, 264)
    with pytest.raises(InvalidInputError, match="head dims"):
        attention(big, big, big, None, False, None, 0.0, None, None, slopes)


def test_tile_plan_helpers():
    from layerzero.backends.triton.attention import config_for, splits_for, sub_group_for

    h100, a100, ada = 232448, 166912, 101376
    assert config_for(torch.bfloat16, 128, 128, 4096, h100) == (128, 64, 8, 3)
    assert config_for(torch.bfloat16, 128, 128, 4096, a100) == (128, 64, 8, 3)  # 128 KB estimate
    assert config_for(torch.bfloat16, 128, 128, 4096, ada) == (128, 32, 8, 2)  # 64 KB: fits 99 KB
    assert config_for(torch.float16, 256, 256, 4096, h100).rows == 64
    assert (
        config_for(torch.bfloat16, 128, 128, 4, h100).rows == 16
    )  # decode: heads of the group fill the tile
    assert config_for(torch.float32, 80, 80, 1000, h100)[:2] == (64, 32)
    for dtype in DTYPES:  # every config fits its budget and keeps tl.dot's 16-element minimum
        for d in (16, 64, 80, 128, 256):
            for smem in (h100, a100, ada):
                cfg = config_for(dtype, d, d, 4096, smem)
                dp, size = max(16, 1 << (d - 1).bit_length()), dtype.itemsize
                assert (cfg.rows * dp + cfg.num_stages * cfg.block_n * 2 * dp) * size <= 0.85 * smem, (
                    dtype,
                    d,
                    cfg,
                )
                assert cfg.rows >= 16 and cfg.block_n >= 16 and cfg.num_stages >= 1
    assert [sub_group_for(g, 16) for g in (1, 4, 6, 7, 32, 48)] == [1, 4, 6, 7, 16, 16]
    assert splits_for(528, 64, 132, 1024) == 1  # the grid is full: no split
    assert splits_for(8, 64, 132, 1024) == 16  # decode, B1 Hkv8 Sk4096: 16 splits of 4 tiles
    assert splits_for(8, 6, 132, 1024) == 1  # too few key tiles to split


# ----------------------------------------------------------------------------- selection on CUDA contexts


def _select(ctx, registry=None):
    RUNTIME.ensure_ready()
    inputs = SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False)
    return select(registry or RUNTIME.registry, ctx, inputs)


def _ctx(sm=(9, 0), dtype=torch.bfloat16, alibi=True, **kw):
    fields = dict(
        op="attention",
        device=fake_cuda_device(sm),
        dtype=dtype,
        batch=2,
        num_heads_q=16,
        num_heads_kv=4,
        head_dim=128,
        head_dim_v=128,
        seq_len_q=1024,
        seq_len_kv=1024,
        seq_equal=True,
        layout=Layout.BHSD,
        is_causal=True,
        has_alibi=True if alibi else None,
    )
    fields.update(kw)
    return SelectionContext(**fields)


def _codes(report, kernel_id=KID):
    return {r.code for r in report.candidate(kernel_id).reasons}


@pytest.mark.parametrize("sm", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alibi_calls_on_cuda_pick_triton_attention(sm, dtype):
    """Every other installed CUDA kernel refuses ALiBi except SDPA math (20) and the reference (0);
    FlashAttention 2 (90, ALiBi natively) is not installed here."""
    plan, report = _select(_ctx(sm, dtype))
    assert plan.kernel_id == KID and plan.transforms == ()
    for ctx in (
        _ctx(sm, dtype, seq_len_q=1, seq_len_kv=4096, seq_equal=False, is_causal=False),
        _ctx(sm, dtype, graph_capture=True),
        _ctx(sm, dtype, window_left=63, window_right=0, has_softcap=True),
        _ctx(sm, dtype, head_dim=64, head_dim_v=16, num_heads_kv=16),
    ):
        assert _select(ctx)[0].kernel_id == KID, ctx
    bshd = _select(_ctx(sm, dtype, layout=Layout.BSHD))[0]
    assert bshd.kernel_id == KID and bshd.transforms  # a transposed view, no copy


def test_priority_sits_between_sdpa_math_and_flash_attn2():
    RUNTIME.ensure_ready()
    reg = RUNTIME.registry
    prio = reg.kernel(KID).priority
    assert reg.kernel("torch_sdpa.math").priority < prio < reg.kernel("flash_attn2.attention").priority
    assert reg.kernel("flash_attn2.attention").supports_alibi


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"alibi": False}, R.ALIBI_REQUIRED),
        ({"mask": MaskKind.FLOAT}, R.MASK_UNSUPPORTED),
        ({"mask": MaskKind.BOOL, "is_causal": False}, R.MASK_UNSUPPORTED),
        ({"dropout": True}, R.DROPOUT_UNSUPPORTED),
        ({"requires_grad": True}, R.BACKWARD_UNSUPPORTED),
        ({"sm": (7, 5), "dtype": torch.float16}, R.SM_TOO_OLD),
        ({"dtype": torch.float64}, R.DTYPE_UNSUPPORTED),
        ({"head_dim": 512, "head_dim_v": 512}, R.HEAD_DIM_TOO_LARGE),
        ({"stride_last_1": False}, R.STRIDE_LAST_DIM_NOT_1),
    ],
)
def test_refusals_carry_their_reason(kw, code):
    plan, report = _select(_ctx(**kw))
    assert plan.kernel_id != KID
    assert _codes(report) == {code}
    if code is R.BACKWARD_UNSUPPORTED:  # eager autograd: SDPA math with the float32 bias keeps the gradients
        assert plan.kernel_id == "torch_sdpa.math"


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"is_causal": False},
        {"seq_len_q": 1, "seq_len_kv": 4096, "seq_equal": False},
        {"dtype": torch.float32},
        {"num_heads_kv": 16},
        {"mask": MaskKind.FLOAT},
        {"graph_capture": True},
        {"window_left": 127, "window_right": 0},
        {"head_dim": 80, "head_dim_v": 80},
        {"layout": Layout.BSHD},
        {"sm": (8, 0), "dtype": torch.float16},
        {"has_softcap": True},
    ],
)
def test_plain_calls_choose_what_they_chose_without_it(kw):
    """Non-ALiBi calls on CUDA: triton.attention refuses them (ALIBI_REQUIRED), so the pick equals the pick of
    the same registry without it."""
    RUNTIME.ensure_ready()
    without = KernelRegistry()
    without.add_op(RUNTIME.registry.ops.get("attention"))
    for spec in RUNTIME.registry.for_op("attention"):
        if spec.kernel_id != KID:
            if spec.backend not in without.backends:
                without.add_backend(RUNTIME.registry.backend(spec.backend))
            without.add_kernel(spec)
    ctx = _ctx(alibi=False, **kw)
    plan, report = _select(ctx)
    assert plan.kernel_id == _select(ctx, without)[0].kernel_id != KID
    assert _codes(report) >= {R.ALIBI_REQUIRED}


@pytest.mark.parametrize(("d", "dv"), [(80, 80), (72, 8), (72, 24), (128, 8), (48, 64)])
def test_padded_head_dims_are_refused_on_cuda(d, dv):
    """A head dim that is not a power of two >= 16 needs a padded tile, which gave wrong outputs on an H200
    (Triton 3.6; the 2026-11-29 GPU suite): refused with HEAD_DIM_NOT_ALIGNED, so SDPA math serves it."""
    plan, report = _select(_ctx(head_dim=d, head_dim_v=dv))
    assert plan.kernel_id != KID and R.HEAD_DIM_NOT_ALIGNED in _codes(report)
    assert _select(_ctx(head_dim=64, head_dim_v=32))[0].kernel_id == KID  # unpadded dims still run here


def test_cpu_alibi_calls_do_not_pick_it():
    q = k = v = torch.randn(1, 2, 4, 16)
    report = lz.explain("attention", q, k, v, alibi_slopes=torch.ones(2))
    assert report.chosen != KID and _codes(report) == {R.DEVICE_TYPE_UNSUPPORTED}
