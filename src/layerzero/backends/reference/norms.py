"""Reference RMSNorm and LayerNorm: the oracles for every normalization kernel.

Plain PyTorch, computed in float32 (float64 when the input is float64), returned in the input dtype.
"""

from __future__ import annotations

import torch

__all__ = ["layer_norm", "rms_norm"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    cast_before_weight: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019): ``y = x / sqrt(mean(x^2, -1) + eps) * weight``.

    Shapes: x ``[..., H]`` (H hidden size), weight ``[H]``, residual like x; y like x.

    Order of operations (float32, float64 for float64 x), written exactly like Hugging Face
    ``LlamaRMSNorm`` so that float32 results are bitwise equal to it::

        xf = x.float(); n = xf * rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        cast_before_weight=False (default): y = (n * weight.float()).to(x.dtype)   # one rounding
        cast_before_weight=True  (HF Llama): y = (n.to(x.dtype) * weight).to(x.dtype)

    With ``cast_before_weight=True`` the normalized value is rounded to the input dtype before the
    weight multiply, as ``LlamaRMSNorm`` does, so bf16/fp16 results match HF too; for float32 and
    float64 inputs both orders give the same bits. Unlike HF, the result is always ``x.dtype`` (HF
    returns the promoted dtype of weight and x).

    Fused residual: when ``residual`` is given, ``h = x + residual`` is formed in the input dtype
    (as a model's residual stream is) and ``(rms_norm(h), h)`` is returned.

    Args:
        x: input activations ``[..., H]``, any float dtype.
        weight: per-channel scale ``[H]``.
        eps: added to the mean square (unitless), default 1e-6 (Llama).
        residual: optional ``[..., H]`` added to x first (input dtype).
        cast_before_weight: use HF Llama's rounding order (see above).

    Returns:
        y ``[..., H]`` in x's dtype, or ``(y, h)`` when ``residual`` is given.

    Raises:
        Nothing of its own: input validation is the ops layer's job (torch raises on shape mismatch).

    >>> rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), eps=0.0)
    tensor([[0.8485, 1.1314]])
    """
    if residual is not None:
        h = (x + residual).to(x.dtype)
        return rms_norm(h, weight, eps=eps, cast_before_weight=cast_before_weight), h
    cdt = _compute_dtype(x)
    xf = x.to(cdt)
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(variance + eps)
    if cast_before_weight:
        return (weight * normed.to(x.dtype)).to(x.dtype)
    return (normed * weight.to(cdt)).to(x.dtype)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm (Ba et al. 2016) over the last dim, like ``torch.nn.LayerNorm``.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the biased variance
    ``var = mean((x - mean)^2)``, computed in float32 (float64 for float64 x), returned in x's dtype.

    Shapes: x ``[..., H]``, weight ``[H]``, bias ``[H]`` or None; y like x.

    Args:
        x: input ``[..., H]``, any float dtype.
        weight: per-channel scale ``[H]``.
        bias: per-channel shift ``[H]`` or None (no shift).
        eps: added to the variance (unitless), default 1e-5 (torch's default).

    Returns:
        y ``[..., H]`` in x's dtype.

    Raises:
        Nothing of its own: input validation is the ops layer's job.

    >>> layer_norm(torch.tensor([[1.0, 3.0]]), torch.ones(2), eps=0.0)
    tensor([[-1.,  1.]])
    """
    cdt = _compute_dtype(x)
    xf = x.to(cdt)
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    var = centered.pow(2).mean(-1, keepdim=True)
    y = centered * torch.rsqrt(var + eps) * weight.to(cdt)
    if bias is not None:
        y = y + bias.to(cdt)
    return y.to(x.dtype)
