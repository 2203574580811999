"""``triton.gemv`` (``lz.linear`` for 1-8 rows) on CPU through the Triton interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py when no CUDA device is visible), against a float64 product: seeded odd shapes (N, K
not multiples of the tiles), both kernel paths (1 row and 2-8 rows), with and without bias, strided rows. Plus
its KernelSpec's routing on hand-built contexts (rows, device, dtype, autograd)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _triton_interp import needs_interpreter

from layerzero.backends.triton import gemv as tg
from layerzero.core.context import SelectionContext
from layerzero.core.knobs import knobs
from layerzero.core.policy import Policy
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.selection import SelectionInputs, select
from layerzero.testing.devices import fake_cuda_device
from layerzero.testing.registries import routing_registry

pytestmark = pytest.mark.correctness

interpreted = needs_interpreter("tests/gpu/test_gpu_triton_gemv.py")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def gemv_knobs():
    """``gemv_knobs(field=value, ...)``: set ``triton.gemv`` knobs until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(knobs(tg.KNOBS, **fields))


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


CASES = [  # (M, N, K): every branch of gemv.config without the prefetch kernel, odd sizes
    (1, 37, 129),  # row kernel, BM 1
    (2, 5, 3001),  # row kernel, BN 2 (long K)
    (5, 70, 33),  # row kernel, BM 8 (rows padded)
    (1, 3000, 40),  # wide N, one row: row kernel BN 8
    (3, 3000, 40),  # wide N, rows: tl.dot BN 32
    (8, 4100, 2050),  # tl.dot BN 64, BK 256, K >= 2048
    (1, 17000, 16),  # LM-head width: tl.dot even for one row
    (1, 1, 7),
]


# (M, N, K) for _gemv_prefetch: every slab width (BN 8, 4, 2, 1 via KP), padded rows, odd sizes
PREFETCH_CASES = [
    (1, 37, 129),  # KP 256, BN 8, N not a multiple of BN
    (2, 5, 3001),  # KP 4096, BN 2
    (3, 70, 33),  # rows padded to 4
    (4, 30, 1030),  # KP 2048, BN 4, every row
    (3, 9, 4096),  # K = prefetch_max_k exactly
    (1, 1, 7),
]


ONE_DTYPE = {(1, 3000, 40): torch.bfloat16, (8, 4100, 2050): torch.float16, (1, 17000, 16): torch.bfloat16}
"""The costly cases (3-6 s each in the interpreter) run in one dtype each, alternating; the rest in both."""
PARAMS = [
    pytest.param(dtype, prefetch, *c, id=f"{prefetch}-{c[0]}-{c[1]}-{c[2]}-{name}")
    for prefetch, cases in ((False, CASES), (True, PREFETCH_CASES))
    for c in cases
    for dtype, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16"))
    if prefetch or ONE_DTYPE.get(c, dtype) == dtype
]


@interpreted
@pytest.mark.parametrize(("dtype", "prefetch", "m", "n", "k"), PARAMS)
def test_matches_float64_product(dtype, prefetch, m, n, k, gemv_knobs):
    gemv_knobs(prefetch=prefetch)
    assert (tg.config(m, n, k)["kernel"] == "prefetch") == prefetch
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k + 3, generator=g).to(dtype)[:, 3:]  # rows strided by K + 3
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if (m + n) % 2 else None
    out = tg.gemv(x, w, b)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    assert _rel_err(out, want) <= TOL[dtype]


@interpreted
def test_leading_dims_and_empty_rows():
    x = torch.randn(2, 1, 3, 16).half()
    w = torch.randn(9, 16).half()
    out = tg.gemv(x, w, None)
    assert out.shape == (2, 1, 3, 9)
    assert _rel_err(out, x.double() @ w.double().t()) <= TOL[torch.float16]
    assert tg.gemv(x[:0], w, None).shape == (0, 1, 3, 9)


def test_config_covers_every_path(gemv_knobs):
    # one row: the next kernel launches before this one's PDL wait (trigger_first_rows); two rows or more:
    # after it
    assert tg.config(1, 6144, 1024) == {
        "kernel": "prefetch",
        "BM": 1,
        "BN": 8,
        "KP": 1024,
        "num_warps": 2,
        "TRIGGER_FIRST": True,
    }
    assert "TRIGGER_FIRST" not in tg.config(2, 4096, 1024)
    # the longest K (next_pow2 = 4096): slabs of 16384 (BN 4), 8 warps; a per-shape override wins
    assert tg.config(3, 1024, 3072) == {"kernel": "prefetch", "BM": 4, "BN": 4, "KP": 4096, "num_warps": 8}
    gemv_knobs(prefetch_by_shape=(((1024, 3072), (8192, 4)),))
    assert tg.config(3, 1024, 3072)["BN"] == 2 and tg.config(3, 1024, 3072)["num_warps"] == 4
    assert tg.config(1, 151936, 1024)["kernel"] == "dot" and tg.config(1, 1024, 4097)["kernel"] == "rows"
    assert [tg.config(m, 4096, 1024)["kernel"] for m in (1, 2, 3)] == ["prefetch", "prefetch", "dot"]
    assert [tg.config(m, 1024, 2048)["kernel"] for m in (4, 5)] == ["prefetch", "rows"]
    assert tg.config(2, 6144, 1024)["kernel"] == "dot"
    gemv_knobs(trigger_first_rows=0)
    assert "TRIGGER_FIRST" not in tg.config(1, 6144, 1024)
    gemv_knobs(prefetch=False)
    assert tg.config(1, 1024, 2048)["kernel"] == "rows" and tg.config(3, 1024, 2048)["BM"] == 4
    assert tg.config(1, 6144, 1024)["kernel"] == "rows" and tg.config(4, 6144, 1024)["kernel"] == "dot"
    assert tg.config(1, 151936, 1024)["kernel"] == "dot" and tg.config(2, 1024, 3072)["BN"] == 2


# ------------------------------------------------------------------------------------------------ routing
@pytest.fixture
def registry():
    """The linear op with the reference, torch_native and (fake-installed) triton kernels."""
    return routing_registry("linear", [tg.kernel_spec(True, "")])


def _ctx(device, rows, dtype=torch.bfloat16, grad=False, capture=False):
    return SelectionContext(
        op="linear",
        device=device,
        dtype=dtype,
        batch=rows,
        hidden_size=2048,
        intermediate_size=1024,
        requires_grad=grad,
        graph_capture=capture,
    )


def _select(reg, ctx):
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


@pytest.mark.unit
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("capture", [False, True])
def test_the_default_for_decode_rows(registry, rows, capture):
    """Chosen for 1-8 rows on CUDA fp16/bf16, eagerly and under capture, ranked above cuBLAS (see
    gemv.PRIORITY); cuBLAS stays eligible, next in line."""
    from layerzero.core.report import CandidateStatus

    plan, report = _select(registry, _ctx(fake_cuda_device((9, 0)), rows, capture=capture))
    assert plan.kernel_id == tg.KERNEL_ID
    assert report.candidate("torch_native.linear").status is CandidateStatus.ELIGIBLE
    assert tg.kernel_spec(True, "").priority > 50 and tg.kernel_spec(True, "").capture_priority is None


@pytest.mark.unit
def test_refused_beyond_eight_rows_on_cpu_fp32_and_with_grad(registry):
    from layerzero.core.device import DeviceSpec

    h100 = fake_cuda_device((9, 0))
    for ctx, code in (
        (_ctx(h100, 9), R.SHAPE_MISMATCH),
        (_ctx(h100, 64), R.SHAPE_MISMATCH),
        (_ctx(DeviceSpec.detect("cpu"), 1), R.DEVICE_TYPE_UNSUPPORTED),
        (_ctx(h100, 1, dtype=torch.float32), R.DTYPE_UNSUPPORTED),
        (_ctx(h100, 1, grad=True), R.BACKWARD_UNSUPPORTED),
        (_ctx(fake_cuda_device((7, 5)), 1), R.SM_TOO_OLD),
    ):
        _, report = _select(registry, ctx)
        assert code in {r.code for r in report.candidate(tg.KERNEL_ID).reasons}


def test_wide_prefetch_for_one_row_of_an_lm_head(gemv_knobs):
    """``prefetch_wide`` (an A/B knob, off by default): one row of a weight wider than 16384 outputs goes to
    the prefetch kernel with that slab and warps (BN = slab / next_pow2(K), at most 8; the kernel's numerics
    are the prefetch cases above), two rows and narrower weights keep their kernels."""
    assert tg.GemvKnobs().prefetch_wide is None and tg.config(1, 151936, 1024)["kernel"] == "dot"
    gemv_knobs(prefetch_wide=(4096, 1))
    assert tg.config(1, 151936, 1024) == {
        "kernel": "prefetch",
        "BM": 1,
        "BN": 4,
        "KP": 1024,
        "num_warps": 1,
        "TRIGGER_FIRST": True,
    }
    assert tg.config(2, 151936, 1024)["kernel"] == "dot" and tg.config(1, 16384, 1024)["BN"] == 8
    assert tg.config(1, 151936, 8192)["kernel"] == "dot"  # K past the slab limit
    gemv_knobs(prefetch=False)
    assert tg.config(1, 151936, 1024)["kernel"] == "dot"
