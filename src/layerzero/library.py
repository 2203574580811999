"""LayerZero ops as ``torch.library`` custom ops (namespace ``layerzero``): what ``torch.compile`` and
``torch.export`` see.

Under TorchDynamo, ``lz.attention`` / ``lz.rms_norm`` (plain and with ``residual``) / ``lz.layer_norm`` / ``lz.rope``
/ ``lz.swiglu`` / ``lz.geglu`` / ``lz.reglu`` call ``torch.ops.layerzero.<op>`` (this module is imported then, at
trace time, which registers the ops; eager code never imports it): one opaque node per call with a fake (meta)
implementation for shapes and dtypes, so a compiled model has no graph breaks at lz ops, and selection happens when
the compiled graph first runs the op for real (the op's implementation is the eager ``lz.<op>``: validation,
cache, kernel), never while tracing. ``torch.export`` graphs hold ``torch.ops.layerzero.<op>.default`` nodes.

Each function here takes and returns what the ``lz`` op it names does (shapes, dtypes, units, the typed errors of its
eager validation, the paper or library it follows: see that op's docstring); the fake implementations only give the
output shapes and dtypes.

Also ``lz.paged_attention``, ``lz.reshape_and_cache`` (mutates ``kv_cache``), ``lz.fused_moe``,
``lz.apply_penalties`` and ``lz.sample`` without a ``generator`` (custom ops cannot take a ``torch.Generator``: calls
with one, and ``lz.sample_topk`` / ``lz.sample_topp``, are traced as Python, as before).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["attention", "fused_add_rms_norm", "fused_moe", "geglu", "layer_norm", "paged_attention", "reglu",
           "reshape_and_cache", "rms_norm", "rope", "sample", "apply_penalties", "swiglu"]

NS = "layerzero"


def _lz() -> Any:
    import layerzero

    return layerzero


def _layout_str(layout: Any) -> str:
    """A layout argument (``"BHSD"``, ``Layout.BHSD``, ``KVLayout.NHD``, ...) as the string custom ops take."""
    return layout if isinstance(layout, str) else str(getattr(layout, "value", layout))


# -------------------------------------------------------------------------------------------- attention
@torch.library.custom_op(f"{NS}::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],  # noqa: UP045
               is_causal: bool, scale: Optional[float], dropout_p: float, layout: str,  # noqa: UP045
               window_left: Optional[int], window_right: Optional[int],  # noqa: UP045
               softcap: Optional[float]) -> torch.Tensor:  # noqa: UP045
    window = None if window_left is None or window_right is None else (window_left, window_right)
    return _lz().attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                           layout=layout, window=window, softcap=softcap)


@_attention.register_fake
def _(q, k, v, attn_mask, is_causal, scale, dropout_p, layout, window_left, window_right, softcap):
    return q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
              scale: float | None, dropout_p: float, layout: Any, window: Any, softcap: float | None) -> torch.Tensor:
    """``torch.ops.layerzero.attention`` with ``lz.attention``'s arguments (layout as a string, window split)."""
    left, right = (None, None) if window is None else (int(window[0]), int(window[1]))
    return _attention(q, k, v, attn_mask, bool(is_causal), scale, float(dropout_p), _layout_str(layout), left, right,
                      softcap)


# -------------------------------------------------------------------------------------------- norms
@torch.library.custom_op(f"{NS}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``lz.rms_norm(x, weight, eps)`` as a custom op."""
    return _lz().rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lz.rms_norm(x, weight, eps, residual=residual)`` -> ``(y, x + residual)`` as a custom op."""
    y, h = _lz().rms_norm(x, weight, eps, residual=residual)
    return y, h


@fused_add_rms_norm.register_fake
def _(x, weight, eps, residual):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op(f"{NS}::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
               eps: float) -> torch.Tensor:
    """``lz.layer_norm`` as a custom op."""
    return _lz().layer_norm(x, weight, bias, eps)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


# -------------------------------------------------------------------------------------------- rope
@torch.library.custom_op(f"{NS}::rope", mutates_args=())
def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          position_ids: Optional[torch.Tensor], interleaved: bool,  # noqa: UP045
          layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = _lz().rope(q, k, cos, sin, position_ids=position_ids, interleaved=interleaved, layout=layout)
    return qo, ko


@_rope.register_fake
def _(q, k, cos, sin, position_ids, interleaved, layout):
    return torch.empty_like(q), torch.empty_like(k)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None,
         interleaved: bool, layout: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.rope`` with ``lz.rope``'s arguments (layout as a string)."""
    return _rope(q, k, cos, sin, position_ids, bool(interleaved), _layout_str(layout))


# -------------------------------------------------------------------------------------------- gated MLPs
@torch.library.custom_op(f"{NS}::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``lz.swiglu`` as a custom op."""
    return _lz().swiglu(gate, up)


@torch.library.custom_op(f"{NS}::geglu", mutates_args=())
def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """``lz.geglu`` as a custom op."""
    return _lz().geglu(gate, up, approximate=approximate)


@torch.library.custom_op(f"{NS}::reglu", mutates_args=())
def reglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``lz.reglu`` as a custom op."""
    return _lz().reglu(gate, up)


@swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@geglu.register_fake
def _(gate, up, approximate):
    return torch.empty_like(gate)


@reglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


# -------------------------------------------------------------------------------------------- paged KV cache, MoE
@torch.library.custom_op(f"{NS}::paged_attention", mutates_args=())
def _paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     cu_seqlens_q: Optional[torch.Tensor], scale: Optional[float],  # noqa: UP045
                     is_causal: bool, kv_layout: str) -> torch.Tensor:
    return _lz().paged_attention(q, kv_cache, block_tables, seq_lens, cu_seqlens_q=cu_seqlens_q, scale=scale,
                                 is_causal=is_causal, kv_layout=kv_layout)


@_paged_attention.register_fake
def _(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout):
    return torch.empty_like(q)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor | None, scale: float | None, is_causal: bool,
                    kv_layout: Any) -> torch.Tensor:
    """``torch.ops.layerzero.paged_attention`` with ``lz.paged_attention``'s arguments."""
    return _paged_attention(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, bool(is_causal),
                            _layout_str(kv_layout))


@torch.library.custom_op(f"{NS}::reshape_and_cache", mutates_args=("kv_cache",))
def _reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_layout: str) -> None:
    _lz().reshape_and_cache(k, v, kv_cache, slot_mapping, kv_layout)


@_reshape_and_cache.register_fake
def _(k, v, kv_cache, slot_mapping, kv_layout):
    return None


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_layout: Any) -> None:
    """``torch.ops.layerzero.reshape_and_cache`` (writes ``kv_cache`` in place)."""
    _reshape_and_cache(k, v, kv_cache, slot_mapping, _layout_str(kv_layout))


@torch.library.custom_op(f"{NS}::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``lz.fused_moe`` as a custom op."""
    return _lz().fused_moe(x, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


# -------------------------------------------------------------------------------------------- sampling step
@torch.library.custom_op(f"{NS}::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: Optional[torch.Tensor], top_k: Optional[torch.Tensor],  # noqa: UP045
           top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor],  # noqa: UP045
           seeds: Optional[torch.Tensor], offsets: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    """``lz.sample`` (no ``generator``: the global RNG for unseeded rows) as a custom op."""
    return _lz().sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                        offsets=offsets)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::apply_penalties", mutates_args=())
def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
                    repetition_penalty: Optional[torch.Tensor], presence_penalty: Optional[torch.Tensor],  # noqa: UP045
                    frequency_penalty: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    """``lz.apply_penalties`` as a custom op."""
    return _lz().apply_penalties(logits, prompt_token_ids, output_token_ids, repetition_penalty=repetition_penalty,
                                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)


@apply_penalties.register_fake
def _(logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty, frequency_penalty):
    return torch.empty_like(logits)
