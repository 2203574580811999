"""LayerZero as a Hugging Face Transformers attention implementation (``attn_implementation="layerzero"``).

Transformers (>= 4.56) looks attention functions up by name in ``AttentionInterface`` and, for the masks,
in ``masking_utils.AttentionMaskInterface``: a name without a mask function gets *no mask at all*. This
module mirrors how ``"sdpa"`` is wired (``transformers/integrations/sdpa_attention.py``):

- the mask function registered for ``"layerzero"`` is the one registered for ``"sdpa"`` (``sdpa_mask``):
  a boolean ``[B, 1, Sq, Sk]`` mask, True = attend, already combining causality, left/right padding and
  the sliding window; or ``None`` when plain causality is enough (then ``is_causal`` carries it);
- :func:`layerzero_attention_forward` hands that mask to :func:`layerzero.attention` unchanged, keeps
  grouped-query attention native (no ``repeat_kv``), and uses SDPA's top-left ``is_causal`` convention.

Nothing here imports ``transformers`` at import time; :func:`register` imports it and must be called
explicitly (:func:`from_pretrained` and :func:`layerzero.integrations.transformers.patch_model` call it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from layerzero import ops as lz_ops
from layerzero.core.errors import ConfigurationError, InvalidInputError, expected_got
from layerzero.core.versions import release

logger = logging.getLogger("layerzero.integrations.transformers")

#: The name LayerZero registers under, for ``attn_implementation=...``.
ATTN_IMPLEMENTATION = "layerzero"
#: The oldest transformers release whose AttentionInterface / masking_utils this module mirrors.
MIN_TRANSFORMERS_VERSION: tuple[int, int] = (4, 56)


def _parse_version(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: ``"5.23.0.dev0"`` -> ``(5, 23, 0)``."""
    return release(version)


def check_transformers_version(version: str) -> tuple[int, ...]:
    """Check that a transformers version string is new enough for this integration.

    Args:
        version: e.g. ``transformers.__version__`` (``"5.23.0"``).

    Returns:
        The parsed release tuple, e.g. ``(5, 23, 0)``.

    Raises:
        ConfigurationError: the version cannot be parsed or is older than ``MIN_TRANSFORMERS_VERSION``.
    """
    parsed = _parse_version(version)
    want = ".".join(map(str, MIN_TRANSFORMERS_VERSION))
    if len(parsed) < 2:
        raise ConfigurationError(
            expected_got(
                "transformers version",
                "a release like '4.56.0'",
                repr(version),
                "Reinstall transformers from a release: pip install -U 'transformers>=4.56'.",
            )
        )
    if parsed[:2] < MIN_TRANSFORMERS_VERSION:
        raise ConfigurationError(
            expected_got(
                "transformers version",
                f">= {want}",
                version,
                "The LayerZero attention integration relies on AttentionInterface and masking_utils; "
                "upgrade with: pip install -U 'transformers>=4.56'.",
            )
        )
    return parsed


def register() -> None:
    """Register ``"layerzero"`` with transformers' attention (and attention-mask) interfaces. Idempotent.

    After this, ``Model.from_pretrained(path,
    attn_implementation="layerzero")`` and ``model.set_attn_implementation("layerzero")`` route every
    attention call through :func:`layerzero_attention_forward`. The mask function is transformers' own
    ``"sdpa"`` one (boolean, True = attend), so padding, causality and sliding windows are built exactly as
    for ``"sdpa"``; under CUDA-graph capture it skips a plain causal mask as eager transformers does
    (:mod:`.masks`), so a captured forward makes the same ``lz.attention`` calls as the eager warm-up before
    it. Registration is global to the transformers process state (that is how transformers' registries work);
    calling it again changes nothing.

    Raises:
        ConfigurationError: transformers is not installed, or is older than 4.56.
    """
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is a dev dependency
        raise ConfigurationError(
            expected_got(
                "transformers",
                "installed (>= 4.56)",
                "not importable",
                "Install it with: pip install 'transformers>=4.56'.",
            )
        ) from exc
    check_transformers_version(transformers.__version__)
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, layerzero_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - masking_utils exists in every supported release
        logger.info(
            "transformers %s has no AttentionMaskInterface; masks are built by the model",
            transformers.__version__,
        )
        return
    sdpa_mask_fn = AttentionMaskInterface._global_mapping.get("sdpa")
    if sdpa_mask_fn is None:  # pragma: no cover - "sdpa" is always registered in supported releases
        raise ConfigurationError(
            expected_got(
                "transformers AttentionMaskInterface",
                "an 'sdpa' mask function",
                "none registered",
                "This transformers build is unusual; reinstall transformers>=4.56.",
            )
        )
    from transformers.masking_utils import causal_mask_function

    from .masks import capture_consistent

    AttentionMaskInterface.register(
        ATTN_IMPLEMENTATION, capture_consistent(sdpa_mask_fn, causal_mask_function)
    )


def is_registered() -> bool:
    """True when ``"layerzero"`` is registered with transformers' AttentionInterface.

    Does not import transformers when it has not been imported yet (returns False then).
    """
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is layerzero_attention_forward


def _refuse(feature: str, got: Any, fix: str) -> InvalidInputError:
    return InvalidInputError(expected_got(f"layerzero attention: {feature}", "not requested", got, fix))


def _position_bias_mask(
    position_bias: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool, q_len: int, k_len: int
) -> torch.Tensor:
    """Fold a T5-style additive ``position_bias`` [B|1, H, Sq, Sk] and the mask into one float mask.

    Mirrors ``create_position_bias_mask`` of transformers' SDPA integration (masked entries get -inf).
    """
    neg_inf = torch.tensor(float("-inf"), dtype=position_bias.dtype, device=position_bias.device)
    if attention_mask is None:
        if not is_causal:
            return position_bias
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=position_bias.device).tril()
        return torch.where(causal, position_bias, neg_inf)
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, neg_inf)
    return position_bias + attention_mask


def layerzero_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function that runs :func:`layerzero.attention`.

    Same contract as transformers' ``sdpa_attention_forward`` (which it mirrors):

    Args:
        module: the calling attention module; its ``is_causal`` (default True) is used when ``is_causal`` is
            None.
        query: [B, Hq, Sq, D] float tensor (BHSD).
        key: [B, Hkv, Sk, D], same dtype/device; Hq % Hkv == 0 (GQA/MQA are passed natively, never repeated).
        value: [B, Hkv, Sk, Dv].
        attention_mask: None, a bool mask broadcastable to [B, Hq, Sq, Sk] (True = attend; what the registered
            ``sdpa_mask`` builds, including padding and sliding window), or a float additive mask (0 / -inf).
        dropout: attention dropout probability (0.0 in eval).
        scaling: softmax scale; None = 1/sqrt(D).
        sliding_window: the layer's window W in tokens (transformers' ``sliding_window_overlay``: query i sees
            keys ``j > i - W``). When ``attention_mask`` is given it already encodes the window (the
            registered ``sdpa_mask`` builds it, bottom-right aligned for cached decode), so it is *not*
            applied again. When no mask is given, Sq == Sk and the call is causal, it is passed as
            ``window=(W - 1, 0)`` (top-left and bottom-right alignment coincide then); with no mask and Sq !=
            Sk it is refused (see Raises).
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``), passed to
            ``lz.attention(softcap=)`` (``scores = softcap * tanh(scores / softcap)`` before the mask, as
            transformers' eager path does); None or 0 = off.
        is_causal: None = ``module.is_causal``. Used, top-left aligned like SDPA, only when ``attention_mask``
            is None and Sq > 1 (a single decode query attends to the whole cache).
        **kwargs: transformers' extra kwargs. ``position_bias`` (T5-style additive bias [B|1, Hq, Sq, Sk]) is
            folded into the mask; ``output_attentions``, ``head_mask`` and a paged ``cache`` are refused.

    Returns:
        ``(out, None)`` with ``out`` [B, Sq, Hq, Dv] contiguous (BSHD, what transformers expects), dtype of
        ``query``; attention weights are never materialized, so the second item is None.

    Raises:
        InvalidInputError: ``output_attentions=True``, ``head_mask`` is given, a paged cache (continuous
            batching) is passed, or ``sliding_window`` is set while no mask was given, the key length exceeds
            the window and the window cannot be expressed top-left aligned (Sq != Sk, or not causal); and
            anything :func:`layerzero.attention` raises for bad tensors (e.g. a negative ``softcap``).
    """
    if kwargs.get("output_attentions", False):
        raise _refuse(
            "output_attentions",
            "output_attentions=True",
            "LayerZero kernels never materialize attention weights; use attn_implementation='eager' "
            "to get them.",
        )
    if kwargs.get("head_mask") is not None:
        raise _refuse(
            "head_mask",
            "a head_mask tensor",
            "Per-head masking is not supported; use attn_implementation='eager'.",
        )
    if kwargs.get("cache") is not None:
        raise _refuse(
            "paged cache",
            type(kwargs["cache"]).__name__,
            "Continuous batching (paged KV cache) is not wired to LayerZero yet; use 'sdpa' for it.",
        )

    q_len, k_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = None
    if attention_mask is None and sliding_window is not None and k_len > sliding_window:
        if q_len != k_len or not causal:
            raise _refuse(
                "sliding window without a mask",
                f"sliding_window={sliding_window}, no mask, Sq={q_len}, Sk={k_len}, causal={causal}",
                "Build the mask with transformers' create_sliding_window_causal_mask (call "
                "layerzero.integrations.transformers.register() before the model runs).",
            )
        window = (int(sliding_window) - 1, 0)
    causal = bool(q_len > 1 and attention_mask is None and causal)

    # Prefill into an empty static cache: keys past Sq are all masked by top-left causality; drop them
    # (what transformers' SDPA path does, so both see identical shapes).
    position_bias = kwargs.get("position_bias")
    if causal and k_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if position_bias is not None:
        attention_mask = _position_bias_mask(position_bias, attention_mask, causal, q_len, key.shape[2])
        causal = False

    out = lz_ops.attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        is_causal=causal,
        scale=scaling,
        dropout_p=dropout,
        layout="BHSD",
        window=window,
        softcap=softcap or None,
    )
    return out.transpose(1, 2).contiguous(), None


def from_pretrained(cls_or_auto: Any, path: Any, **kwargs: Any) -> Any:
    """Load a model with LayerZero attention: ``register()`` then ``cls_or_auto.from_pretrained(path,
    attn_implementation="layerzero", **kwargs)``.

    Args:
        cls_or_auto: a transformers model class or Auto class (``LlamaForCausalLM``,
            ``AutoModelForCausalLM``).
        path: a local directory or hub id, as for ``from_pretrained``.
        **kwargs: forwarded to ``from_pretrained`` (``dtype=``, ``device_map=``, ...).

    Returns:
        The loaded model. RMSNorm / RoPE are not patched; call
        :func:`layerzero.integrations.transformers.patch_model` for those.

    Raises:
        ConfigurationError: ``attn_implementation`` other than ``"layerzero"`` was passed, ``cls_or_auto`` has
            no ``from_pretrained``, or transformers is missing / too old.

    >>> model = from_pretrained(AutoModelForCausalLM, "path/to/model", dtype=torch.bfloat16)  # doctest: +SKIP
    """
    requested = kwargs.pop("attn_implementation", ATTN_IMPLEMENTATION)
    if requested != ATTN_IMPLEMENTATION:
        raise ConfigurationError(
            expected_got(
                "from_pretrained attn_implementation",
                repr(ATTN_IMPLEMENTATION),
                repr(requested),
                "Call cls.from_pretrained directly for other attention implementations.",
            )
        )
    loader = getattr(cls_or_auto, "from_pretrained", None)
    if not callable(loader):
        raise ConfigurationError(
            expected_got(
                "cls_or_auto",
                "a transformers model or Auto class with .from_pretrained",
                repr(cls_or_auto),
                "Pass e.g. transformers.AutoModelForCausalLM.",
            )
        )
    register()
    return loader(path, attn_implementation=ATTN_IMPLEMENTATION, **kwargs)
