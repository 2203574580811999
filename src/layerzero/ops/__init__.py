"""Public ops. Each module validates its inputs (typed errors), builds the cache key, and hands the call to
the dispatch runtime; ``OPS`` maps an op id to its (prepare, context-from-key) pair for ``lz.select`` /
``lz.explain`` / ``lz.which``.
"""

from __future__ import annotations

from . import attention as _attention
from . import cascade as _cascade
from . import embedding as _embedding
from . import fp8_linear as _fp8l
from . import fused_moe as _fused_moe
from . import linear as _linear
from . import linear_cross_entropy as _lce
from . import norms as _norms
from . import paged as _paged
from . import penalties as _penalties
from . import qk_norm_rope as _qk_norm_rope
from . import qk_norm_rope_cache as _qknrc
from . import quantization as _quantization
from . import quantized_linear as _qlinear
from . import rms_norm_linear as _rnl
from . import rope as _rope
from . import rope_paged_attention as _rpa
from . import sampling as _sampling
from . import swiglu as _swiglu
from . import swiglu_linear as _sgl
from .attention import attention
from .cascade import merge_attention_states
from .embedding import embedding
from .fp8_linear import fp8_linear
from .fused_moe import fused_moe
from .kv_cache import KVLayout, allocate_kv_cache
from .linear import linear
from .linear_cross_entropy import linear_cross_entropy
from .norms import layer_norm, rms_norm
from .paged import paged_attention, reshape_and_cache
from .penalties import apply_penalties
from .qk_norm_rope import qk_norm_rope
from .qk_norm_rope_cache import qk_norm_rope_cache
from .quantization import dequantize, quantize
from .quantized_linear import quantized_linear
from .rms_norm_linear import rms_norm_linear
from .rope import rope
from .rope_paged_attention import rope_paged_attention
from .sampling import sample, sample_greedy, sample_topk, sample_topp
from .swiglu import geglu, reglu, swiglu
from .swiglu_linear import swiglu_linear

OPERATION_SPECS = (_attention.SPEC, _norms.RMS_SPEC, _norms.LAYER_SPEC, _rope.SPEC, _qk_norm_rope.SPEC, _qknrc.SPEC, _rpa.SPEC, _sampling.TOPK_SPEC,
                   _sampling.TOPP_SPEC, _sampling.SAMPLE_SPEC, _sampling.GREEDY_SPEC, _penalties.SPEC, _paged.SPEC, _paged.CACHE_SPEC,
                   _cascade.LSE_SPEC, _cascade.MERGE_SPEC,
                   _swiglu.SPEC, _swiglu.GEGLU_SPEC, _swiglu.REGLU_SPEC, _fused_moe.SPEC, _quantization.SPEC,
                   _quantization.DEQUANT_SPEC, _embedding.SPEC, _lce.SPEC, _linear.SPEC, _rnl.SPEC, _sgl.SPEC, _qlinear.SPEC,
                   _fp8l.SPEC)

OPS = {
    "attention": (_attention.prepare, _attention.context),
    "rms_norm": (_norms.prepare_rms, _norms.context_rms),
    "rms_norm_linear": (_rnl.prepare, _rnl.context),
    "layer_norm": (_norms.prepare_layer, _norms.context_layer),
    "rope": (_rope.prepare, _rope.context),
    "qk_norm_rope": (_qk_norm_rope.prepare, _qk_norm_rope.context),
    "qk_norm_rope_cache": (_qknrc.prepare, _qknrc.context),
    "rope_paged_attention": (_rpa.prepare, _rpa.context),
    "sample_topk": (_sampling.prepare_topk, _sampling.context),
    "sample_topp": (_sampling.prepare_topp, _sampling.context),
    "sample": (_sampling.prepare_sample, _sampling.context_batch),
    "sample_greedy": (_sampling.prepare_greedy, _sampling.context_greedy),
    "apply_penalties": (_penalties.prepare, _penalties.context),
    "paged_attention": (_paged.prepare, _paged.context),
    "reshape_and_cache": (_paged.prepare_cache, _paged.context_cache),
    "paged_attention_lse": (_cascade.prepare_lse, _cascade.context_lse),
    "merge_attention_states": (_cascade.prepare_merge, _cascade.context_merge),
    "swiglu": (_swiglu.prepare, _swiglu.context),
    "swiglu_linear": (_sgl.prepare, _sgl.context),
    "geglu": (_swiglu.prepare_geglu, _swiglu.context),
    "reglu": (_swiglu.prepare_reglu, _swiglu.context),
    "fused_moe": (_fused_moe.prepare, _fused_moe.context),
    "quantize": (_quantization.prepare, _quantization.context),
    "dequantize": (_quantization.prepare_dequantize, _quantization.context),
    "embedding": (_embedding.prepare, _embedding.context),
    "linear_cross_entropy": (_lce.prepare, _lce.context),
    "linear": (_linear.prepare, _linear.context),
    "quantized_linear": (_qlinear.prepare, _qlinear.context),
    "fp8_linear": (_fp8l.prepare, _fp8l.context),
}


def register_builtin(registry) -> None:
    """Add every op's :class:`~layerzero.core.specs.OperationSpec` and the built-in backends to ``registry``
    (the loader of :data:`layerzero.core.runtime.RUNTIME`)."""
    from layerzero.backends import register_builtin as _backends

    for spec in OPERATION_SPECS:
        registry.add_op(spec)
    _backends(registry)


__all__ = ["OPERATION_SPECS", "OPS", "register_builtin", "KVLayout", "allocate_kv_cache", "paged_attention", "reshape_and_cache",
           "merge_attention_states",
           "attention", "fused_moe", "layer_norm", "rms_norm", "rope", "qk_norm_rope", "sample", "sample_greedy", "sample_topk", "sample_topp", "apply_penalties", "swiglu",
           "geglu", "reglu", "quantize", "dequantize", "embedding", "linear", "linear_cross_entropy",
           "quantized_linear", "fp8_linear", "rms_norm_linear", "swiglu_linear", "qk_norm_rope_cache",
           "rope_paged_attention"]
