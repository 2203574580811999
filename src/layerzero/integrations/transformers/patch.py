"""Route a loaded Hugging Face model's RMSNorm, RoPE and attention through LayerZero, undoably.

:func:`patch_model` looks the model's ``config.model_type`` up in one table (:data:`MODEL_PATCH_TABLE`,
the Liger ``MODEL_TYPE_TO_APPLY_LIGER_FN`` idea without one near-copy function per model) and:

- ``rms_norm``: replaces ``forward`` on every *live instance* of the model type's RMSNorm class (never the
  class, so other models are untouched) by one calling :func:`layerzero.rms_norm`;
- ``rope``: swaps the modeling module's ``apply_rotary_pos_emb`` for one calling :func:`layerzero.rope`.
  This is module-level, so it is reference-counted: two patched models of one type share it and the
  original comes back when the last handle undoes. While it is active, *unpatched* models of the same
  type also use it (numerically the same as transformers' function);
- ``attention``: registers ``"layerzero"`` (see :mod:`.attention`) and switches the model to it.

Every replacement is validated first (the module has ``weight`` [H] and ``variance_epsilon``/``eps``; the
replacement's signature equals the original's), following huggingface/kernels ``_validate_layer``.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import logging
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from layerzero import ops as lz_ops
from layerzero.core.errors import ConfigurationError, InvalidInputError, did_you_mean, expected_got

from .attention import ATTN_IMPLEMENTATION, register

logger = logging.getLogger("layerzero.integrations.transformers")


class PatchOp(str, enum.Enum):
    """What :func:`patch_model` can route through LayerZero."""

    ATTENTION = "attention"
    RMS_NORM = "rms_norm"
    ROPE = "rope"


DEFAULT_OPS: tuple[str, ...] = (PatchOp.ATTENTION.value, PatchOp.RMS_NORM.value, PatchOp.ROPE.value)


@dataclass(frozen=True, slots=True)
class ModelPatchSpec:
    """What to patch for one ``config.model_type``.

    Attributes:
        modeling_module: import path of the transformers modeling module.
        rms_norm_classes: names of the RMSNorm classes in that module whose live instances are patched.
        rope_function: name of the module-level RoPE function the attention layers call.
    """

    modeling_module: str
    rms_norm_classes: tuple[str, ...]
    rope_function: str = "apply_rotary_pos_emb"


MODEL_PATCH_TABLE: Mapping[str, ModelPatchSpec] = types.MappingProxyType(
    {
        "llama": ModelPatchSpec("transformers.models.llama.modeling_llama", ("LlamaRMSNorm",)),
        "mistral": ModelPatchSpec("transformers.models.mistral.modeling_mistral", ("MistralRMSNorm",)),
        "qwen2": ModelPatchSpec("transformers.models.qwen2.modeling_qwen2", ("Qwen2RMSNorm",)),
        "qwen3": ModelPatchSpec("transformers.models.qwen3.modeling_qwen3", ("Qwen3RMSNorm",)),
        "qwen3_moe": ModelPatchSpec("transformers.models.qwen3_moe.modeling_qwen3_moe", ("Qwen3MoeRMSNorm",)),
    }
)
#: ``config.model_type`` values :func:`patch_model` accepts.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(MODEL_PATCH_TABLE))

_MARKER = "_layerzero_patch_handle"
_MISSING = object()


@dataclass(frozen=True, slots=True)
class PatchRecord:
    """One thing a :class:`PatchHandle` changed: ``op``, the ``target`` (class, function or config) and
    ``count`` (module instances for ``rms_norm``, else 1)."""

    op: PatchOp
    target: str
    count: int = 1


# --- replacements -----------------------------------------------------------------------------------


def _rms_forward_variance_epsilon(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return lz_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _rms_forward_eps(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return lz_ops.rms_norm(hidden_states, self.weight, self.eps)


_RMS_REPLACEMENTS = (_rms_forward_variance_epsilon, _rms_forward_eps)


def lz_apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb`` (half-rotation RoPE, Su et al. 2021) via
    :func:`layerzero.rope`.

    Args:
        q: [B, Hq, S, D] (``unsqueeze_dim=1``) or [B, S, Hq, D] (``unsqueeze_dim=2``).
        k: [B, Hkv, S, D] or [B, S, Hkv, D], same layout as ``q``.
        cos, sin: [B | 1, S, R] gathered per position (``LlamaRotaryEmbedding`` output), R <= D; a batch of 1
            is broadcast to ``q``'s batch.
        unsqueeze_dim: 1 or 2, as in transformers.

    Returns:
        ``(q_rot, k_rot)`` with the input shapes and dtypes.

    Raises:
        InvalidInputError: ``unsqueeze_dim`` is not 1 or 2; anything :func:`layerzero.rope` raises.
    """
    if unsqueeze_dim not in (1, 2):
        raise InvalidInputError(
            expected_got(
                "apply_rotary_pos_emb unsqueeze_dim",
                "1 (BHSD) or 2 (BSHD)",
                unsqueeze_dim,
                "Only the two transformers layouts are routed.",
            )
        )
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if cos.dim() == 3 and cos.shape[0] == 1 and q.shape[0] > 1:
        cos, sin = cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1)
    q_out, k_out = lz_ops.rope(q, k, cos, sin)
    if unsqueeze_dim == 2:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


# --- module-level RoPE swap, refcounted (the one process-global state this module keeps) -------------

_ROPE_LOCK = threading.Lock()
_ROPE_SLOTS: dict[tuple[str, str], list[Any]] = {}  # (module, name) -> [original function, refcount]


def _rope_acquire(module: types.ModuleType, name: str) -> None:
    with _ROPE_LOCK:
        slot = _ROPE_SLOTS.get((module.__name__, name))
        if slot is None:
            _ROPE_SLOTS[(module.__name__, name)] = [getattr(module, name), 1]
            setattr(module, name, lz_apply_rotary_pos_emb)
        else:
            slot[1] += 1


def _rope_release(module: types.ModuleType, name: str) -> None:
    with _ROPE_LOCK:
        slot = _ROPE_SLOTS.get((module.__name__, name))
        if slot is None:
            return
        slot[1] -= 1
        if slot[1] > 0:
            return
        del _ROPE_SLOTS[(module.__name__, name)]
        if getattr(module, name) is lz_apply_rotary_pos_emb:
            setattr(module, name, slot[0])
        else:
            logger.warning(
                "%s.%s was replaced by someone else after LayerZero patched it; leaving theirs",
                module.__name__,
                name,
            )


def rope_refcount(modeling_module: str, name: str = "apply_rotary_pos_emb") -> int:
    """How many live :class:`PatchHandle` s currently share the RoPE swap of ``modeling_module.name``."""
    with _ROPE_LOCK:
        slot = _ROPE_SLOTS.get((modeling_module, name))
        return 0 if slot is None else int(slot[1])


# --- validation -------------------------------------------------------------------------------------


def _signature_problem(
    original: Callable[..., Any], replacement: Callable[..., Any], what: str
) -> str | None:
    try:
        want, got = inspect.signature(original), inspect.signature(replacement)
    except (TypeError, ValueError) as exc:
        return f"{what}: cannot read the signature ({exc})"
    shape = [(p.name, p.kind, p.default) for p in want.parameters.values()]
    if shape != [(p.name, p.kind, p.default) for p in got.parameters.values()]:
        return f"{what}: signature {want} differs from LayerZero's replacement {got} (transformers version?)"
    return None


def _rms_problem(name: str, module: torch.nn.Module) -> tuple[Callable[..., Any] | None, str | None]:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        got = None if weight is None else tuple(getattr(weight, "shape", ()))
        return None, f"{name}: expected a 1-D `weight` [H], got {got}"
    if isinstance(getattr(module, "variance_epsilon", None), (int, float)):
        replacement = _rms_forward_variance_epsilon
    elif isinstance(getattr(module, "eps", None), (int, float)):
        replacement = _rms_forward_eps
    else:
        return None, f"{name}: expected a float `variance_epsilon` or `eps` attribute, found neither"
    if getattr(module.__dict__.get("forward"), "__func__", None) in _RMS_REPLACEMENTS:
        return None, f"{name}: already routed through LayerZero by another handle"
    problem = _signature_problem(module.forward, types.MethodType(replacement, module), f"{name}.forward")
    return (None, problem) if problem else (replacement, None)


def _parse_ops(ops: Iterable[str | PatchOp]) -> tuple[PatchOp, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    parsed: list[PatchOp] = []
    for op in ops:
        try:
            parsed.append(PatchOp(op))
        except ValueError:
            raise ConfigurationError(
                expected_got(
                    "patch_model ops entry",
                    f"one of {list(DEFAULT_OPS)}",
                    repr(op),
                    "Fix the name." + did_you_mean(str(op), DEFAULT_OPS),
                )
            ) from None
    if not parsed:
        raise ConfigurationError(
            expected_got(
                "patch_model ops",
                f"a non-empty subset of {list(DEFAULT_OPS)}",
                "an empty sequence",
                "Name at least one op.",
            )
        )
    return tuple(dict.fromkeys(parsed))


def _configs(model: torch.nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    todo = [m.config for m in model.modules() if getattr(m, "config", None) is not None]
    while todo:
        cfg = todo.pop()
        if id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen[id(cfg)] = cfg
        todo.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", {}) or {})
        todo = [c for c in todo if c is not None]
    return list(seen.values())


# --- the handle -------------------------------------------------------------------------------------


class PatchHandle:
    """Undo handle returned by :func:`patch_model`; also a context manager (undo on exit).

    Attributes:
        model: the patched model.
        patched: what was changed, one :class:`PatchRecord` per op target.
        skipped: one human-readable reason per target left alone (only with ``strict=False``).
        active: False once :meth:`undo` ran.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.patched: tuple[PatchRecord, ...] = ()
        self.skipped: tuple[str, ...] = ()
        self.active = True
        self._undo: list[Callable[[], None]] = []

    def undo(self) -> None:
        """Restore every original forward, the RoPE function (when this was its last user) and the
        attention implementation. A second call is a no-op."""
        if not self.active:
            return
        self.active = False
        errors: list[BaseException] = []
        while self._undo:
            step = self._undo.pop()
            try:
                step()
            except Exception as exc:  # keep undoing the rest; report at the end
                errors.append(exc)
        if self.model.__dict__.get(_MARKER) is self:
            del self.model.__dict__[_MARKER]
        if errors:
            raise ConfigurationError(
                f"patch undo: {len(errors)} step(s) failed, first: {errors[0]!r}"
            ) from errors[0]

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        ops = ", ".join(f"{r.op.value}:{r.target}x{r.count}" for r in self.patched)
        return f"PatchHandle(active={self.active}, patched=[{ops}])"


def patch_model(
    model: torch.nn.Module, *, ops: Iterable[str | PatchOp] = DEFAULT_OPS, strict: bool = True
) -> PatchHandle:
    """Route a transformers model's ``attention``, ``rms_norm`` and ``rope`` through LayerZero.

    Args:
        model: a loaded transformers model whose ``config.model_type`` is in :data:`SUPPORTED_MODEL_TYPES`.
        ops: any of ``"attention"``, ``"rms_norm"``, ``"rope"`` (default: all three). ``"attention"``
            registers ``attn_implementation="layerzero"`` and switches the model to it.
        strict: True (default) refuses, before changing anything, when any target cannot be patched (no
            RMSNorm instance found, an instance without ``weight`` [H] / ``eps``, a signature that differs
            from the replacement's, the attention implementation not switchable). False patches what it can,
            logs a WARNING per skipped target and lists them in ``handle.skipped``.

    Returns:
        A :class:`PatchHandle`; ``handle.undo()`` (or leaving ``with patch_model(m):``) restores everything.

    Raises:
        InvalidInputError: ``model`` is not a ``torch.nn.Module``.
        ConfigurationError: no ``config.model_type``, an unsupported model type (lists the supported ones), an
            unknown op name, the model is already patched (undo the first handle; patching twice is refused
            rather than refcounted), or a validation failure with ``strict=True``.

    >>> handle = patch_model(model)  # doctest: +SKIP
    >>> handle.undo()  # doctest: +SKIP
    """
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(
            expected_got(
                "patch_model model",
                "a transformers PreTrainedModel",
                type(model).__name__,
                "Pass the loaded model object.",
            )
        )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        raise ConfigurationError(
            expected_got(
                "patch_model model.config.model_type",
                "a string such as 'llama'",
                repr(model_type),
                "Pass a transformers PreTrainedModel.",
            )
        )
    spec = MODEL_PATCH_TABLE.get(model_type)
    if spec is None:
        raise ConfigurationError(
            expected_got(
                "patch_model model_type",
                f"one of {list(SUPPORTED_MODEL_TYPES)}",
                repr(model_type),
                "Add an entry to MODEL_PATCH_TABLE or load with attn_implementation='layerzero' only."
                + did_you_mean(model_type, SUPPORTED_MODEL_TYPES),
            )
        )
    wanted = _parse_ops(ops)
    existing = model.__dict__.get(_MARKER)
    if existing is not None and existing.active:
        raise ConfigurationError(
            expected_got(
                "patch_model",
                "an unpatched model",
                f"one patched by {existing!r}",
                "Call handle.undo() on the first handle before patching again.",
            )
        )

    problems: list[str] = []
    rms_plan: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
    modeling = importlib.import_module(spec.modeling_module)
    if PatchOp.RMS_NORM in wanted:
        classes = [getattr(modeling, n, None) for n in spec.rms_norm_classes]
        if any(c is None for c in classes):
            problems.append(f"rms_norm: {spec.modeling_module} lacks one of {spec.rms_norm_classes}")
        classes_t = tuple(c for c in classes if c is not None)
        for name, module in model.named_modules():
            if classes_t and type(module) in classes_t:
                replacement, problem = _rms_problem(name or type(module).__name__, module)
                if problem:
                    problems.append(f"rms_norm: {problem}")
                else:
                    rms_plan.append((module, replacement))
        if not rms_plan and not problems:
            problems.append(f"rms_norm: no instance of {spec.rms_norm_classes} in the model")
    rope_ok = False
    if PatchOp.ROPE in wanted:
        current = getattr(modeling, spec.rope_function, None)
        if current is None:
            problems.append(f"rope: {spec.modeling_module} has no {spec.rope_function}")
        elif current is lz_apply_rotary_pos_emb:
            rope_ok = True  # shared with another patched model: refcount
        else:
            problem = _signature_problem(current, lz_apply_rotary_pos_emb, f"rope: {spec.rope_function}")
            if problem:
                problems.append(problem)
            rope_ok = problem is None
    if problems and strict:
        raise ConfigurationError(
            f"patch_model({model_type}): nothing was patched; {len(problems)} problem(s): "
            + "; ".join(problems)
            + ". Fix them or pass strict=False to skip those targets."
        )
    for problem in problems:
        logger.warning("patch_model(%s): skipped %s", model_type, problem)

    handle = PatchHandle(model)
    records: list[PatchRecord] = []
    try:
        if rms_plan:
            for module, replacement in rms_plan:
                old = module.__dict__.get("forward", _MISSING)
                new = types.MethodType(replacement, module)
                module.forward = new
                handle._undo.append(_restore_forward(module, old, new))
            names = sorted({type(m).__name__ for m, _ in rms_plan})
            records.append(PatchRecord(PatchOp.RMS_NORM, ",".join(names), len(rms_plan)))
        if rope_ok:
            _rope_acquire(modeling, spec.rope_function)
            handle._undo.append(lambda: _rope_release(modeling, spec.rope_function))
            records.append(PatchRecord(PatchOp.ROPE, f"{spec.modeling_module}.{spec.rope_function}"))
        if PatchOp.ATTENTION in wanted:
            problem = _switch_attention(model, handle)
            if problem is None:
                records.append(PatchRecord(PatchOp.ATTENTION, f"attn_implementation={ATTN_IMPLEMENTATION}"))
            elif strict:
                raise ConfigurationError(f"patch_model({model_type}): {problem}. Nothing was left patched.")
            else:
                logger.warning("patch_model(%s): skipped %s", model_type, problem)
                problems.append(problem)
    except BaseException:
        handle.undo()
        raise
    handle.patched, handle.skipped = tuple(records), tuple(problems)
    model.__dict__[_MARKER] = handle
    logger.info("patch_model(%s): %s", model_type, handle)
    return handle


def _restore_forward(module: torch.nn.Module, old: Any, new: Any) -> Callable[[], None]:
    def restore() -> None:
        if module.__dict__.get("forward") is not new:
            logger.warning(
                "%s.forward was replaced after LayerZero patched it; leaving it", type(module).__name__
            )
            return
        if old is _MISSING:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = old

    return restore


def _switch_attention(model: torch.nn.Module, handle: PatchHandle) -> str | None:
    register()
    snapshot = [(cfg, cfg.__dict__.get("_attn_implementation_internal", _MISSING)) for cfg in _configs(model)]

    def restore() -> None:
        for cfg, old in snapshot:
            if old is _MISSING:
                cfg.__dict__.pop("_attn_implementation_internal", None)
            else:
                cfg._attn_implementation_internal = old

    handle._undo.append(restore)
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    got = getattr(model.config, "_attn_implementation", None)
    if got != ATTN_IMPLEMENTATION:
        return expected_got(
            "attention: model.config._attn_implementation",
            repr(ATTN_IMPLEMENTATION),
            repr(got),
            f"{type(model).__name__} cannot switch attention dynamically; load it with "
            "layerzero.integrations.transformers.from_pretrained instead",
        )
    return None
