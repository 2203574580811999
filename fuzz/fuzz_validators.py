"""Fuzz the input validators of every public op (``lz.attention``, ``lz.rms_norm``, ``lz.layer_norm``,
``lz.rope``, ``lz.sample_topk``, ``lz.sample_topp``, ``lz.sample``, ``lz.sample_greedy``,
``lz.apply_penalties``, ``lz.apply_token_bitmask``).

Invariant: whatever the arguments, the only exceptions are LayerZero's typed errors (``LayerZeroError``:
``InvalidInputError`` for bad input, ``NoKernelFoundError`` / ``KernelExecutionError`` when dispatch has
nothing that can run). A bare ``RuntimeError`` / ``IndexError`` / ``TypeError`` / ``AssertionError`` from
torch or from the validators is a bug ("escape").

Each input's bytes choose an op, then every argument from pools of good and bad values: tensors of rank
0-5 with tiny dims (0-5), float/int/bool dtypes, the CPU or the "meta" device, NaN/inf contents, odd
strides; scalars such as 0, -1, 1.5, nan, inf, True, "x", numpy scalars, 0-d and 1-d tensors; unknown
layouts (including unhashable ones). The decoder is shared by both modes:

    PYTHONPATH=src python fuzz/fuzz_validators.py --runs 2000 --seed 0   # seeded random loop (no atheris)
    PYTHONPATH=src python fuzz/fuzz_validators.py -atheris_runs=100000   # coverage-guided, atheris installed

``KernelExecutionError`` is typed, so it is allowed, but it means validation accepted inputs that every
eligible kernel then failed on; the loop prints those separately as "kernel failures" worth a look. The
backend circuit breakers are reset after every input so one input cannot change the next one's outcome.
Exit status: 1 when an escape was found (the loop prints each distinct one with a reproducer), else 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.core.errors import KernelExecutionError, LayerZeroError  # noqa: E402
from layerzero.core.runtime import RUNTIME  # noqa: E402

logging.getLogger("layerzero").setLevel(logging.CRITICAL)  # fallbacks are expected here
warnings.filterwarnings("ignore")

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DTYPES = (*FLOATS, torch.float32, torch.float32, torch.int64, torch.int32, torch.bool, torch.uint8)
LAYOUTS: tuple[Any, ...] = (
    *(("BHSD", "BSHD") * 6),
    "bhsd",
    "SBHD",
    "",
    None,
    0,
    ["BHSD"],
    {"a": 1},
    lz.ReasonCode.DTYPE_UNSUPPORTED,
)


class Bytes:
    """Consume fuzz bytes as small choices; past the end every choice is 0 (deterministic)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        """The next byte (0 past the end)."""
        b = self.data[self.pos] if self.pos < len(self.data) else 0
        self.pos += 1
        return b

    def int(self, n: int) -> int:
        """A choice in ``[0, n)``."""
        return self.byte() % n if n > 1 else 0

    def pick(self, items: tuple[Any, ...] | list[Any]) -> Any:
        """One of ``items``."""
        return items[self.int(len(items))]

    def flag(self, one_in: int = 2) -> bool:
        """True with probability about ``1 / one_in``."""
        return self.int(one_in) == 0


def scalar(b: Bytes, good: tuple[Any, ...]) -> Any:
    """A good value most of the time, else one from a pool of hostile scalars."""
    if b.flag(6):
        return b.pick(
            (
                0,
                -1,
                1,
                2,
                0.0,
                -0.1,
                0.5,
                1.0,
                1.5,
                1e-300,
                1e300,
                2**70,
                math.nan,
                math.inf,
                -math.inf,
                True,
                False,
                None,
                "x",
                "0.5",
                [1],
                np.float32(0.5),
                np.int64(2),
                np.bool_(True),
                torch.tensor(0.5),
                torch.tensor(0.0),
                torch.zeros(2),
                torch.tensor(2),
                object(),
            )
        )
    return b.pick(good)


def tensor(
    b: Bytes, shape: tuple[int, ...], dtype: torch.dtype | None = None, device: str | None = None
) -> Any:
    """A tensor of about ``shape`` (sometimes mutated), random dtype/device/contents/strides; rarely not a
    tensor."""
    if b.int(60) == 0:
        return b.pick((None, 1.0, [[1.0]], np.ones(shape or (1,), dtype=np.float32), "tensor"))
    shape = list(shape)
    if b.flag(12) and shape:  # mutate the shape: drop, add, change or zero a dim
        op, i = b.int(4), b.int(len(shape))
        if op == 0:
            shape.pop(i)
        elif op == 1:
            shape.insert(i, b.int(4))
        elif op == 2:
            shape[i] = b.int(6)
        else:
            shape[i] = 0
    dtype = dtype if dtype is not None and not b.flag(16) else b.pick(DTYPES)
    device = device or DEVICE[0]
    if b.flag(30):
        device = "cpu" if device == "meta" else "meta"
    g = torch.Generator().manual_seed(b.byte())
    if dtype.is_floating_point:
        t = torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)
        if b.flag(8) and t.numel():
            t.view(-1)[0] = b.pick((math.nan, math.inf, -math.inf, 1e30))
    elif dtype is torch.bool:
        t = torch.rand(tuple(shape), generator=g) > 0.3
    else:
        t = torch.randint(-2, 20, tuple(shape), generator=g).to(dtype)
    if b.flag(8) and t.dim() >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    return t.to(device) if device != "cpu" else t


def dims(b: Bytes, n: int, lo: int = 1) -> list[int]:
    """``n`` small dims in ``[lo, 5]``."""
    return [lo + b.int(6 - lo) for _ in range(n)]


def attention_call(b: Bytes) -> Callable[[], Any]:
    """A call of lz.attention: q [B, Hq, S, D] / k, v [B, Hkv, Sk, D] (or BSHD), mask, flags, scale,
    dropout."""
    bsz, hkv, s, d = dims(b, 4)
    hq = hkv * (1 + b.int(3)) if not b.flag(8) else 1 + b.int(5)
    sk = s if b.flag(2) else 1 + b.int(5)
    layout = b.pick(LAYOUTS)
    bshd = layout == "BSHD"
    dt = b.pick(FLOATS)
    q = tensor(b, (bsz, s, hq, d) if bshd else (bsz, hq, s, d), dt)
    k = tensor(b, (bsz, sk, hkv, d) if bshd else (bsz, hkv, sk, d), dt)
    v = tensor(b, (bsz, sk, hkv, d) if bshd else (bsz, hkv, sk, d), dt)
    kw: dict[str, Any] = {"layout": layout}
    if b.flag(3):
        shape = b.pick(((s, sk), (1, 1, s, sk), (bsz, hq, s, sk), (sk,), (2, s, sk), (1, 1, 1, s, sk)))
        kw["attn_mask"] = tensor(b, shape, b.pick((torch.bool, dt, torch.int32)))
    if b.flag(2):
        kw["is_causal"] = scalar(b, (True, False))
    if b.flag(3):
        kw["scale"] = scalar(b, (None, 0.125, 1.0))
    if b.flag(3):
        kw["dropout_p"] = scalar(b, (0.0, 0.1, 0.5))
    return lambda: lz.attention(q, k, v, **kw)


def norm_call(b: Bytes, op: str) -> Callable[[], Any]:
    """A call of lz.rms_norm / lz.layer_norm: x [..., H], weight [H], bias/residual, eps."""
    h = b.int(6) + (0 if b.flag(10) else 1)
    lead = dims(b, b.int(3), lo=0 if b.flag(10) else 1)
    dt = b.pick(FLOATS)
    x = tensor(b, (*lead, h), dt)
    w = tensor(b, (h,), dt if b.flag(4) else b.pick(FLOATS))
    eps = scalar(b, (1e-6, 1e-5, 0.1))
    if op == "rms_norm":
        kw = {"residual": tensor(b, (*lead, h), dt)} if b.flag(3) else {}
        return lambda: lz.rms_norm(x, w, eps, **kw)
    bias = tensor(b, (h,), dt) if b.flag(2) else None
    return lambda: lz.layer_norm(x, w, bias, eps)


def rope_call(b: Bytes) -> Callable[[], Any]:
    """A call of lz.rope: q/k [B, H, S, D], cos/sin gathered [B|1, S, R] or a table [P, R] (+
    position_ids)."""
    bsz, hq, s, hd = dims(b, 4)
    d = 2 * hd
    r = 2 * (1 + b.int(hd)) if not b.flag(8) else b.int(2 * d + 2)
    hkv = 1 + b.int(hq)
    layout = b.pick(LAYOUTS)
    bshd = layout == "BSHD"
    dt = b.pick(FLOATS)
    q = tensor(b, (bsz, s, hq, d) if bshd else (bsz, hq, s, d), dt)
    k = tensor(b, (bsz, s, hkv, d) if bshd else (bsz, hkv, s, d), dt)
    form = b.int(3)
    kw: dict[str, Any] = {"layout": layout}
    if form == 0:  # gathered [B or 1, S, R]
        shape: tuple[int, ...] = (b.pick((1, bsz)), s, r)
    else:  # table [max_pos, R]
        shape = (s + b.int(4) - (1 if b.flag(8) else 0), r)
        if form == 2:
            pid_dtype = b.pick((torch.int64, torch.int64, torch.int32, torch.float32, torch.bool))
            pid = tensor(b, (b.pick((1, bsz)), s), pid_dtype)
            if (
                isinstance(pid, torch.Tensor)
                and pid.dtype in (torch.int64, torch.int32)
                and pid.device.type == "cpu"
            ):
                pid = pid.clamp(-1 if b.flag(10) else 0, shape[0] - (0 if b.flag(10) else 1))
            kw["position_ids"] = pid
    cos = tensor(b, shape, dt)
    sin = tensor(b, shape if not b.flag(10) else (shape[0], r + 2), dt)
    if b.flag(4):
        kw["interleaved"] = scalar(b, (True, False))
    return lambda: lz.rope(q, k, cos, sin, **kw)


def sampling_call(b: Bytes, op: str) -> Callable[[], Any]:
    """A call of lz.sample_topk / lz.sample_topp: logits [B, V], k or p, temperature, generator."""
    rows, vocab = dims(b, 2)
    logits = tensor(b, (rows, vocab), b.pick(FLOATS))
    kw: dict[str, Any] = {}
    if b.flag(2):
        kw["temperature"] = scalar(b, (0.0, 0.7, 1.0, 2.0))
    if b.flag(3):
        kw["generator"] = b.pick((torch.Generator().manual_seed(b.byte()), None, 42, "gen"))
    if op == "sample_topk":
        k = scalar(b, (1, 2, 3, 100))
        return lambda: lz.sample_topk(logits, k, **kw)
    p = scalar(b, (0.1, 0.5, 0.9, 1.0))
    return lambda: lz.sample_topp(logits, p, **kw)


def _row_param(b: Bytes, rows: int, dtype: torch.dtype, valid: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A per-row parameter ``[rows]``: mostly made valid by ``valid``, else anything :func:`tensor` gives."""
    t = tensor(b, (rows,), dtype)
    if isinstance(t, torch.Tensor) and t.dtype == dtype and not b.flag(4):
        t = valid(t)
    return t


def batch_sampling_call(b: Bytes) -> Callable[[], Any]:
    """A call of lz.sample: logits [B, V] and per-row temperature, top_k, top_p, min_p, seeds, offsets."""
    rows, vocab = dims(b, 2)
    logits = tensor(b, (rows, vocab), b.pick(FLOATS))
    f32, i64 = torch.float32, torch.int64
    params = (
        ("temperature", f32, lambda t: t.abs() * (t > 0)),
        ("top_k", i64, lambda t: t.abs()),
        ("top_p", f32, lambda t: t.abs().clamp(1e-3, 1.0)),
        ("min_p", f32, lambda t: t.abs().clamp(max=1.0)),
        ("seeds", i64, lambda t: t),
        ("offsets", i64, lambda t: t),
    )
    kw: dict[str, Any] = {}
    for name, dtype, valid in params:
        if b.flag(2):
            kw[name] = _row_param(b, rows, dtype, valid) if not b.flag(10) else scalar(b, (0.5,))
    if b.flag(4):
        kw["generator"] = b.pick((torch.Generator().manual_seed(b.byte()), None, 42))
    return lambda: lz.sample(logits, **kw)


def greedy_call(b: Bytes) -> Callable[[], Any]:
    """A call of lz.sample_greedy: logits [B, V] (B may be 0)."""
    rows, vocab = b.int(6), 1 + b.int(5)
    logits = tensor(b, (rows, vocab), b.pick(FLOATS))
    return lambda: lz.sample_greedy(logits)


def penalties_call(b: Bytes) -> Callable[[], Any]:
    """A call of lz.apply_penalties: logits [B, V], prompt/output ids [B, L] padded with V, per-row
    penalties."""
    rows, vocab = dims(b, 2)
    logits = tensor(b, (rows, vocab), b.pick(FLOATS))
    ids = []
    for _ in range(2):
        t = tensor(b, (rows, b.int(5)), b.pick((torch.int64, torch.int32)))
        if isinstance(t, torch.Tensor) and t.dtype in (torch.int64, torch.int32) and not b.flag(4):
            t = t.abs().clamp(max=vocab)
        ids.append(t)
    kw: dict[str, Any] = {}
    for name, valid in (
        ("repetition_penalty", lambda t: t.abs() + 0.1),
        ("presence_penalty", lambda t: t),
        ("frequency_penalty", lambda t: t),
    ):
        if b.flag(2):
            kw[name] = _row_param(b, rows, torch.float32, valid) if not b.flag(10) else scalar(b, (0.5,))
    return lambda: lz.apply_penalties(logits, ids[0], ids[1], **kw)


def token_bitmask_call(b: Bytes) -> Callable[[], Any]:
    """A call of lz.apply_token_bitmask: logits [R_all, V], int32 words [R, W], indices [R] (distinct rows
    mostly) or None."""
    n_all, vocab = dims(b, 2)
    logits = tensor(b, (n_all, vocab), b.pick(FLOATS))
    rows = n_all if b.flag(2) else b.int(n_all + 1)
    bits = tensor(b, (rows, 1 + b.int(3)), torch.int32)
    indices = None
    if rows != n_all or b.flag(3):
        indices = tensor(b, (rows,), b.pick((torch.int64, torch.int32)))
        if isinstance(indices, torch.Tensor) and indices.dim() == 1 and not b.flag(4):
            indices = torch.randperm(n_all)[: indices.shape[0]].to(indices.dtype)
    return lambda: lz.apply_token_bitmask(logits, bits, indices)


OPS = (
    "attention",
    "rms_norm",
    "layer_norm",
    "rope",
    "sample_topk",
    "sample_topp",
    "sample",
    "apply_penalties",
    "sample_greedy",
    "apply_token_bitmask",
)


DEVICE = ["cpu"]  # the device of the input being built (the decoder is single-threaded)


def build(data: bytes) -> tuple[str, Callable[[], Any]]:
    """Decode ``data`` into (op name, a zero-argument call of that op)."""
    b = Bytes(data)
    op = b.pick(OPS)
    DEVICE[0] = "meta" if b.flag(16) else "cpu"
    if op == "attention":
        return op, attention_call(b)
    if op in ("rms_norm", "layer_norm"):
        return op, norm_call(b, op)
    if op == "rope":
        return op, rope_call(b)
    if op == "sample":
        return op, batch_sampling_call(b)
    if op == "apply_penalties":
        return op, penalties_call(b)
    if op == "sample_greedy":
        return op, greedy_call(b)
    if op == "apply_token_bitmask":
        return op, token_bitmask_call(b)
    return op, sampling_call(b, op)


def run_one(data: bytes) -> tuple[str, str]:
    """Run one input. Returns (op, outcome) where outcome is "ok" or the LayerZeroError class name.

    Raises whatever non-LayerZero exception escaped (the bug this harness looks for).
    """
    op, call = build(data)
    try:
        call()
        outcome = "ok"
    except LayerZeroError as exc:
        outcome = type(exc).__name__
        if isinstance(exc, KernelExecutionError):
            outcome += f": {str(exc)[:160]}"
    finally:
        RUNTIME.health.reset()
    return op, outcome


def test_one_input(data: bytes) -> None:
    """atheris entry point: let escapes propagate so atheris reports them with the input."""
    run_one(data)


def loop(runs: int, seed: int) -> int:
    """The fallback: ``runs`` random inputs from ``random.Random(seed)``; prints a summary; 1 on escapes."""
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    kernel_failures: dict[str, int] = {}
    escapes: dict[tuple[str, str], tuple[int, bytes, str]] = {}
    for i in range(runs):
        data = rng.randbytes(rng.randint(1, 160))
        try:
            op, outcome = run_one(data)
        except Exception as exc:  # noqa: BLE001 - every escape is recorded
            op = OPS[data[0] % len(OPS)]
            where = traceback.extract_tb(exc.__traceback__)[-1]
            key = (type(exc).__name__, f"{Path(where.filename).name}:{where.lineno}")
            if key not in escapes:
                escapes[key] = (i, data, f"{op}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        name = outcome.split(":", 1)[0]
        outcomes[f"{op} {name}"] = outcomes.get(f"{op} {name}", 0) + 1
        if name == "KernelExecutionError":
            kernel_failures[outcome] = kernel_failures.get(outcome, 0) + 1
    print(f"fuzz_validators: {runs} inputs, seed {seed}")
    for key in sorted(outcomes):
        print(f"  {key}: {outcomes[key]}")
    if kernel_failures:
        print(f"kernel failures on accepted inputs ({sum(kernel_failures.values())}):")
        for msg, n in sorted(kernel_failures.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {n} x {msg}")
    if escapes:
        print(f"ESCAPES ({len(escapes)} distinct):")
        for (etype, where), (i, data, msg) in escapes.items():
            print(f"  [{etype} at {where}] input #{i}: {msg}")
            print(f"    reproduce: run_one(bytes.fromhex('{data.hex()}'))")
        return 1
    print("no escapes")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``--runs`` / ``--seed``; use atheris when installed and ``--runs`` is not given."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="random-loop iterations (no atheris)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random loop")
    args, rest = parser.parse_known_args(argv)
    lz.configure(use_perfdb=False)  # selection needs no measurements here; never touch the user's PerfDB
    if args.runs is None:
        try:
            import atheris  # optional, imported lazily
        except ImportError:
            print("atheris is not installed; running the random loop (--runs 2000)", file=sys.stderr)
            return loop(2000, args.seed)
        atheris.Setup([sys.argv[0], *rest], test_one_input)
        atheris.Fuzz()
        return 0
    return loop(args.runs, args.seed)


if __name__ == "__main__":
    sys.exit(main())
