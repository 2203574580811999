"""The flex_attention backend on CPU: registration, detection, constraints (data + check) and routing.

1. Registered and available with torch 2.13; ``import layerzero`` does not import FlexAttention.
2. Detection: torch < 2.5, a missing module and a broken import give the documented reason codes, and the
   kernels of an unavailable backend raise ``BackendNotAvailableError``.
3. Routing on CPU: never chosen by default (priority -1, below SDPA and the reference); lz.prefer picks it;
   rejected with the exact reasons for dropout and requires_grad. Mirror test: our CPU ``requires_grad``
   refusal matches torch's own (flex raises NotImplementedError on CPU for inputs requiring grad).
4. Routing on CUDA (hand-built CUDA DeviceSpecs): priority -1 (opt-in) loses to every SDPA kernel and the
   reference; head dims < 16 and float64 are refused; graph capture refuses both flex kernels.
5. The block-mask LRU: built once per (Sq, Sk, causal, dense), evicts the least recently used.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import layerzero as lz
from layerzero.backends import flex_attention as fx
from layerzero.backends.flex_attention import kernels as fk
from layerzero.core.context import SelectionContext
from layerzero.core.device import DeviceSpec
from layerzero.core.errors import BackendNotAvailableError, InvalidInputError
from layerzero.core.reasons import ReasonCode as R
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import kernel_reasons
from layerzero.core.specs import Layout, MaskKind
from layerzero.testing.devices import fake_cuda_device

pytestmark = pytest.mark.unit


cuda_device = fake_cuda_device


def cuda_ctx(
    *, dtype=torch.bfloat16, d=128, dv=None, hq=8, hkv=2, sq=1024, sk=None, **kw
) -> SelectionContext:
    sk = sq if sk is None else sk
    return SelectionContext(
        op="attention",
        device=cuda_device(kw.pop("sm", (9, 0))),
        dtype=dtype,
        batch=2,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim=d,
        head_dim_v=d if dv is None else dv,
        seq_len_q=sq,
        seq_len_kv=sk,
        seq_equal=sq == sk,
        layout=Layout.BHSD,
        **kw,
    )


def reasons(kernel_id: str, ctx: SelectionContext) -> set[R]:
    RUNTIME.ensure_ready()
    spec = RUNTIME.registry.kernel(kernel_id, "attention")
    return {r.code for r in kernel_reasons(RUNTIME.registry, spec, ctx)}


def winner(ctx: SelectionContext) -> str:
    RUNTIME.ensure_ready()
    return RUNTIME.select_context(ctx)[0].kernel_id


def qkv(b=1, hq=4, hkv=2, sq=6, sk=6, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, sq, d, generator=g).to(dtype),
        torch.randn(b, hkv, sk, d, generator=g).to(dtype),
        torch.randn(b, hkv, sk, d, generator=g).to(dtype),
    )


# ------------------------------------------------------------------------------------------ registration
def test_backend_registered_available_with_two_kernels():
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend("flex_attention")
    assert backend.available, backend.reasons
    ids = {k["kernel_id"]: k for k in lz.list_kernels("attention")}
    assert ids["flex_attention.attention"]["device_types"] == ["cpu"]
    assert ids["flex_attention.compiled"]["device_types"] == ["cuda"]
    for kid, prio in (("flex_attention.attention", -1), ("flex_attention.compiled", -1)):
        assert ids[kid]["priority"] == prio
        assert ids[kid]["graph_safe"] is False
        assert ids[kid]["supports_dropout"] is False
        assert ids[kid]["mask_with_causal"] is True


def test_import_layerzero_does_not_import_flex():
    code = (
        "import sys, layerzero; mods = [m for m in sys.modules if m in ('torch.nn.attention.flex_attention', "
        "'layerzero.backends.flex_attention')]; "
        "print(','.join(mods))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": "src", "PATH": ""},
        cwd=str(_root()),
    )
    assert out.stdout.strip() == "", f"imported at import time: {out.stdout}"


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ detection
def test_old_torch_is_version_unsupported():
    p = fx.probe(torch_version="2.4.1+cu121")
    assert not p.backend.available and p.api is None
    assert [r.code for r in p.backend.reasons] == [R.BACKEND_VERSION_UNSUPPORTED]
    assert "torch >= 2.5" in p.backend.reasons[0].message and "2.4.1" in p.backend.reasons[0].message


def test_missing_and_broken_module_reasons():
    def absent(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    def broken(name):
        raise OSError("libcuda.so: cannot open shared object file")

    assert fx.probe(absent).backend.reasons[0].code is R.BACKEND_NOT_INSTALLED
    b = fx.probe(broken).backend
    assert b.reasons[0].code is R.BACKEND_IMPORT_FAILED and "libcuda" in b.reasons[0].message
    empty = fx.probe(lambda name: object()).backend
    assert empty.reasons[0].code is R.BACKEND_IMPORT_FAILED and "lacks" in empty.reasons[0].message


def test_unavailable_backend_registers_raising_kernels():
    reg = KernelRegistry()
    RUNTIME.ensure_ready()
    reg.add_op(RUNTIME.registry.ops.get("attention"))
    fx.register(reg, fx.probe(torch_version="2.3.0"))
    assert not reg.backend("flex_attention").available
    spec = reg.kernel("flex_attention.attention", "attention")
    with pytest.raises(BackendNotAvailableError, match="torch >= 2.5"):
        spec.fn(*qkv(), None, False, None, 0.0)


def test_torch_version_parser():
    assert fx._torch_version("2.13.0+cpu") == (2, 13)
    assert fx._torch_version("2.5.0a0+git123") == (2, 5)
    assert fx._torch_version("garbage") == (0, 0)


# ------------------------------------------------------------------------------------------ CPU routing
def test_cpu_default_never_displaces_sdpa():
    q, k, v = qkv()
    mask = torch.rand(6, 6) < 0.7
    for kw in ({}, {"is_causal": True}, {"attn_mask": mask}, {"attn_mask": mask.float()}, {"scale": 0.3}):
        assert lz.which("attention", q, k, v, **kw).startswith("torch_sdpa."), kw


def test_cpu_flex_below_reference_unless_preferred():
    """mask + causal: SDPA refuses, flex (-1) is eligible but the faster reference (0) wins; lz.prefer picks
    flex."""
    q, k, v = qkv()
    mask = torch.rand(6, 6) < 0.7
    report = lz.explain("attention", q, k, v, attn_mask=mask, is_causal=True)
    assert report.chosen == "reference.attention"
    assert report.candidate("torch_sdpa.math").reasons[0].code is R.MASK_WITH_CAUSAL
    assert report.candidate("flex_attention.attention").score.total == -1.0
    with lz.prefer("flex_attention"):
        assert lz.which("attention", q, k, v, attn_mask=mask, is_causal=True) == "flex_attention.attention"


def test_cpu_rejections_dropout_and_grad():
    q, k, v = qkv()
    codes = {r.code for r in lz.validate("flex_attention.attention", "attention", q, k, v, dropout_p=0.1)}
    assert codes == {R.DROPOUT_UNSUPPORTED}
    qg = q.clone().requires_grad_()
    codes = {r.code for r in lz.validate("flex_attention.attention", "attention", qg, k, v)}
    assert codes == {R.BACKWARD_UNSUPPORTED}
    with torch.no_grad():
        assert lz.validate("flex_attention.attention", "attention", qg, k, v) == []


def test_cpu_grad_refusal_mirrors_torch():
    """Our BACKWARD_UNSUPPORTED on CPU must match torch: flex raises for CPU inputs requiring grad."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q.clone().requires_grad_(), k, v, enable_gqa=True)


def test_cpu_kernel_runs_inputs_requiring_grad_under_no_grad():
    """torch refuses requires_grad inputs even under no_grad; the kernel detaches them (nothing is
    recorded)."""
    q, k, v = qkv()
    lz.lock("attention", "flex_attention.attention")
    with torch.no_grad():
        out = lz.attention(q.clone().requires_grad_(), k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_kernel_refuses_dropout_when_called_directly():
    RUNTIME.ensure_ready()
    fn = RUNTIME.registry.kernel("flex_attention.attention", "attention").fn
    with pytest.raises(InvalidInputError, match="dropout"):
        fn(*qkv(), None, False, None, 0.2)


def test_bshd_inputs_are_transposed_views_with_cost():
    q, k, v = (t.transpose(1, 2) for t in qkv())
    mask = torch.rand(6, 6) < 0.7
    report = lz.explain("attention", q, k, v, attn_mask=mask, is_causal=True, layout="BSHD")
    c = report.candidate("flex_attention.attention")
    assert c.transforms and c.score.transform_cost == 1.0


# ------------------------------------------------------------------------------------------ CUDA routing
def test_cuda_flex_is_opt_in_only():
    assert winner(cuda_ctx()) == "torch_sdpa.cudnn"
    # fp32 + GQA: cuDNN/flash need half, efficient refuses GQA -> math (20) beats opt-in flex (-1)
    assert winner(cuda_ctx(dtype=torch.float32)) == "torch_sdpa.math"
    # mask + causal on CUDA: only flex and the reference can; the reference (0) wins over opt-in flex (-1)
    assert winner(cuda_ctx(mask=MaskKind.BOOL, is_causal=True)) == "reference.attention"
    # a fp32 head dim above 128 exceeds the compiled template's shared memory on an H200
    assert R.HEAD_DIM_TOO_LARGE in reasons(
        "flex_attention.compiled", cuda_ctx(dtype=torch.float32, d=192, dv=192)
    )


def test_cuda_constraints():
    assert reasons("flex_attention.compiled", cuda_ctx(d=8)) == {R.HEAD_DIM_INVALID}
    assert reasons("flex_attention.compiled", cuda_ctx(d=64, dv=8)) == {R.HEAD_DIM_INVALID}
    assert reasons("flex_attention.compiled", cuda_ctx(d=512)) == {R.HEAD_DIM_TOO_LARGE}
    assert reasons("flex_attention.compiled", cuda_ctx(dtype=torch.float64)) == {R.DTYPE_UNSUPPORTED}
    assert reasons("flex_attention.compiled", cuda_ctx(sm=(7, 5))) == {R.SM_TOO_OLD}
    assert reasons("flex_attention.compiled", cuda_ctx(dropout=True)) == {R.DROPOUT_UNSUPPORTED}
    assert reasons("flex_attention.compiled", cuda_ctx(deterministic=True, requires_grad=True)) == {
        R.NON_DETERMINISTIC
    }
    assert reasons("flex_attention.compiled", cuda_ctx(deterministic=True)) == set()
    assert reasons("flex_attention.compiled", cuda_ctx(requires_grad=True)) == set()
    assert reasons("flex_attention.attention", cuda_ctx()) == {R.DEVICE_TYPE_UNSUPPORTED}


def test_graph_capture_rejects_both_flex_kernels():
    assert R.CUDA_GRAPH_UNSAFE in reasons(
        "flex_attention.compiled", cuda_ctx(dtype=torch.float32, graph_capture=True)
    )
    ctx = cuda_ctx(dtype=torch.float32)
    assert winner(replace(ctx, graph_capture=True)) == "torch_sdpa.math"
    cpu = SelectionContext(
        op="attention",
        device=DeviceSpec.detect(torch.device("cpu")),
        dtype=torch.float32,
        batch=1,
        num_heads_q=2,
        num_heads_kv=2,
        head_dim=16,
        head_dim_v=16,
        seq_len_q=8,
        seq_len_kv=8,
        layout=Layout.BHSD,
        graph_capture=True,
    )
    assert R.CUDA_GRAPH_UNSAFE in reasons("flex_attention.attention", cpu)


# ------------------------------------------------------------------------------------------ block masks
def test_block_mask_cache_builds_once_per_shape_and_evicts_lru():
    calls = []

    def create(mod, b, h, sq, sk, device=None, separate_full_blocks=True):
        calls.append((sq, sk, mod.__name__, separate_full_blocks))
        return object()

    cache = fk.BlockMaskCache(create, maxsize=2)
    cpu = torch.device("cpu")
    a = cache.get(5, 7, True, False, cpu)
    assert cache.get(5, 7, True, False, cpu) is a and cache.builds == 1
    cache.get(5, 7, True, True, cpu)  # dense structure: a different entry
    assert calls[-1] == (5, 7, "_causal_mod", False)
    cache.get(5, 7, True, False, cpu)  # refresh a: the dense one is now least recent
    cache.get(3, 3, False, False, cpu)  # evicts the dense one
    assert len(cache) == 2 and cache.builds == 3
    cache.get(5, 7, True, True, cpu)
    assert cache.builds == 4
    assert calls[2][2] == "_all_mod" and calls[3] == (5, 7, "_causal_mod", False)


def test_bool_mask_without_dense_structures_uses_score_mod():
    """Older create_block_mask without separate_full_blocks: bool masks go through a -inf score_mod instead
    (full tiles would skip a mask_mod); same results as the oracle, fully masked row -> 0."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    def old_create(mod, b, h, sq, sk, device=None):
        return create_block_mask(mod, b, h, sq, sk, device=device)

    fn = fk.FlexAttention(
        flex_attention,
        old_create,
        BlockMask,
        compiled=False,
        eager=fk.direct_eager(__import__("torch.nn.attention.flex_attention", fromlist=["x"])),
    )
    assert not fn.block_masks.dense_ok
    q, k, v = qkv(sq=5, sk=7, seed=4)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[:, 0] = True
    mask[3] = False
    for causal in (False, True):
        out = fn(q, k, v, mask, causal, None, 0.0)
        visible = mask & (torch.arange(7)[None] <= torch.arange(5)[:, None]) if causal else mask
        kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
        s = (q.double() @ kk.transpose(-1, -2) / 4).masked_fill(~visible, float("-inf"))
        ref = torch.softmax(s, -1).nan_to_num(0.0) @ vv
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))


def test_block_mask_cache_bad_size():
    with pytest.raises(InvalidInputError, match="maxsize"):
        fk.BlockMaskCache(lambda *a, **k: None, maxsize=0)


def test_kernel_builds_causal_block_mask_once_across_calls():
    RUNTIME.ensure_ready()
    fn = RUNTIME.registry.kernel("flex_attention.attention", "attention").fn
    q, k, v = qkv(sq=9, sk=11, seed=3)
    before = fn.block_masks.builds
    for _ in range(3):
        fn(q, k, v, None, True, None, 0.0)
    assert fn.block_masks.builds == before + 1
