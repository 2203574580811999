"""Synthetic inputs for tuning: ``make_inputs(op, **shape)`` -> ``(args, kwargs)`` of ``lz.<op>``.

``lz.tune`` and ``layerzero tune`` describe a case by its shape parameters (batch, heads, sequence length,
head dim, hidden size, dtype, device, ...); this module turns them into seeded random tensors so that every
run of a tune measures the same data. Values are standard normal (``torch.randn`` on the CPU with a seeded
generator, then moved and cast), which keeps attention and norms in their well-conditioned range.
"""

from __future__ import annotations

from typing import Any

import torch

from layerzero.core.errors import InvalidInputError, UnknownOperationError, did_you_mean, expected_got

__all__ = ["SHAPE_DEFAULTS", "make_inputs"]

_COMMON = {"dtype": "float32", "device": "cpu", "seed": 0}
SHAPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "attention": {
        "batch": 1,
        "heads": 8,
        "kv_heads": None,
        "seq": 128,
        "kv_seq": None,
        "head_dim": 64,
        "causal": False,
        "layout": "BHSD",
        "mask": "none",
        **_COMMON,
    },
    "rms_norm": {"batch": 1, "seq": 128, "hidden": 4096, "residual": False, "eps": 1e-6, **_COMMON},
    "layer_norm": {"batch": 1, "seq": 128, "hidden": 4096, "bias": True, "eps": 1e-5, **_COMMON},
    "swiglu": {"batch": 1, "seq": 128, "hidden": 11008, **_COMMON},
    "rope": {
        "batch": 1,
        "heads": 8,
        "kv_heads": None,
        "seq": 128,
        "head_dim": 64,
        "interleaved": False,
        **_COMMON,
    },
    "sample_topk": {"batch": 1, "vocab": 32000, "top_k": 50, "temperature": 1.0, **_COMMON},
    "sample_topp": {"batch": 1, "vocab": 32000, "top_p": 0.9, "temperature": 1.0, **_COMMON},
    "sample_greedy": {"batch": 1, "vocab": 32000, **_COMMON},
}
"""Every op's shape parameters and their defaults (token counts for ``seq``/``kv_seq``, elements
otherwise)."""

_INT_FIELDS = frozenset(
    {"batch", "heads", "kv_heads", "seq", "kv_seq", "head_dim", "hidden", "vocab", "top_k"}
)
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _fail(what: str, expected: Any, got: Any, fix: str | None = None) -> InvalidInputError:
    return InvalidInputError(expected_got(f"make_inputs: {what}", expected, got, fix))


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise _fail("dtype", f"one of {sorted(_DTYPES)} (str or torch.dtype)", repr(value))


def _resolve(op: str, shape: dict[str, Any]) -> dict[str, Any]:
    if op not in SHAPE_DEFAULTS:
        raise UnknownOperationError(
            f"make_inputs: unknown op {op!r}.{did_you_mean(str(op), SHAPE_DEFAULTS)} "
            f"Ops with shape parameters: {sorted(SHAPE_DEFAULTS)}."
        )
    known = SHAPE_DEFAULTS[op]
    for name in shape:
        if name not in known:
            raise InvalidInputError(
                f"make_inputs: unknown shape parameter {name!r} of op {op!r}."
                f"{did_you_mean(str(name), known)} Pass only these names."
            )
    out = {**known, **shape}
    for name in _INT_FIELDS & out.keys():
        value = out[name]
        if value is None and name in ("kv_heads", "kv_seq"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _fail(name, "an int > 0", repr(value))
    out["dtype"] = _dtype(out["dtype"])
    try:
        out["device"] = torch.device(out["device"])
    except (RuntimeError, TypeError) as exc:
        raise _fail("device", "a torch device such as 'cpu' or 'cuda:0'", repr(out["device"])) from exc
    if not isinstance(out["seed"], int) or isinstance(out["seed"], bool):
        raise _fail("seed", "an int", repr(out["seed"]))
    return out


def make_inputs(op: str, **shape: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Seeded random inputs of ``lz.<op>`` for the given shape parameters: ``(args, kwargs)`` to pass as
    ``lz.<op>(*args, **kwargs)`` or as one case of ``lz.tune``.

    Parameters per op (defaults in :data:`SHAPE_DEFAULTS`; every op also takes ``dtype`` (str or
    ``torch.dtype``: float32/float64/float16/bfloat16), ``device`` and ``seed``):

    - attention: ``batch`` B, ``heads`` Hq, ``kv_heads`` Hkv (default Hq), ``seq`` Sq and ``kv_seq`` Sk
      (tokens; Sk defaults to Sq), ``head_dim`` D, ``causal``, ``layout`` (``"BHSD"``: q ``[B, Hq, Sq, D]``,
      k/v ``[B, Hkv, Sk, D]``; ``"BSHD"``: q ``[B, Sq, Hq, D]``), ``mask`` (``"none"``, ``"bool"`` all-True
      or ``"float"`` all-zero, shape ``[B, 1, Sq, Sk]``).
    - rms_norm / layer_norm: x ``[batch, seq, hidden]``, weight ``[hidden]``; ``residual`` (rms_norm: also a
      residual like x), ``bias`` (layer_norm: a ``[hidden]`` bias), ``eps``.
    - swiglu: gate and up ``[batch, seq, hidden]`` (hidden = the MLP's intermediate size).
    - rope: q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``, cos/sin ``[B, S, D]``; ``interleaved``.
    - sample_topk / sample_topp: logits ``[batch, vocab]``, ``top_k`` / ``top_p``, ``temperature``, and a
      ``torch.Generator`` seeded with ``seed`` (so kernels can be compared on the same random stream).
    - sample_greedy: logits ``[batch, vocab]``.

    Raises:
        UnknownOperationError: ``op`` has no shape parameters (see :data:`SHAPE_DEFAULTS`).
        InvalidInputError: an unknown parameter name, a size that is not an int > 0, an unknown dtype or
            device string. Shape combinations the op refuses (``Hq % Hkv != 0``, ...) raise the op's own
            ``InvalidInputError`` when the case is prepared.

    >>> args, kwargs = make_inputs("attention", batch=2, heads=4, kv_heads=2, seq=16, head_dim=8)
    >>> [tuple(t.shape) for t in args], kwargs["is_causal"]
    ([(2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)], False)
    """
    s = _resolve(op, shape)
    dtype, dev = s["dtype"], s["device"]
    g = torch.Generator(device="cpu").manual_seed(s["seed"])

    def t(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g, dtype=torch.float32).to(device=dev, dtype=dtype)

    if op == "attention":
        b, hq, sq, d = s["batch"], s["heads"], s["seq"], s["head_dim"]
        hkv, sk = s["kv_heads"] or hq, s["kv_seq"] or sq
        bshd = s["layout"] == "BSHD"
        q = t(*((b, sq, hq, d) if bshd else (b, hq, sq, d)))
        k, v = (t(*((b, sk, hkv, d) if bshd else (b, hkv, sk, d))) for _ in range(2))
        mask = {
            "none": None,
            "bool": lambda: torch.ones(b, 1, sq, sk, dtype=torch.bool, device=dev),
            "float": lambda: torch.zeros(b, 1, sq, sk, dtype=dtype, device=dev),
        }
        if s["mask"] not in mask:
            raise _fail("mask", "'none', 'bool' or 'float'", repr(s["mask"]))
        make_mask = mask[s["mask"]]
        return (q, k, v), {
            "attn_mask": None if make_mask is None else make_mask(),
            "is_causal": s["causal"],
            "layout": s["layout"],
        }
    if op == "rms_norm":
        x, w = t(s["batch"], s["seq"], s["hidden"]), t(s["hidden"])
        kwargs: dict[str, Any] = {"residual": t(s["batch"], s["seq"], s["hidden"])} if s["residual"] else {}
        return (x, w, s["eps"]), kwargs
    if op == "layer_norm":
        x, w = t(s["batch"], s["seq"], s["hidden"]), t(s["hidden"])
        return (x, w, t(s["hidden"]) if s["bias"] else None, s["eps"]), {}
    if op == "swiglu":  # hidden = the MLP's intermediate size
        return (t(s["batch"], s["seq"], s["hidden"]), t(s["batch"], s["seq"], s["hidden"])), {}
    if op == "rope":
        hkv = s["kv_heads"] or s["heads"]
        q, k = t(s["batch"], s["heads"], s["seq"], s["head_dim"]), t(s["batch"], hkv, s["seq"], s["head_dim"])
        cos, sin = t(s["batch"], s["seq"], s["head_dim"]), t(s["batch"], s["seq"], s["head_dim"])
        return (q, k, cos, sin), {"interleaved": s["interleaved"]}
    if op == "sample_greedy":
        return (t(s["batch"], s["vocab"]),), {}
    gen = torch.Generator(device=dev).manual_seed(s["seed"])
    logits = t(s["batch"], s["vocab"])
    k_or_p = s["top_k"] if op == "sample_topk" else s["top_p"]
    return (logits, k_or_p), {"temperature": s["temperature"], "generator": gen}
