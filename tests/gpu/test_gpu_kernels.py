"""Every CUDA kernel (``lz.list_kernels`` entries that run on cuda), locked with ``lz.lock``, against the
float64 oracles of ``tests/correctness/_shapes.py`` on >= 200 seeded cases per dtype (each with the features
the kernel requires: ALiBi slopes for ``triton.attention``, ``_shapes.fit_call``); fully-masked-row, NaN and
parameter-dtype behaviour; sampling on the GPU. Run on an H200 with ``pytest -m gpu tests/gpu -q``.

Cases that crash or mislead a kernel in a way LayerZero does not yet reject are listed in ``KNOWN_BUGS``:
the main loop skips them (a CUDA fault would break every later test of the process) and a strict-xfail test
per bug reproduces it, in a subprocess when it faults the GPU, so the lead sees when a fix lands."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "correctness"))
from _shapes import (  # noqa: E402
    MAX_CANDIDATES,
    MIN_CASES,
    Call,
    attention_oracle,
    dname,
    fit_call,
    kernel_dtype_params,
    layer_norm_oracle,
    mismatch,
    randn,
    rms_oracle,
    run_kernel,
    validate_codes,
)


def _load(rel: str, name: str):
    """Import a sibling test module by path (its helpers are shared; its tests are not collected from
    here)."""
    spec = importlib.util.spec_from_file_location(name, TESTS / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


run_sampling_kernel = _load("correctness/test_lz_ops.py", "_lz_ops_helpers").run_sampling_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
PARAMS = kernel_dtype_params(["attention", "rms_norm", "layer_norm", "rope"], DEV)
SPLIT = {"triton.attention": 4}
"""Kernels whose sweep runs in parts (each ``MIN_CASES / parts`` cases from its own seeds, so pytest-xdist
spreads them): a Triton kernel compiles once per head dim and specialization, ~190 of the 200 cases per dtype
on the H200, one sweep longer than a device call's 10 minutes (benchmarks/results/gpu_suite/README.md)."""
SWEEP = [(op, kid, dt, part) for op, kid, dt in PARAMS for part in range(SPLIT.get(kid, 1))]
SAMPLING = kernel_dtype_params(["sample_topk", "sample_topp"], DEV)
ATTN = [(kid, dt) for op, kid, dt in PARAMS if op == "attention"]
_ids = lambda x: dname(x) if isinstance(x, torch.dtype) else x  # noqa: E731


# Emptied once the bugs below were fixed in src (alignment constraint, cuDNN Sk == 1 and bool-mask rules, CUDA
# layer_norm parameter dtypes); their tests now assert the fix.
KNOWN_BUGS: dict = {}


def known_bug(kernel_id: str, call) -> str | None:
    """Why ``call`` is excluded from ``kernel_id``'s main loop (a bug with its own xfail test), or None."""
    return next((why for pred, why in KNOWN_BUGS.get(kernel_id, ()) if pred(call)), None)


@pytest.fixture(autouse=True)
def _healthy_backends_and_gpu():
    """Close every circuit breaker; fail fast (and say why) once an earlier test broke the CUDA context."""
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"the CUDA context was broken by an earlier test (see the first failure): {exc}")
    RUNTIME.health.reset()
    yield
    RUNTIME.health.reset()


def test_sdpa_kernels_are_listed_for_cuda():
    """All four SDPA sub-backends are registered for CUDA."""
    ids = {kid for kid, _ in ATTN}
    assert {"torch_sdpa.flash", "torch_sdpa.efficient", "torch_sdpa.cudnn", "torch_sdpa.math"} <= ids, ids


@pytest.mark.parametrize(("op", "kernel_id", "dtype", "part"), SWEEP, ids=_ids)
def test_cuda_kernel_matches_float64_oracle(op, kernel_id, dtype, part, record_property):
    """Locked CUDA kernel vs the float64 oracle on >= 200 seeded cases (known-bug cases skipped and counted);
    a kernel of ``SPLIT`` in parts of ``200 / parts`` cases with disjoint seeds."""
    parts = SPLIT.get(kernel_id, 1)
    target = -(-MIN_CASES // parts)
    run = run_kernel(
        op, kernel_id, dtype, DEV, target=target, known_bug=known_bug, first_seed=part * MAX_CANDIDATES
    )
    record_property("cases_run", run.ran)
    print(run.report())
    if run.ran == 0 and run.rejected.get("DTYPE_UNSUPPORTED") == run.drawn:
        pytest.skip(f"{kernel_id} declares {dname(dtype)} but rejects it on CUDA")
    assert not run.failures, f"on {torch.cuda.get_device_name()} / torch {torch.__version__}:\n{run.report()}"
    assert run.traced == run.ran, f"lz.trace saw {run.traced} calls served by {kernel_id}, expected {run.ran}"
    assert run.ran >= target, f"only {run.ran} eligible cases (need {target})\n{run.report()}"


# ------------------------------------------------------------------------------------------ masks and NaN
def _masked_inputs(dtype, kind, layout, sq=5):
    """q/k/v with 4 heads, head dim 64, Sk = 8 (BSHD or BHSD memory) and a [2, 1, Sq, 8] mask whose query row
    ``min(2, Sq - 1)`` sees no key."""
    gen = torch.Generator().manual_seed(5)
    shape_q, shape_kv = (
        ((2, sq, 4, 64), (2, 8, 4, 64)) if layout == "BSHD" else ((2, 4, sq, 64), (2, 4, 8, 64))
    )
    q, k, v = (
        randn(shape_q, gen, DEV, dtype),
        randn(shape_kv, gen, DEV, dtype),
        randn(shape_kv, gen, DEV, dtype),
    )
    keep = torch.rand(2, 1, sq, 8, generator=gen) < 0.7
    keep[..., 0] = True
    keep[:, :, min(2, sq - 1)] = False
    keep = keep.to(DEV)
    if kind == "bool":
        return q, k, v, keep
    return q, k, v, torch.zeros(keep.shape, dtype=dtype, device=DEV).masked_fill(~keep, float("-inf"))


MASK_PARAMS = [(kid, dt, kind, sq) for kid, dt in ATTN for kind in ("bool", "float") for sq in (5, 1)]


@pytest.mark.parametrize(("kernel_id", "dtype", "kind", "sq"), MASK_PARAMS, ids=_ids)
def test_cuda_fully_masked_row_gives_zero(kernel_id, dtype, kind, sq):
    """lz.attention documents that a row whose keys are all masked returns 0, whatever the kernel."""
    for layout in ("BSHD", "BHSD"):
        q, k, v, mask = _masked_inputs(dtype, kind, layout, sq)
        if not lz.validate(kernel_id, "attention", q, k, v, attn_mask=mask, layout=layout):
            break
    else:
        pytest.skip(f"{kernel_id} takes no {kind} mask in {dname(dtype)}")
    lz.lock("attention", kernel_id)
    out = lz.attention(q, k, v, attn_mask=mask, layout=layout)
    dead = min(2, sq - 1)
    row = out[:, dead] if layout == "BSHD" else out[:, :, dead]
    assert torch.equal(row, torch.zeros_like(row)), (
        f"{kernel_id} {dname(dtype)} {kind} mask, Sq={sq}: fully masked row gave "
        f"{row.flatten()[:4].tolist()}, not 0"
    )
    ref = attention_oracle(q, k, v, mask, layout=layout)
    assert mismatch(out, ref, dtype) is None, mismatch(out, ref, dtype)


@pytest.mark.parametrize(("kernel_id", "dtype"), ATTN, ids=_ids)
def test_cuda_nan_in_one_query_row_stays_in_that_row(kernel_id, dtype):
    """A NaN in q row 3 of head 1 shows up in exactly that output row (with the features the kernel requires:
    ALiBi slopes for ``triton.attention``)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn((1, 8, 2, 64), gen, DEV, dtype) for _ in range(3))  # BSHD memory, Sq == Sk
    q[0, 3, 1, 5] = float("nan")
    call = Call(None, (q, k, v), {"is_causal": True, "layout": "BSHD"}, lambda: None)
    call, codes = fit_call("attention", call, validate_codes("attention", kernel_id), DEV)
    if codes:
        pytest.skip(f"{kernel_id} cannot run causal {dname(dtype)}: {codes}")
    lz.lock("attention", kernel_id)
    out = lz.attention(*call.args, **call.kwargs)
    nan = torch.isnan(out)
    assert nan[0, 3, 1].all(), f"{kernel_id}: the NaN of q row 3 vanished: {out[0, 3, 1, :4].tolist()}"
    nan[0, 3, 1] = False
    assert not nan.any(), f"{kernel_id}: NaN leaked to {nan.nonzero().tolist()[:5]}"


# ------------------------------------------------------------------------------------------ known bugs
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_ids)
def test_cuda_cudnn_single_key(dtype):
    """validate() == [] must mean the kernel runs: q [2, 5, 2, 64] BSHD, k/v with one key."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        randn((2, 5, 2, 64), gen, DEV, dtype),
        randn((2, 1, 2, 64), gen, DEV, dtype),
        randn((2, 1, 2, 64), gen, DEV, dtype),
    )
    if lz.validate("torch_sdpa.cudnn", "attention", q, k, v, layout="BSHD"):
        return  # rejected: fixed by a constraint
    lz.lock("attention", "torch_sdpa.cudnn")
    out = lz.attention(q, k, v, layout="BSHD")
    assert mismatch(out, attention_oracle(q, k, v, layout="BSHD"), dtype) is None


_UNALIGNED = """
import sys, torch, layerzero as lz
kid, dtype = sys.argv[1], getattr(torch, sys.argv[2])
q, k, v = (torch.randn(2, 3, s, 99, device="cuda", dtype=dtype)[..., :96] for s in (5, 7, 7))  # row stride 99
if lz.validate(kid, "attention", q, k, v):
    print("rejected by validate()"); sys.exit(0)
lz.lock("attention", kid)
out = lz.attention(q, k, v); torch.cuda.synchronize()
ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 96 ** 0.5, -1) @ v.double()
sys.exit(0 if torch.allclose(out.double(), ref, atol=2e-2) else 3)
"""


@pytest.mark.parametrize(
    ("kernel_id", "dtype"),
    [
        ("torch_sdpa.flash", torch.float16),
        ("torch_sdpa.efficient", torch.float16),
        ("torch_sdpa.efficient", torch.float32),
    ],
    ids=_ids,
)
def test_cuda_unaligned_rows_are_rejected_or_run(kernel_id, dtype):
    """In a subprocess: a CUDA fault here would break every later test of this process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run(
        [sys.executable, "-c", _UNALIGNED, kernel_id, dname(dtype)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, (
        f"{kernel_id} {dname(dtype)} rc={r.returncode}: {r.stdout[-500:]}{r.stderr[-1500:]}"
    )


@pytest.mark.parametrize(
    ("op", "kernel_id"),
    [(op, kid) for op, kid in sorted({(op, kid) for op, kid, _ in PARAMS if op.endswith("_norm")})],
)
def test_cuda_norm_weight_dtype_other_than_input(op, kernel_id):
    """Whenever validate() says the kernel can run x of one dtype with weight (and bias) of another, it must
    run and match the oracle."""
    failures, gen = [], torch.Generator().manual_seed(9)
    lz.lock(op, kernel_id)
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for xd, wd in ((a, b) for a in dtypes for b in dtypes if a != b):
        x, w, b = randn((3, 24), gen, DEV, xd), randn((24,), gen, DEV, wd), randn((24,), gen, DEV, wd)
        args = (x, w, b) if op == "layer_norm" else (x, w)
        if lz.validate(kernel_id, op, *args):
            continue
        try:
            out = getattr(lz, op)(*args)
        except lz.KernelExecutionError as exc:
            failures.append(f"x {dname(xd)}, weight {dname(wd)}: validate() says it can run; it raised {exc}")
            continue
        ref = layer_norm_oracle(x, w, b, 1e-5) if op == "layer_norm" else rms_oracle(x, w, 1e-6)
        msg = mismatch(out, ref, xd)
        if msg:
            failures.append(f"x {dname(xd)}, weight {dname(wd)}: {msg}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("op", "kernel_id", "dtype"), SAMPLING, ids=_ids)
def test_cuda_sampling_kernel_draws_inside_oracle_sets(op, kernel_id, dtype):
    """Locked sampling kernel on the GPU: tokens inside the oracle's sets; same seed repeats."""
    ran, failures = run_sampling_kernel(op, kernel_id, dtype, DEV)
    assert not failures, f"{kernel_id} {dname(dtype)}: {ran} cases\n" + "\n".join(failures[:12])
    assert ran >= MIN_CASES
