"""``triton.quantized_linear``'s int4 decode kernel (``_qgemv_int4``, 1-8 rows) under the Triton interpreter,
against a float64 oracle written out here: each element's code picked from its byte by arithmetic
(``byte % 16`` for even columns, ``byte // 16`` for odd ones), minus its group's zero point, times its group's
scale, then ``x.double() @ w.T + bias``. Seeded random shapes: N odd or not a multiple of the column tile, K =
G x (groups) with group counts that are not powers of two (the kernel's two-part slabs) or not multiples of a
chunk (its loop mode), groups of 32 / 64 / 128, every row count 1-8, with and without bias, float16 (tolerance
1e-3 of the output's largest magnitude) and bfloat16 (1e-2; the interpreter also truncates float32 -> bfloat16
where the GPU rounds to nearest, up to one ulp). Mutants of the kernel's source (nibbles swapped, zero point
dropped, the high nibble's 1/16 left out, x's even and odd elements swapped) must fail the same check. The
compiled kernel on a GPU: tests/gpu/test_gpu_quantized_linear.py."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest
import torch
from _triton_interp import needs_interpreter

import layerzero as lz
from layerzero.backends.triton import quantized_linear as tq
from layerzero.core.knobs import knobs

pytestmark = pytest.mark.correctness
interpreted = needs_interpreter("tests/gpu/test_gpu_quantized_linear.py")
TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
KERNEL_FILE = pathlib.Path(tq.__file__).with_name("_qgemv_int4_kernels.py")


def int4_weight_f64(qt: lz.QuantizedTensor) -> torch.Tensor:
    """float64 ``[N, K]`` of an int4 weight, one element at a time: column c's code is byte ``c // 2`` of its
    row, ``% 16`` for even c (the low nibble), ``// 16`` for odd c; minus the zero point of group ``c // G``,
    times its scale."""
    n, k = qt.shape
    col = torch.arange(k)
    byte = qt.data.to(torch.int64)[:, col // 2]
    code = torch.where(col % 2 == 0, byte % 16, byte // 16).to(torch.float64)
    grp = col // qt.group_size
    return (code - qt.zero_point.to(torch.float64)[:, grp]) * qt.scale.to(torch.float64)[:, grp]


def _cases(seed: int, group: int, count: int, max_groups: int = 7) -> list[tuple[int, int, int, bool]]:
    """``count`` seeded ``(M, N, K, bias)``: M cycling through 1..8 from a seeded start, N in 1..70 (odd or
    not a multiple of any column tile), K = group x 1..max_groups groups."""
    rng = random.Random(seed)
    first = rng.randrange(8)
    return [
        (
            (first + i) % 8 + 1,
            rng.randrange(1, 71) | rng.randrange(2),
            group * rng.randrange(1, max_groups + 1),
            rng.random() < 0.5,
        )
        for i in range(count)
    ]


def _run(m, n, k, group, dtype, bias, seed):
    """(kernel output, float64 oracle) of one case."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype) * 0.1
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    qt = lz.quantize(w, "int4", group_size=group)
    assert tq.config(m, n, k, group)["kernel"] == "int4"
    out = tq.quantized_linear(x, qt, b)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    want = x.double() @ int4_weight_f64(qt).t() + (0 if b is None else b.double())
    return out, want


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def check_cases(cases, group, dtype, seed) -> None:
    """Every case within the dtype's tolerance (an AssertionError naming the case otherwise)."""
    for i, (m, n, k, bias) in enumerate(cases):
        out, want = _run(m, n, k, group, dtype, bias, seed + i)
        err = _rel_err(out, want)
        assert err <= TOL[dtype], f"M={m} N={n} K={k} G={group} bias={bias} {dtype}: relative error {err:.2e}"


@interpreted
@pytest.mark.parametrize(  # each group size once, both dtypes (all six pairs cost CI 30 s in the interpreter)
    ("group", "dtype"),
    [(32, torch.bfloat16), (64, torch.float16), (128, torch.bfloat16)],
    ids=["32-bf16", "64-f16", "128-bf16"],
)
def test_slab_mode_matches_the_float64_oracle(group, dtype):
    """The whole rows held at once (K <= ``int4_chunk_k``): one or two power-of-two parts (e.g. 3 groups as
    2 + 1, 7 as 4 + 4 with one masked), M 1-8, odd N, with and without bias."""
    cases = _cases(seed=group, group=group, count=12)
    assert {m for m, *_ in cases} == set(range(1, 9))
    check_cases(cases, group, dtype, seed=1000 * group)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_loop_mode_matches_the_float64_oracle(dtype):
    """Rows longer than a chunk: chunks of 2 groups (``int4_chunk_k`` lowered so that small K loops), the last
    chunk partly masked for odd group counts, the next chunk's loads double-buffered."""
    with knobs(tq.KNOBS, int4_chunk_k=64):
        cases = [(1, 37, 32 * 5, True), (3, 9, 32 * 4, False), (8, 20, 32 * 7, True)]
        for m, n, k, _ in cases:
            cfg = tq.config(m, n, k, 32)
            assert cfg["NGA"] == 2 and cfg["NGB"] == 0 and cfg["NG"] > 2  # the loop mode
        check_cases(cases, 32, dtype, seed=77)


@interpreted
def test_qwen_like_widths_and_strided_rows():
    """K of a Qwen3-0.6B projection (3072: 24 groups of 128 as 16 + 8) on a few rows, x a strided view."""
    g = torch.Generator().manual_seed(5)
    k = 3072
    x = torch.zeros(3, k + 40, dtype=torch.float16)
    x[:, 16 : 16 + k] = torch.randn(3, k, generator=g).to(torch.float16)
    qt = lz.quantize((torch.randn(11, k, generator=g) * 0.05).to(torch.float16), "int4", group_size=128)
    xv = x[:, 16 : 16 + k]
    out = tq.quantized_linear(xv, qt, None)
    assert _rel_err(out, xv.double() @ int4_weight_f64(qt).t()) <= TOL[torch.float16]
    assert tq.config(3, 11, k, 128)["NGA"] == 16 and tq.config(3, 11, k, 128)["NGB"] == 8


@interpreted
def test_the_old_row_kernel_still_runs_with_the_knob_off():
    """``int4_decode=False`` (A/B benchmarks) routes int4 decode rows back to ``_qgemv_rows``."""
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    qt = lz.quantize(
        torch.randn(37, 96, generator=torch.Generator().manual_seed(4)).to(torch.float16),
        "int4",
        group_size=32,
    )
    with knobs(tq.KNOBS, int4_decode=False):
        assert tq.config(2, 37, 96, 32)["kernel"] == "rows"
        assert _rel_err(tq.quantized_linear(x, qt, None), x.double() @ int4_weight_f64(qt).t()) <= 2e-3


def test_the_oracle_decodes_a_hand_packed_row():
    """The oracle itself: codes 0..15 packed low nibble first (byte = c[2i] + 16 c[2i+1]), zero point 8,
    scales 1 and 0.5 for the two groups of 16."""
    codes = torch.arange(32) % 16
    data = (codes[0::2] + 16 * codes[1::2]).to(torch.uint8).view(1, 16)
    qt = lz.QuantizedTensor(
        data,
        torch.tensor([[1.0, 0.5]]),
        torch.tensor([[8, 8]], dtype=torch.uint8),
        None,
        lz.QuantFormat.INT4,
        torch.Size([1, 32]),
        torch.float32,
        None,
        16,
    )
    want = torch.cat([codes[:16] - 8.0, (codes[16:] - 8.0) * 0.5]).double()
    assert torch.equal(int4_weight_f64(qt)[0], want)
    assert torch.equal(lz.dequantize(qt)[0].double(), want)


# ------------------------------------------------------------- mutation check: the test must catch these bugs
MUTANTS = {
    "nibbles-swapped": [
        ("((b & 15) | MB)", "((b >> 4) | MB)"),
        ("((b & 240) | MB)", "(((b & 15) << 4) | MB)"),
    ],
    "zero-point-dropped": [
        ("z = zero.to(tl.float32)[:, :, None]", "z = zero.to(tl.float32)[:, :, None] * 0.0")
    ],
    "high-nibble-unscaled": [("axis=2) * 0.0625", "axis=2) * 0.125")],
    "even-odd-x-swapped": [
        ("xe = tl.load(Xrow + k,", "xe = tl.load(Xrow + k + 1,"),
        ("xo = tl.load(Xrow + k + 1,", "xo = tl.load(Xrow + k,"),
    ],
}


def _mutant_module(name: str, tmp_path: pathlib.Path):
    """``_qgemv_int4_kernels`` with MUTANTS[name] applied to its source (each pattern must occur exactly once,
    so this test fails loudly when the kernel's text changes), imported under the triton backend's package."""
    src = KERNEL_FILE.read_text()
    for old, new in MUTANTS[name]:
        assert src.count(old) == 1, f"mutant {name}: {old!r} no longer occurs once in {KERNEL_FILE.name}"
        src = src.replace(old, new)
    path = tmp_path / f"_qgemv_int4_mutant_{name.replace('-', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"layerzero.backends.triton.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@interpreted
@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutated_kernel_fails_the_check(name, tmp_path, monkeypatch):
    cases = [(2, 9, 96, True), (1, 13, 160, False)]
    check_cases(cases, 32, torch.float16, seed=9)  # the real kernel passes
    monkeypatch.setattr(tq._INT4_KERNELS, "_module", _mutant_module(name, tmp_path))
    with pytest.raises(AssertionError, match="relative error"):
        check_cases(cases, 32, torch.float16, seed=9)


# ------------------------------------------------------------------------------------------- config / routing
def test_int4_config_table_and_overrides():
    """Qwen3-0.6B widths: BN from ``int4_configs``' slab (8 for K 1024, 4 for 2048 and 3072), 2 warps; the
    loop mode beyond ``int4_chunk_k``; ``int4_by_shape`` overrides; rows past ``int4_rows_max`` take tl.dot
    tiles; groups that are not powers of two are never sent to it."""
    qkv, o, down = tq.config(1, 4096, 1024, 128), tq.config(1, 1024, 2048, 128), tq.config(4, 1024, 3072, 128)
    assert (qkv["BN"], qkv["NGA"], qkv["NGB"], qkv["num_warps"]) == (8, 8, 0, 2)
    assert (o["BN"], o["NGA"]) == (4, 16) and (down["BN"], down["NGA"], down["NGB"], down["BM"]) == (
        4,
        16,
        8,
        4,
    )
    long_k = tq.config(1, 4096, 12288, 128)
    assert (long_k["NGA"], long_k["NGB"], long_k["NG"], long_k["BN"], long_k["num_warps"]) == (
        32,
        0,
        96,
        2,
        4,
    )
    assert tq.config(9, 4096, 1024, 128)["kernel"] == "dot"
    assert not tq.int4_decode_applies(1, 48) and tq.int4_decode_applies(8, 32)
    with knobs(tq.KNOBS, int4_by_shape=(((4096, 1024), (4096, 4)),)):
        assert (tq.config(1, 4096, 1024, 128)["BN"], tq.config(1, 4096, 1024, 128)["num_warps"]) == (4, 4)
    with knobs(tq.KNOBS, int4_rows_max=4):
        assert tq.config(5, 4096, 1024, 128)["kernel"] == "rows"
    assert tq.config(5, 4096, 1024, 128)["kernel"] == "int4"  # restored


def _select(ctx):
    from layerzero.core.policy import Policy
    from layerzero.core.selection import SelectionInputs, select
    from layerzero.testing.registries import routing_registry

    reg = routing_registry("quantized_linear", [tq.kernel_spec(True, "")])
    return select(
        reg,
        ctx,
        SelectionInputs(Policy.empty(), lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False),
    )


def _ctx(sm, rows, gran="group:128"):
    from layerzero.core.context import SelectionContext
    from layerzero.testing.devices import fake_cuda_device

    return SelectionContext(
        op="quantized_linear",
        device=fake_cuda_device(sm),
        dtype=torch.bfloat16,
        batch=rows,
        hidden_size=1024,
        intermediate_size=4096,
        quant_format="int4",
        quant_granularity=gran,
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("measured", "sm", "rows", "want"),
    [
        (False, (9, 0), 1, "torch_native.quantized_linear"),  # the knob off: dequantize + cuBLAS
        (True, (9, 0), 1, tq.KERNEL_ID),
        (True, (9, 0), 8, tq.KERNEL_ID),
        (True, (9, 0), 9, "torch_native.quantized_linear"),  # prefill rows: tl.dot tiles, not measured
        (True, (8, 0), 1, "torch_native.quantized_linear"),  # not measured before Hopper
    ],
)
def test_int4_default_follows_the_measurement_knob(measured, sm, rows, want):
    # measured on the H200 (benchmarks/results/int4_gemv_h200.md)
    assert tq.QuantizedLinearKnobs().int4_measured_faster is True
    with knobs(tq.KNOBS, int4_measured_faster=measured):
        plan, _ = _select(_ctx(sm, rows))
    assert plan.kernel_id == want


@pytest.mark.unit
@pytest.mark.parametrize("gran", ["group:48", "group:8", "group:96"])
def test_groups_that_are_not_powers_of_two_are_refused(gran):
    from layerzero.core.reasons import ReasonCode

    _, report = _select(_ctx((9, 0), 1, gran))
    assert ReasonCode.SHAPE_MISMATCH in {r.code for r in report.candidate(tq.KERNEL_ID).reasons}
