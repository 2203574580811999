"""The decoder-only transformer of Llama 2/3 and Qwen3 (dense and MoE): one implementation, the differences
as config (Qwen3's QK-norm, Qwen3-MoE's sparse MLP layers). Hugging Face parameter names, packed QKV and
gate/up weights, fused residual + RMSNorm, paged attention."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

import layerzero as lz

from ..config import ModelConfig
from ..errors import bad_config
from ..layers.activation import silu_and_mul
from ..layers.attention import QUANTIZED_KV_DTYPES, KVScales, paged_attention
from ..layers.linear import Embedding, Linear
from ..layers.moe import SparseMoE
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    materialize,
)
from ..parallel.moe import ParallelSparseMoE
from ..parallel.state import SINGLE, ParallelState
from ..worker.attn_metadata import ForwardBatch

__all__ = ["LlamaForCausalLM", "check_tensor_parallel"]

_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
"""Checkpoint projection -> (packed layer, shard)."""
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_SKIP = re.compile(r"rotary_emb\.inv_freq$")
_SIZES_FIX = (
    "The checkpoint does not match its config.json: check hidden_size, intermediate_size, vocab_size, "
    "num_attention_heads, num_key_value_heads and head_dim against the weights."
)


def check_tensor_parallel(cfg: ModelConfig, parallel: ParallelState) -> None:
    """Whether ``cfg`` splits ``parallel.tp_size`` ways: query heads, KV heads (split, or replicated when
    ``tp`` is a multiple of them), the dense MLP's intermediate size, and for MoE layers each expert's
    intermediate size (TP) or the number of experts (EP: at least one per rank). The vocabulary needs no
    check: it is padded up to a multiple of ``tp`` (zero rows, cut from the logits).

    Raises:
        ConfigurationError: every size that does not split, in one message.
    """
    tp, reasons = parallel.tp_size, []
    if cfg.num_heads % tp:
        reasons.append(f"num_attention_heads {cfg.num_heads} is not a multiple of {tp}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        reasons.append(f"num_key_value_heads {cfg.num_kv_heads} neither divides nor is a multiple of {tp}")
    moe = cfg.moe
    dense = moe is None or any(not moe.is_sparse(i) for i in range(cfg.num_layers))
    if dense and cfg.intermediate_size % tp:
        reasons.append(f"intermediate_size {cfg.intermediate_size} is not a multiple of {tp}")
    if moe is not None and parallel.ep and moe.num_experts < tp:
        reasons.append(f"num_experts {moe.num_experts} < {tp} ranks (expert parallel)")
    if moe is not None and not parallel.ep and moe.intermediate_size % tp:
        reasons.append(f"moe_intermediate_size {moe.intermediate_size} is not a multiple of {tp}")
    if reasons:
        raise bad_config(
            f"{cfg.model_type} model with tensor_parallel_size {tp}",
            "sizes that split evenly across the ranks",
            "; ".join(reasons),
            "Pick a tensor_parallel_size that divides the head counts and intermediate sizes"
            + (" (or toggle enable_expert_parallel)." if moe is not None else "."),
        )


class Attention(nn.Module):
    """Self-attention with packed QKV, optional per-head QK RMSNorm (Qwen3), RoPE and paged KV."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        *,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState = SINGLE,
    ):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.d**-0.5
        self.rotary = rotary
        self.kv_scales = KVScales(device)
        bias = cfg.attention_bias
        if parallel.is_parallel:  # this rank's heads (KV heads split or replicated), o_proj all-reduced
            self.qkv_proj: Linear = QKVParallelLinear(
                cfg.hidden_size,
                self.d,
                self.hq,
                self.hkv,
                bias=bias,
                device=device,
                dtype=dtype,
                parallel=parallel,
            )
            self.hq, self.hkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.o_proj: Linear = RowParallelLinear(
                cfg.num_heads * self.d,
                cfg.hidden_size,
                bias=bias,
                device=device,
                dtype=dtype,
                parallel=parallel,
            )
        else:
            self.qkv_proj = Linear(
                cfg.hidden_size,
                (("q", self.hq * self.d), ("k", self.hkv * self.d), ("v", self.hkv * self.d)),
                bias=bias,
                device=device,
                dtype=dtype,
            )
            self.o_proj = Linear(self.hq * self.d, cfg.hidden_size, bias=bias, device=device, dtype=dtype)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> ``[T, H]``."""
        return self.attend(self.qkv_proj(x), batch, kv_cache)

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """The packed projection ``qkv`` ``[T, (Hq + 2 Hkv) D]`` -> ``[T, H]`` (QK-norm, RoPE, paged
        attention, output projection)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        norm = self.q_norm is not None
        if batch.graphed and batch.cascade is None and kv_cache.dtype not in QUANTIZED_KV_DTYPES:
            # captured decode steps: QK-norm, RoPE, the KV write and the attention in one call
            # (lz.rope_paged_attention: three kernels where four ran, the graph 759 -> 742 µs at batch 1 on
            # the H200); eager steps make the separate calls below, whose warm host path is cheaper (the
            # composite validates the block once more per part: ~1 ms a call more on a CPU decode step)
            o = lz.rope_paged_attention(
                q,
                k,
                v,
                self.rotary.cos,
                self.rotary.sin,
                kv_cache,
                batch.slot_mapping,
                batch.block_tables,
                batch.seq_lens,
                position_ids=batch.positions,
                q_weight=self.q_norm.weight if norm else None,
                k_weight=self.k_norm.weight if norm else None,
                eps=self.q_norm.eps if norm else 1e-6,
                cu_seqlens_q=batch.cu_seqlens_q,
                scale=self.scale,
            )
            return self.o_proj(o.reshape(t, self.hq * self.d))
        if norm:  # one fused call (lz.qk_norm_rope) where three were
            q, k = self.rotary.with_qk_norm(
                q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, batch.positions
            )
        else:
            q, k = self.rotary(q, k, batch.positions)
        o = paged_attention(q, k, v, kv_cache, batch, self.scale, self.kv_scales)
        return self.o_proj(o.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    """Gated MLP: ``down(silu(gate(x)) * up(x))`` with gate/up packed into one matmul. Tensor parallel:
    gate/up column-parallel (this rank's slice of the intermediate size), down row-parallel (all-reduced)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        shards = (("gate", intermediate), ("up", intermediate))
        self.row_parallel = parallel.is_parallel
        if self.row_parallel:
            self.gate_up_proj: Linear = MergedColumnParallelLinear(
                hidden, shards, device=device, dtype=dtype, parallel=parallel
            )
            self.down_proj: Linear = RowParallelLinear(
                intermediate, hidden, device=device, dtype=dtype, parallel=parallel
            )
        else:
            self.gate_up_proj = Linear(hidden, shards, device=device, dtype=dtype)
            self.down_proj = Linear(intermediate, hidden, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> ``[T, H]``."""
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The packed gate/up projection ``[T, 2I]`` -> ``[T, H]``: ``lz.swiglu_linear`` (the activation fused
        into the down projection) for a float :class:`Linear`, else (quantized weights) SwiGLU, then the
        projection."""
        if type(self.down_proj) is Linear:
            gate, up = gate_up.chunk(2, dim=-1)
            return lz.swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
        if self.row_parallel:  # the local projection fused as above, then the all-reduce
            gate, up = gate_up.chunk(2, dim=-1)
            down = cast(RowParallelLinear, self.down_proj)
            return down.reduce(lz.swiglu_linear(gate, up, down.weight, down.local_bias))
        return self.down_proj(silu_and_mul(gate_up))


def norm_linear(
    norm: RMSNorm, proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``proj(norm(x, residual))`` and the residual stream after it (x itself at the first layer): through
    ``lz.rms_norm_linear`` (one kernel for a decode step where two were) when ``proj`` is a float
    :class:`Linear` (column-parallel ones too: their local rows), else (quantized weights) the two calls."""
    if isinstance(proj, Linear):
        if residual is None:
            return lz.rms_norm_linear(x, norm.weight, proj.weight, proj.bias, eps=norm.eps), x
        return lz.rms_norm_linear(x, norm.weight, proj.weight, proj.bias, eps=norm.eps, residual=residual)
    if residual is None:
        return proj(norm(x)), x
    h, residual = norm(x, residual)
    return proj(h), residual


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual stream is carried through fused add + RMSNorm (vLLM's pattern)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        *,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, device=device, dtype=dtype, parallel=parallel)
        if cfg.moe is not None and cfg.moe.is_sparse(layer):
            if parallel.is_parallel:
                self.mlp: nn.Module = ParallelSparseMoE(
                    cfg.hidden_size, cfg.moe, device=device, dtype=dtype, parallel=parallel
                )
            else:
                self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, device=device, dtype=dtype)
        else:
            self.mlp = MLP(
                cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype, parallel=parallel
            )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) ``[T, H]`` -> (this layer's output, the residual stream before it is added). Each
        norm runs fused into the projection after it (:func:`norm_linear`), but a sparse MoE block's (its
        router and experts read the normalized x)."""
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        h = self.self_attn.attend(qkv, batch, kv_cache)
        if isinstance(self.mlp, MLP):
            gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, h, residual)
            return self.mlp.down(gate_up), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen3 / Qwen3-MoE causal LM. :meth:`forward` returns the logits of the sampled rows only (model
    dtype)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        self.tp = parallel.is_parallel
        if self.tp:
            check_tensor_parallel(cfg, parallel)
        self.rotary = RotaryEmbedding(cfg, max_positions, device=device, dtype=dtype)
        if self.tp:
            self.embed_tokens: Embedding = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype, parallel=parallel
            )
        else:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, device=device, dtype=dtype, parallel=parallel)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head: nn.Module = self.embed_tokens
        elif self.tp:
            self.lm_head = ParallelLMHead(
                cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype, parallel=parallel
            )
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, device=device, dtype=dtype)
        attn = cast(Attention, self.layers[0].self_attn) if cfg.num_layers else None
        self.num_local_heads = attn.hq if attn is not None else cfg.num_heads
        self.num_local_kv_heads = attn.hkv if attn is not None else cfg.num_kv_heads
        """This rank's query / KV heads per layer (the config's at tp 1; KV heads replicated when tp exceeds
        them): the KV pool holds ``num_local_kv_heads`` heads."""

    def hidden_states(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final normalised hidden states ``[T, H]`` of every new token of the batch."""
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, batch, cache)
        return self.norm(x, residual)[0]

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``[S, V]`` in the model's dtype of the rows in ``batch.logits_indices`` (every row, with no
        gather, when ``batch.logits_all``). The sampler casts to float32 where it needs to: a greedy step
        reads them as they are."""
        h = self.hidden_states(batch, kv_caches)
        if not batch.logits_all:
            h = h[batch.logits_indices]
        return self.compute_logits(h)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V]`` (model dtype) of final hidden states ``h`` ``[N, H]`` (the LM head; tensor
        parallel: all-gathered, every rank holds all of them)."""
        if self.tp:
            return cast(VocabParallelEmbedding, self.lm_head).logits(h)
        return lz.linear(h, self.lm_head.weight)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the model, packing q/k/v and gate/up; returns the
        names of the parameters written. Tensor parallel: each tensor is the FULL checkpoint tensor or a lazy
        slice of it (the loader's); each layer keeps (reads) only this rank's part.

        Raises:
            ConfigurationError: a tensor the model has no place for, or of the wrong shape.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules()) if self.tp else {}
        done: set[str] = set()
        for name, tensor in weights:
            if _SKIP.search(name) or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            name = name.removeprefix("model.")
            if m := _EXPERT.match(name):
                self.get_submodule(m.group(1)).load(tensor, m.group(3), int(m.group(2)))
                done.add(f"{m.group(1)}.experts")
                continue
            if m := _FUSED_EXPERTS.match(name):
                self.get_submodule(m.group(1)).load(tensor, m.group(2))
                done.add(f"{m.group(1)}.experts")
                continue
            mlp = (
                self.get_submodule(name.removesuffix(".gate.weight"))
                if name.endswith(".mlp.gate.weight")
                else None
            )
            if isinstance(mlp, SparseMoE):  # the MoE router (a dense MLP has no such tensor: unknown below)
                mlp.load(tensor, "gate")
                done.add(name)
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _PACKED:
                packed, shard = _PACKED[parts[-2]]
                layer = self.get_submodule(".".join([*parts[:-2], packed]))
                layer.load(tensor, shard, bias=parts[-1] == "bias")
                done.add(name)
                continue
            if self.tp:  # a lazy slice: the vocabulary-parallel / row-parallel layers keep their part
                parent, _, leaf = name.rpartition(".")
                module = self.get_submodule(parent) if parent in modules else None
                if isinstance(module, (VocabParallelEmbedding, RowParallelLinear)):
                    module.load(tensor, bias=leaf == "bias")
                    done.add(name)
                    continue
                tensor = materialize(tensor)  # replicated: read whole
            if name not in params:
                raise bad_config(
                    "checkpoint tensor",
                    f"a parameter of {type(self).__name__} ({self.cfg.model_type})",
                    repr(name),
                    "Is the checkpoint of another architecture than its config.json says?",
                )
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise bad_config(
                    f"checkpoint tensor {name} shape",
                    list(params[name].shape),
                    list(tensor.shape),
                    _SIZES_FIX,
                )
            params[name].copy_(tensor)
            done.add(name)
        return done
