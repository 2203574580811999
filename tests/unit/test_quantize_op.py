"""``lz.quantize`` / ``lz.dequantize``: input validation, keys and contexts, routing, the public types, and
the GPTQ int32 repacking (``layerzero.ops.gptq``).

1. Bad inputs raise ``InvalidInputError`` (a ``ValueError``) saying what failed, expected vs got; an unknown
   format lists the supported ones; NaN/Inf are refused unless ``check_finite=False``.
2. Hand-built ``QuantizedTensor`` s that disagree with their format's layout are refused by ``lz.dequantize``.
3. The key holds format, granularity, dtype, rows (bucketed) and K; contexts carry ``quant_format`` /
   ``quant_granularity``; a policy ``when: {quant_format: ...}`` routes on them; torch_native is the CPU
   default.
4. GPTQ: the bit layout of ``qweight`` / ``qzeros`` worked by hand, the round trip, the v1 ``zero - 1`` rule.
"""

from __future__ import annotations

import math

import pytest
import torch

import layerzero as lz
from layerzero.core.errors import InvalidInputError
from layerzero.core.quant_format import Granularity, QuantFormat, QuantizedTensor
from layerzero.ops import OPS
from layerzero.ops.gptq import from_gptq, to_gptq

pytestmark = pytest.mark.unit

X = torch.randn(4, 64)


# ----------------------------------------------------------------------------- 1. bad inputs of lz.quantize


@pytest.mark.parametrize(
    ("x", "fmt", "kw", "match"),
    [
        ([1.0], "int8", {}, r"lz\.quantize: x: expected a torch\.Tensor, got list"),
        (
            torch.ones(4, dtype=torch.int32),
            "int8",
            {},
            r"x\.dtype.*float32/float64.*got torch\.int32.*x\.float\(\)",
        ),
        (torch.ones(0, 32), "int8", {}, r"at least one element, got shape \[0, 32\]"),
        (
            X,
            "int3",
            {},
            r"format: expected one of \['int8', 'fp8_e4m3', 'fp8_e5m2', 'mxfp4', 'nvfp4', 'int4'\], "
            r"got 'int3'\. Did you mean 'int[48]'\?",
        ),
        (X, "MXFP4", {}, r"got 'MXFP4'\. Did you mean 'mxfp4'\?"),
        (
            X,
            torch.int8,
            {},
            r"format: expected one of .*got torch\.int8\. Pass the format's name as a string",
        ),
        (X, "int8", {"axis": 0, "group_size": 64}, r"axis and group_size: expected at most one of them"),
        (X, "int8", {"axis": 2}, r"axis: expected a dim of x in \[-2, 1\] \(x has shape \[4, 64\]\), got 2"),
        (X, "fp8_e4m3", {"axis": -3}, r"axis: expected a dim of x in \[-2, 1\]"),
        (X, "int8", {"axis": True}, r"axis: expected an int"),
        (
            X,
            "int8",
            {"group_size": 7},
            r"x\.shape\[-1\] for int8: expected a multiple of the group_size 7, got 64",
        ),
        (X, "int8", {"group_size": 0}, r"group_size for int8: expected None \(per tensor\), an int g >= 1"),
        (X, "int8", {"group_size": 2.0}, r"group_size for int8.*got 2\.0"),
        (
            X,
            "fp8_e4m3",
            {"group_size": (3, 64)},
            r"x\.shape\[-2\]: expected a multiple of group_size\[0\] = 3, got 4",
        ),
        (X, "fp8_e4m3", {"group_size": (4, 48)}, r"multiple of the group_size\[1\] 48, got 64"),
        (
            torch.ones(64),
            "fp8_e4m3",
            {"group_size": (1, 64)},
            r"x rank for a 2-D block group_size: expected >= 2",
        ),
        (
            X,
            "mxfp4",
            {"group_size": 16},
            r"group_size for mxfp4: expected None or 32 \(fixed by the format\), got 16",
        ),
        (
            torch.ones(2, 48),
            "mxfp4",
            {},
            r"x\.shape\[-1\] for mxfp4: expected a multiple of the block size 32, got 48",
        ),
        (torch.ones(2, 24), "nvfp4", {}, r"multiple of the block size 16, got 24"),
        (
            X,
            "nvfp4",
            {"axis": 0},
            r"axis for nvfp4: expected None.*Per-channel scales exist for int8 and fp8 only",
        ),
        (X, "int4", {"axis": 0}, r"axis for int4: expected None"),
        (
            torch.ones(2, 100),
            "int4",
            {},
            r"x\.shape\[-1\] for int4: expected a multiple of the group_size 128, got 100",
        ),
        (torch.ones(2, 9), "int4", {"group_size": 3}, r"x\.shape\[-1\] for int4: expected an even size"),
        (X, "int4", {"group_size": -1}, r"group_size for int4: expected an int >= 1"),
        (torch.tensor(1.0), "mxfp4", {}, r"x rank for mxfp4: expected >= 1 dims"),
        (X, "int8", {"check_finite": 1}, r"check_finite: expected True or False"),
    ],
)
def test_bad_quantize_input_raises_typed_error(x, fmt, kw, match):
    with pytest.raises(InvalidInputError, match=match):
        lz.quantize(x, fmt, **kw)


def test_bad_input_error_is_a_value_error():
    with pytest.raises(ValueError, match=r"lz\.quantize"):
        lz.quantize(X, "int9")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_with_its_index_unless_unchecked(bad):
    x = torch.zeros(3, 32)
    x[1, 5] = bad
    with pytest.raises(
        InvalidInputError,
        match=rf"x values: expected finite numbers.*got {bad!r} at index \[1, 5\]"
        r".*check_finite=False",
    ):
        lz.quantize(x, "mxfp4")
    qt = lz.quantize(x, "mxfp4", check_finite=False)  # no check: the other rows are still right
    assert torch.equal(lz.dequantize(qt)[0], x[0]) and torch.equal(lz.dequantize(qt)[2], x[2])


def test_format_is_parsed_once_into_the_enum():
    assert lz.QuantFormat is QuantFormat and lz.QuantizedTensor is QuantizedTensor
    assert QuantFormat("fp8_e4m3") is QuantFormat.FP8_E4M3 and QuantFormat.INT8 == "int8"
    qt = lz.quantize(X, QuantFormat.NVFP4)
    assert qt.format is QuantFormat.NVFP4 and lz.quantize(X, "nvfp4").format is QuantFormat.NVFP4


# ----------------------------------------------------------------------------- 2. bad QuantizedTensors


def _broken(fmt: str, **changes) -> QuantizedTensor:
    return lz.quantize(torch.randn(4, 64), fmt, group_size=32 if fmt == "int4" else None)._replace(**changes)


@pytest.mark.parametrize(
    ("qt", "match"),
    [
        ((torch.zeros(2), torch.ones(())), r"lz\.dequantize: qt: expected a QuantizedTensor.*got tuple"),
        (
            _broken("int8", format="int8"),
            r"qt\.format: expected a QuantFormat.*got 'int8'.*lz\.QuantFormat\('int8'\)",
        ),
        (_broken("int8", dtype=torch.int8), r"qt\.dtype: expected one of float32"),
        (
            _broken("int8", data=torch.zeros(4, 64, dtype=torch.uint8)),
            r"qt\.data\.dtype: expected torch\.int8 \(int8\)",
        ),
        (
            _broken("int8", data=torch.zeros(4, 63, dtype=torch.int8)),
            r"qt\.data shape: expected \[4, 64\].*got \[4, 63\]",
        ),
        (
            _broken("mxfp4", data=torch.zeros(4, 64, dtype=torch.uint8)),
            r"qt\.data shape: expected \[4, 32\] \(mxfp4",
        ),
        (_broken("mxfp4", scale=torch.zeros(4, 2)), r"qt\.scale\.dtype: expected torch\.uint8 \(mxfp4\)"),
        (
            _broken("nvfp4", scale=torch.zeros(4, 3, dtype=torch.float8_e4m3fn)),
            r"qt\.scale shape: expected \[4, 4\]",
        ),
        (
            _broken("nvfp4", global_scale=None),
            r"qt\.global_scale: expected a torch\.float32 tensor of shape \[\]",
        ),
        (
            _broken("int8", global_scale=torch.ones(())),
            r"qt\.global_scale for int8: expected None \(nvfp4 only\)",
        ),
        (
            _broken("int4", zero_point=None),
            r"qt\.zero_point: expected a torch\.uint8 tensor of shape \[4, 2\]",
        ),
        (_broken("int8", zero_point=torch.zeros(())), r"qt\.zero_point for int8: expected None"),
        (
            _broken("int8", axis=-1, scale=torch.ones(1, 64)),
            r"qt\.axis / qt\.group_size: expected normalized values "
            r"axis=1.*got axis=-1",
        ),
        (_broken("int8", scale=torch.ones((), device="meta")), r"qt\.scale\.device: expected cpu"),
        (_broken("int4", group_size=48), r"multiple of the group_size 48, got 64"),
    ],
)
def test_bad_quantized_tensor_raises_typed_error(qt, match):
    with pytest.raises(InvalidInputError, match=match):
        lz.dequantize(qt)


# ----------------------------------------------------------------------------- 3. key, context, routing


@pytest.mark.parametrize(
    ("fmt", "kw", "gran", "group"),
    [
        ("int8", {}, "tensor", None),
        ("int8", {"axis": -1}, "channel:2", None),
        ("int8", {"group_size": 64}, "group:64", 64),
        ("fp8_e4m3", {"group_size": (2, 32)}, "block:2x32", (2, 32)),
        ("fp8_e5m2", {"group_size": [2, 32]}, "block:2x32", (2, 32)),
        ("mxfp4", {}, "group:32", 32),
        ("nvfp4", {"group_size": 16}, "group:16", 16),
        ("int4", {}, "group:128", 128),
    ],
)
def test_key_context_and_canonical_args(fmt, kw, gran, group):
    prepare, build = OPS["quantize"]
    x = torch.randn(3, 4, 128, dtype=torch.bfloat16)  # 12 rows: batch bucket 16
    key, args = prepare(x, fmt, **kw)
    assert args[0] is x and args[1] is QuantFormat(fmt) and args[3] == group and len(args) == 4
    ctx = build(key)
    assert (ctx.op, ctx.dtype, ctx.quant_format, ctx.quant_granularity, ctx.batch, ctx.hidden_size) == (
        "quantize",
        torch.bfloat16,
        fmt,
        gran,
        16,
        128,
    )
    qt = lz.quantize(x, fmt, **kw)
    dkey, dargs = OPS["dequantize"][0](qt)
    assert dargs == (qt,) and build(dkey).quant_granularity == gran and dkey.op == "dequantize"
    assert qt.granularity is Granularity(gran.split(":")[0])


def test_keys_differ_by_format_granularity_and_dtype():
    prepare = OPS["quantize"][0]
    keys = {
        prepare(X, "int8")[0],
        prepare(X, "int8", axis=0)[0],
        prepare(X, "int8", group_size=32)[0],
        prepare(X, "fp8_e4m3")[0],
        prepare(X.double(), "int8")[0],
        prepare(torch.randn(4, 32), "int8")[0],
    }
    assert len(keys) == 6
    assert prepare(X, "int8", axis=-2)[0] == prepare(X, "int8", axis=0)[0]  # normalized


def test_cpu_default_is_torch_native_and_the_reference_is_registered():
    for op in ("quantize", "dequantize"):
        assert {k["kernel_id"] for k in lz.list_kernels(op)} == {f"reference.{op}", f"torch_native.{op}"}
    assert lz.which("quantize", X, "int8") == "torch_native.quantize"
    assert lz.which("dequantize", lz.quantize(X, "int8")) == "torch_native.dequantize"
    report = lz.explain("quantize", X, "nvfp4")
    assert report.chosen == "torch_native.quantize" and report.context.quant_format == "nvfp4"


def test_disabled_and_locks_route_to_the_reference():
    with lz.disabled(), lz.trace() as t:
        lz.dequantize(lz.quantize(X, "int4", group_size=32))
    assert dict(t.counts) == {
        ("quantize", "reference.quantize"): 1,
        ("dequantize", "reference.dequantize"): 1,
    }
    lz.lock("quantize", "reference.quantize")
    assert lz.which("quantize", X, "fp8_e5m2") == "reference.quantize"


def test_policy_routes_on_the_quant_format(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\ndeny:\n  - kernels: [torch_native.quantize]\n    when: {quant_format: nvfp4}\n",
        encoding="utf-8",
    )
    lz.load_config(path)
    assert lz.which("quantize", X, "nvfp4") == "reference.quantize"
    assert lz.which("quantize", X, "mxfp4") == "torch_native.quantize"


def test_quantize_detaches_and_returns_plain_tensors():
    x = torch.randn(2, 32, requires_grad=True)
    for fmt in ("int8", "fp8_e4m3", "nvfp4", "int4"):
        qt = lz.quantize(x, fmt, group_size=32 if fmt == "int4" else None)
        assert not any(t.requires_grad for t in qt[:4] if t is not None)
        assert not lz.dequantize(qt).requires_grad


def test_strided_and_0_dim_inputs():
    xt = torch.randn(64, 32).t()  # [32, 64], not contiguous
    for fmt, kw in (("int4", {"group_size": 32}), ("fp8_e4m3", {"axis": 1}), ("nvfp4", {})):
        a, b = lz.quantize(xt, fmt, **kw), lz.quantize(xt.contiguous(), fmt, **kw)
        assert all(
            torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b, strict=True)
        )
    qt = lz.quantize(torch.tensor(-3.0), "int8")  # per tensor of a scalar: 0-dim data and scale
    assert qt.data.shape == () and qt.data.item() == -127 and lz.dequantize(qt).item() == -3.0


def test_quantized_tensor_nbytes_and_comparison_for_canaries():
    from layerzero.tuning.stats import compare

    qt = lz.quantize(torch.randn(8, 256), "nvfp4")
    assert qt.nbytes == 8 * 128 + 8 * 16 + 4
    assert compare(qt, qt)[0]  # lz.tune / canaries flatten the NamedTuple and compare field by field


# ----------------------------------------------------------------------------- 4. GPTQ int32 packing


def test_gptq_bit_layout_by_hand():
    """q[n, k] = (n + k) % 16; qweight[i, n] nibble j = q[n, 8i + j]; qzeros[c, i] nibble j = zero[8i + j,
    c]."""
    n, k, g = 8, 16, 8
    q = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16  # [N, K]
    zeros = torch.arange(1, 17).reshape(8, 2) % 16  # [N, K/g]: 1..15, 0 -> made 1..15 below
    zeros = torch.where(zeros == 0, 8, zeros).to(torch.uint8)
    data = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    qt = QuantizedTensor(
        data,
        torch.rand(n, k // g) + 0.5,
        zeros,
        None,
        QuantFormat.INT4,
        torch.Size((n, k)),
        torch.float32,
        None,
        g,
    )
    w = to_gptq(qt, checkpoint_format="gptq_v2", scale_dtype=torch.float32)
    assert w.qweight.shape == (2, 8) and w.qzeros.shape == (2, 1) and w.scales.shape == (2, 8)
    word = sum(int(q[3, 8 + j]) << (4 * j) for j in range(8))  # qweight[1, 3]
    assert int(w.qweight[1, 3]) & 0xFFFFFFFF == word
    zword = sum(int(zeros[j, 1]) << (4 * j) for j in range(8))  # qzeros[1, 0]
    assert int(w.qzeros[1, 0]) & 0xFFFFFFFF == zword
    assert torch.equal(w.g_idx, torch.arange(k, dtype=torch.int32) // g) and w.qweight.dtype == torch.int32
    v1 = to_gptq(qt)  # AutoGPTQ stores zero - 1
    assert int(v1.qzeros[1, 0]) & 0xFFFFFFFF == sum((int(zeros[j, 1]) - 1) << (4 * j) for j in range(8))
    assert v1.scales.dtype == torch.float16


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_round_trip_is_lossless(checkpoint_format):
    torch.manual_seed(0)
    w = torch.randn(24, 256) - 3.0 * (
        checkpoint_format == "gptq"
    )  # "gptq" needs zero points >= 1: keep min < 0
    qt = lz.quantize(w, "int4", group_size=64)
    back = from_gptq(
        to_gptq(qt, checkpoint_format=checkpoint_format, scale_dtype=torch.float32),
        group_size=64,
        checkpoint_format=checkpoint_format,
        dtype=torch.float32,
    )
    for a, b in zip(qt, back, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert torch.equal(lz.dequantize(back), lz.dequantize(qt))


def test_gptq_errors():
    pos = lz.quantize(torch.rand(8, 128), "int4")  # no negative values: zero points 0
    with pytest.raises(
        InvalidInputError, match=r"zero points: expected 1\.\.15 for checkpoint_format='gptq'.*gptq_v2"
    ):
        to_gptq(pos)
    assert to_gptq(pos, checkpoint_format="gptq_v2").qzeros.abs().sum() == 0
    with pytest.raises(InvalidInputError, match=r"checkpoint_format: expected one of \['gptq', 'gptq_v2'\]"):
        to_gptq(pos, checkpoint_format="awq")
    with pytest.raises(InvalidInputError, match=r"an int4 QuantizedTensor"):
        to_gptq(lz.quantize(torch.rand(8, 128), "int8"))
    with pytest.raises(InvalidInputError, match=r"\[N, K\] with N and K multiples of 8"):
        to_gptq(lz.quantize(torch.rand(6, 128), "int4"))
    w = to_gptq(pos, checkpoint_format="gptq_v2")
    with pytest.raises(InvalidInputError, match=r"group_size: expected an int >= 1 dividing K = 128"):
        from_gptq(w, group_size=48)
    assert math.isclose(
        float(from_gptq(w, group_size=128, checkpoint_format="gptq_v2").scale[0, 0]),
        float(pos.scale[0, 0]),
        rel_tol=1e-3,
    )


def test_gptq_act_order_g_idx_is_refused():
    """desc_act=True checkpoints interleave their groups along K: refused, never read as contiguous groups."""
    qt = lz.quantize(torch.rand(8, 256) - 0.5, "int4", group_size=64)
    w = to_gptq(qt, checkpoint_format="gptq_v2")
    assert torch.equal(from_gptq(w, group_size=64, checkpoint_format="gptq_v2").data, qt.data)  # k // g: fine
    act_order = w._replace(g_idx=w.g_idx[torch.randperm(256, generator=torch.Generator().manual_seed(0))])
    with pytest.raises(InvalidInputError, match=r"g_idx: expected k // group_size .*act-order"):
        from_gptq(act_order, group_size=64, checkpoint_format="gptq_v2")
    with pytest.raises(InvalidInputError, match=r"g_idx"):
        from_gptq(w._replace(g_idx=w.g_idx[:128]), group_size=64, checkpoint_format="gptq_v2")
    assert torch.equal(
        from_gptq(w._replace(g_idx=None), group_size=64, checkpoint_format="gptq_v2").data, qt.data
    )
    assert torch.equal(from_gptq(w[:3], group_size=64, checkpoint_format="gptq_v2").data, qt.data)
