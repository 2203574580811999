"""The locked-kernel sweeps (``run_kernel``: ``tests/gpu/test_gpu_kernels.py``, ``test_gpu_swiglu.py``,
``test_gpu_triton.py``) draw enough cases that every CUDA kernel can run, checked here without a GPU.

Every registered kernel of the swept ops that runs on CUDA (installed here or not) and every dtype it
declares: the drawn cases, with the features the kernel requires added as the sweep adds them
(``_shapes.fit_call``: ALiBi slopes for ``triton.attention``, which serves ALiBi calls only and ran 0 of 5,000
drawn cases on the H200 before), are judged by the kernel's constraints and its own ``check`` on a CUDA
selection context (``fake_cuda_device``: an H200's SM 9.0, or an SM the kernel's spec runs on) built from the
call's cache key as ``lz.validate`` builds it, with ``aligned_16`` computed from the tensors as on CUDA. Each
must accept ``MIN_CASES`` of at most ``MAX_CANDIDATES`` drawn cases, as the GPU sweep asserts; a (kernel,
dtype) that the kernel refuses for its dtype on CUDA on every case (``torch_sdpa.flash`` float32) is skipped
there too. Not modelled: backend installation and health, policy, and device-specific data pointers (CPU
tensors stand in)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from layerzero.core.constraints import check_constraints
from layerzero.core.reasons import ReasonCategory
from layerzero.core.runtime import RUNTIME
from layerzero.ops import OPS
from layerzero.ops.attention import aligned_16
from layerzero.testing.devices import fake_cuda_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import CALLS, DTYPES, MAX_CANDIDATES, MIN_CASES, REQUIRED, dname, fit_call  # noqa: E402

pytestmark = pytest.mark.correctness

SWEPT = ("attention", "rms_norm", "layer_norm", "rope", "qk_norm_rope", "swiglu")
SMS = ((9, 0), (8, 0), (8, 9), (10, 0), (12, 0))  # the H200's first, then any the kernel runs on
PROBE = 100  # a (kernel, dtype) refused for DTYPE_UNSUPPORTED on all of its first PROBE cases is off on CUDA


def _device(spec):
    """A fake CUDA device the spec's SM and generation limits allow (the H200's SM 9.0 when they do)."""
    for sm in SMS:
        dev = fake_cuda_device(sm, sms=132)
        if (
            (spec.sm_min is None or sm >= spec.sm_min)
            and (spec.sm_max is None or sm <= spec.sm_max)
            and (spec.generations is None or dev.generation in spec.generations)
        ):
            return dev
    raise AssertionError(f"{spec.kernel_id}: no SM of {SMS} satisfies its spec")


def cuda_refusals(op: str, spec):
    """``_shapes.Refusals`` of ``spec`` on a CUDA device: its constraints and own check, installed or not
    (backend reasons, such as xFormers' own check failing to import it here, are left out)."""
    prepare, context = OPS[op]
    device = _device(spec)

    def refusals(call):
        key, _ = prepare(*call.args, **call.kwargs)
        ctx = replace(context(key), device=device)
        if op == "attention":  # CPU keys say aligned; CUDA keys read the pointers and strides
            ctx = replace(ctx, aligned_16=aligned_16(*call.args[:3]))
        reasons = check_constraints(spec, ctx) + (list(spec.check(ctx)) if spec.check is not None else [])
        return [
            r.code.value for r in reasons if r.category is not ReasonCategory.BACKEND
        ]  # not installed here

    return refusals


def _cuda_specs(op):
    RUNTIME.ensure_ready()
    return [s for s in RUNTIME.registry.for_op(op) if "cuda" in s.device_types]


def sweep_counts(
    op: str, dtype: torch.dtype, specs, target: int = MIN_CASES
) -> dict[str, tuple[int, int, dict]]:
    """``{kernel_id: (accepted, drawn, refusal counts)}`` over the sweep's seeded cases of ``op`` in ``dtype``
    on a CUDA context, each case fitted to each kernel (:func:`_shapes.fit_call`); a kernel stops drawing once
    it has ``target`` accepted cases or is off for the dtype (``DTYPE_UNSUPPORTED`` on its first :data:`PROBE`
    cases)."""
    pending = {s.kernel_id: cuda_refusals(op, s) for s in specs}
    counts: dict[str, tuple[int, int, dict]] = {kid: (0, 0, {}) for kid in pending}
    for seed in range(MAX_CANDIDATES):
        if not pending:
            break
        drawn_call = CALLS[op](seed, dtype)
        for kid, refusals in list(pending.items()):
            _, codes = fit_call(op, drawn_call, refusals)
            ok, drawn, refused = counts[kid]
            for code in codes:
                refused[code] = refused.get(code, 0) + 1
            ok, drawn = ok + (not codes), drawn + 1
            counts[kid] = ok, drawn, refused
            if ok >= target or (drawn == PROBE and refused.get("DTYPE_UNSUPPORTED") == drawn):
                del pending[kid]
    return counts


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("op", SWEPT)
def test_every_cuda_kernel_gets_enough_sweep_cases(op, dtype):
    specs = [s for s in _cuda_specs(op) if dtype in s.dtypes]
    if not specs:
        pytest.skip(f"no CUDA kernel of {op} declares {dname(dtype)}")
    short = []
    for kid, (ok, drawn, refused) in sweep_counts(op, dtype, specs).items():
        if ok == 0 and refused.get("DTYPE_UNSUPPORTED") == drawn:
            continue  # off for this dtype on CUDA: the GPU sweep skips it with that reason
        if ok < MIN_CASES:
            top = dict(sorted(refused.items(), key=lambda kv: -kv[1])[:6])
            short.append(f"{kid}: {ok} of {drawn} drawn cases accepted (need {MIN_CASES}); refusals {top}")
    assert not short, (
        f"{op} {dname(dtype)} on CUDA: extend the case generator (_shapes) or add the feature a "
        f"kernel requires to _shapes.REQUIRED:\n  " + "\n  ".join(short)
    )


def test_triton_attention_is_swept_on_alibi_cases():
    """The issue's kernel: no drawn case is accepted as drawn; with the slopes fit_call adds, >= MIN_CASES
    are."""
    spec = next(s for s in _cuda_specs("attention") if s.kernel_id == "triton.attention")
    refusals = cuda_refusals("attention", spec)
    plain = fitted = 0
    for seed in range(MAX_CANDIDATES):
        call = CALLS["attention"](seed, torch.bfloat16)
        plain += not refusals(call)
        fit, codes = fit_call("attention", call, refusals)
        if not codes:
            fitted += 1
            assert fit.kwargs["alibi_slopes"].dtype == torch.float32
            assert fit.kwargs["alibi_slopes"].shape in ((call.case.hq,), (call.case.batch, call.case.hq))
        if fitted >= MIN_CASES:
            break
    assert plain == 0 and fitted >= MIN_CASES, (plain, fitted)
    assert "ALIBI_REQUIRED" in REQUIRED["attention"]


def test_fit_call_adds_a_feature_once_and_only_when_refused_for_it():
    """A refusal without a REQUIRED row leaves the call as drawn; a required feature is added once even if the
    refusal stays (no loop)."""
    call = CALLS["attention"](0, torch.float32)
    same, codes = fit_call("attention", call, lambda c: ["MASK_UNSUPPORTED"])
    assert same is call and codes == ["MASK_UNSUPPORTED"]
    seen = []

    def stubborn(c):
        seen.append("alibi_slopes" in c.kwargs)
        return ["ALIBI_REQUIRED"]

    fit, codes = fit_call("attention", call, stubborn)
    assert seen == [False, True] and "alibi_slopes" in fit.kwargs and codes == ["ALIBI_REQUIRED"]
    assert fit_call("rms_norm", CALLS["rms_norm"](0, torch.float32), lambda c: ["ALIBI_REQUIRED"])[1] == [
        "ALIBI_REQUIRED"
    ]
