"""Weights whose greedy continuation is known, so speculative decoding's speed can be measured at a chosen
acceptance without trained checkpoints (issue 39, section 3: "where acceptance >= 0.8 with k = 4, batch-1
speedup >= 2x"; with random weights a draft never agrees and n-gram lookup never matches).

Construction (:func:`construct`, on a loaded dense Llama / Qwen3 model, in place, after its CUDA graphs were
captured: they read the weights where they are): every layer's attention output projection and MLP down
projection are zeroed, so no layer adds anything to the residual stream and the final hidden state of token
t is ``RMSNorm(E[t])`` (E the embedding; the final norm's weight set to 1). The LM head's row ``succ[t]`` is
set to ``E[t]``: the logits ``W RMSNorm(E[t])`` peak at ``succ[t]`` (for Gaussian rows the self product,
~H, beats every cross product, ~4 sqrt(H)). Greedy decoding then walks the permutation ``succ`` whatever the
context, and the model computes exactly what it did before: zeros cost what random values cost (a GEMV's
time is its weight bytes), attention still runs over the whole context.

- A draft model gets the same construction from :func:`draft_successors`: ``succ`` on a fraction ``agree``
  of tokens, the images of the others permuted among them (a derangement), so each drafted token is right
  with probability ~``agree``.
- The n-gram method proposes what followed the same n-gram in the prompt: :func:`walk_prompts` makes each
  prompt the walk ahead of the output (all of it, so lookup can find it) with a fraction ``1 - agree`` of
  its positions replaced by other tokens, then the walk's start again (the output continues from there).

The acceptance this gives is measured, not assumed (``llm.stats()["spec_decode"]``).
"""

from __future__ import annotations

from typing import Any

import torch


def successors(vocab: int, seed: int = 0) -> torch.Tensor:
    """A random permutation ``[V]`` int64 of the vocabulary: the target's next token of each token."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def draft_successors(succ: torch.Tensor, agree: float, seed: int = 1) -> torch.Tensor:
    """``succ`` with the images of a random ``1 - agree`` fraction of tokens permuted among themselves by a
    cyclic shift (so none of them keeps its image): still a permutation, agreeing with ``succ`` on the
    rest."""
    g = torch.Generator().manual_seed(seed)
    n = round((1.0 - agree) * succ.numel())
    out = succ.clone()
    if n >= 2:
        idx = torch.randperm(succ.numel(), generator=g)[:n]
        out[idx] = succ[idx.roll(1)]
    return out


@torch.no_grad()
def construct(model: Any, succ: torch.Tensor) -> None:
    """Make ``model`` (a dense :class:`~layerzero.engine.models.llama.LlamaForCausalLM`, untied embeddings,
    one rank) greedily predict ``succ[t]`` after any token t (see the module docstring). In place.

    Raises:
        ValueError: tied embeddings (the LM head is the embedding) or a sparse-MoE layer."""
    if model.lm_head is model.embed_tokens:
        raise ValueError("construct: tied embeddings; give the config tie_word_embeddings=false")
    for layer in model.layers:
        down = getattr(layer.mlp, "down_proj", None)
        if down is None:
            raise ValueError("construct: a sparse-MoE layer; use a dense shape")
        layer.self_attn.o_proj.weight.zero_()
        down.weight.zero_()
    model.norm.weight.fill_(1.0)
    emb = model.embed_tokens.weight
    model.lm_head.weight[succ.to(emb.device)] = emb


def construct_llm(llm: Any, succ: torch.Tensor, draft_succ: torch.Tensor) -> None:
    """:func:`construct` on an in-process ``LLM``'s target model (``succ``) and its draft model, if it has
    one (``draft_succ``; a ``layer_skip`` draft is the target's own first layers: constructed with it)."""
    worker = llm.engine.executor.worker
    construct(worker.runner.model, succ)
    drafter = getattr(worker, "drafter", None)
    if drafter is not None and drafter.model is not None and hasattr(drafter.model, "lm_head"):
        construct(drafter.model, draft_succ)


def check_walk(llm: Any, succ: torch.Tensor, tokens: int = 8) -> None:
    """Greedy decoding of one walk prompt follows ``succ`` (the construction took effect: no kernel reads a
    copy of the weights made before it).

    Raises:
        RuntimeError: it does not (the first tokens and the walk's, in the message)."""
    from layerzero.engine import SamplingParams

    prompt = walk_prompts(succ, 1, 4, tokens + 4, 1.0, seed=9)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    want = walk(succ, prompt[-1], tokens + 1)[1:]
    if list(got) != want:
        raise RuntimeError(
            f"constructed weights not in effect: greedy gave {list(got)}, the walk is {want}; a kernel may "
            "read a copy of the weights made at load time"
        )


def walk(succ: torch.Tensor, start: int, n: int) -> list[int]:
    """``n`` tokens from ``start`` following ``succ``."""
    out, t = [], start
    for _ in range(n):
        out.append(t)
        t = int(succ[t])
    return out


def walk_prompts(
    succ: torch.Tensor, n: int, head: int, ahead: int, agree: float, seed: int = 2
) -> list[list[int]]:
    """``n`` prompts, each ``ahead + head`` tokens of one walk (a fraction ``1 - agree`` of them replaced by
    random tokens) followed by its first ``head`` tokens again: the output then continues the walk from
    token ``head``, which the prompt holds ``ahead - head`` tokens of."""
    g = torch.Generator().manual_seed(seed)
    vocab = succ.numel()
    prompts = []
    for start in torch.randint(10, vocab, (n,), generator=g).tolist():
        path = walk(succ, start, ahead + head)
        keep = (torch.rand(len(path), generator=g) < agree).tolist()
        noise = torch.randint(10, vocab, (len(path),), generator=g).tolist()
        prompts.append([t if k else x for t, k, x in zip(path, keep, noise, strict=True)] + path[:head])
    return prompts
