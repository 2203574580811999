"""Constraint mirroring on CPU: for every point of a grid (dtypes x head dims {8, 21, 64, 72, 203, 256, 512} x
GQA x mask none/bool/float x causal x dropout x stride(-1) == 1 or not x layout x Sq == Sk or not),
``lz.validate("torch_sdpa.<x>", "attention", ...) == []`` must imply that torch itself runs that sub-backend
(``sdpa_kernel(SDPBackend.X)`` on the BHSD views LayerZero passes it). LayerZero may be stricter than torch
only in the cases of ``CPU_ALLOW``, each with its reason; an allowlist entry no grid point needs is stale."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.ops._common import RUNTIME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import (  # noqa: E402
    SDPA_BACKENDS,
    Allow,
    SdpaCtx,
    attention_oracle,
    judge,
    make_mask,
    mirror,
    mismatch,
    randn,
    sdpa_grid,
)

pytestmark = pytest.mark.unit

CPU_ALLOW = (
    Allow("torch_sdpa.flash", "cpu", frozenset({"MASK_WITH_CAUSAL"}), lambda c: c.mask != "none" and c.causal,
          "the flash KernelSpec has one mask_with_causal=False for CUDA (which takes no mask at all) and CPU; "
          "the CPU flash kernel combines attn_mask with is_causal correctly "
          "(test_cpu_flash_combines_mask_and_causal_correctly), so LayerZero only loses a faster kernel"),
)


@pytest.fixture(autouse=True)
def _healthy_backends():
    """An open circuit breaker would add BACKEND_UNHEALTHY reasons to every validate() of the grid."""
    RUNTIME.health.reset()
    yield
    RUNTIME.health.reset()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


GRID = sdpa_grid()


def test_grid_has_every_combination():
    assert len(GRID) == 4 * 7 * 2 * 3 * 2 * 2 * 2 * 2 * 2
    assert {c.d for c in GRID} == {8, 21, 64, 72, 203, 256, 512}


@pytest.mark.parametrize("kernel_id", sorted(SDPA_BACKENDS))
def test_validate_mirrors_torch_on_cpu(kernel_id):
    mismatches, used = mirror(kernel_id, GRID, "cpu", CPU_ALLOW)
    assert not mismatches, (f"{len(mismatches)} grid points where LayerZero and torch {torch.__version__} disagree "
                            f"about {kernel_id} on CPU:\n" + "\n".join(mismatches[:25]))
    stale = [a.why for a in CPU_ALLOW if a.kernel_id == kernel_id and a not in used]
    assert not stale, f"allowlist entries no grid point needed (remove them): {stale}"


def test_cpu_flash_combines_mask_and_causal_correctly():
    """Backs CPU_ALLOW: torch's CPU flash with attn_mask + is_causal equals the oracle's mask AND top-left causal."""
    gen = torch.Generator().manual_seed(0)
    for kind, (sq, sk) in (("bool", (6, 6)), ("float", (5, 9)), ("bool", (9, 4))):
        q, k, v = randn((2, 4, sq, 32), gen, "cpu", torch.float32), *(randn((2, 2, sk, 32), gen, "cpu", torch.float32)
                                                                      for _ in range(2))
        mask = make_mask(kind, "B1SS", False, 2, 4, sq, sk, gen, "cpu", torch.float32)
        mask[..., 0] = True if kind == "bool" else 0.0  # keep key 0 so no row is fully masked
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True)
        ref = attention_oracle(q, k, v, mask, True)
        assert mismatch(out, ref, torch.float32) is None, (kind, sq, sk, mismatch(out, ref, torch.float32))


# ------------------------------------------------------------------------------ the judge itself can fail
CTX = SdpaCtx(torch.float16, 64, False, "none", True, False, True, "BHSD", False)
REJECT = [Reason(ReasonCode.MASK_WITH_CAUSAL, "cannot combine attn_mask with is_causal=True")]


def test_judge_flags_can_run_that_torch_refuses():
    msg, _ = judge("torch_sdpa.flash", "cpu", CTX, [], "No available kernel.", ())
    assert msg is not None and msg.startswith("UNSAFE") and "No available kernel" in msg and "d=64" in msg


def test_judge_flags_unlisted_stricter_verdict_and_accepts_allowlisted_one():
    msg, used = judge("torch_sdpa.flash", "cpu", CTX, REJECT, None, ())
    assert msg is not None and msg.startswith("STRICTER") and "MASK_WITH_CAUSAL" in msg and used is None
    masked = SdpaCtx(torch.float16, 64, False, "bool", True, False, True, "BHSD", False)
    assert judge("torch_sdpa.flash", "cpu", masked, REJECT, None, CPU_ALLOW) == (None, CPU_ALLOW[0])
    # the entry covers only its own codes, kernel and device
    other = [Reason(ReasonCode.HEAD_DIM_MISMATCH, "x")]
    assert judge("torch_sdpa.flash", "cpu", masked, other, None, CPU_ALLOW)[0] is not None
    assert judge("torch_sdpa.math", "cpu", masked, REJECT, None, CPU_ALLOW)[0] is not None
    assert judge("torch_sdpa.flash", "cuda", masked, REJECT, None, CPU_ALLOW)[0] is not None


def test_judge_agreements_are_silent():
    assert judge("torch_sdpa.math", "cpu", CTX, [], None, ()) == (None, None)
    assert judge("torch_sdpa.math", "cpu", CTX, REJECT, "refused", ()) == (None, None)
