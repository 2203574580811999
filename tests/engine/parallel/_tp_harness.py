"""Multi-process harness of the tensor-parallel tests (CPU, Gloo, float32/float64).

:func:`spawn` starts ``world`` processes with ``torch.multiprocessing`` (spawn); each joins a Gloo group over
``env://`` (MASTER_ADDR=127.0.0.1, a free port), runs one scenario of :data:`SCENARIOS` with its
:class:`~layerzero.engine.parallel.state.ParallelState` and ``torch.save``s the result; the parent reads the
results back in rank order. A rank's exception fails the parent with its traceback; a hang is killed after
``limit_s``. Every spawned process has ended when :func:`spawn` returns or raises.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(scenario: str, world: int, tmp: Path, *args: Any, limit_s: float = 120.0) -> list[Any]:
    """Run ``SCENARIOS[scenario](state, *args)`` on ``world`` ranks; their results, in rank order."""
    import torch.multiprocessing as mp

    out = tmp / f"ranks_{scenario}_{world}"
    out.mkdir()
    ctx = mp.spawn(_entry, args=(world, free_port(), str(out), scenario, args), nprocs=world, join=False)
    try:
        deadline = time.monotonic() + limit_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise AssertionError(f"scenario {scenario!r} on {world} ranks: not done in {limit_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
    return [torch.load(out / f"{r}.pt") for r in range(world)]


def _entry(rank: int, world: int, port: int, out: str, scenario: str, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    from layerzero.engine.parallel.state import ParallelState

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        result = SCENARIOS[scenario](ParallelState(rank, world), *args)
        torch.save(result, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- layer scenario
def layer_cases(state: Any) -> dict[str, float]:
    """Each parallel layer on this rank (float64, odd sizes, the same seeded full weights on every rank)
    against the full ``F.linear`` / ``F.embedding`` / one-rank MoE: name -> max abs error (after the
    layer's collective, or of this rank's output slice for column-parallel layers)."""
    from dataclasses import replace

    import torch.nn.functional as F

    from layerzero.engine.config import MoEConfig
    from layerzero.engine.layers.moe import SparseMoE
    from layerzero.engine.parallel import comm
    from layerzero.engine.parallel.layers import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        ParallelLMHead,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from layerzero.engine.parallel.moe import ParallelSparseMoE

    tp, r = state.tp_size, state.tp_rank
    g = torch.Generator().manual_seed(7)
    kw: dict[str, Any] = {"device": torch.device("cpu"), "dtype": torch.float64, "parallel": state}

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    err: dict[str, float] = {}
    h, t = 7, 5
    x = rand(t, h)
    # column-parallel, bias
    out = 5 * tp
    w, b = rand(out, h), rand(out)
    col = ColumnParallelLinear(h, out, bias=True, **kw)
    col.load(w)
    col.load(b, bias=True)
    full = F.linear(x, w, b)
    n = out // tp
    err["column"] = float((col(x) - full[:, r * n : (r + 1) * n]).abs().max())
    err["column_gathered"] = float((comm.all_gather(col(x), -1, state) - full).abs().max())
    # merged gate/up
    i = 3 * tp
    wg, wu = rand(i, h), rand(i, h)
    mer = MergedColumnParallelLinear(h, (("gate", i), ("up", i)), **kw)
    mer.load(wg, "gate")
    mer.load(wu, "up")
    il = i // tp
    expect = torch.cat(
        [F.linear(x, wg)[:, r * il : (r + 1) * il], F.linear(x, wu)[:, r * il : (r + 1) * il]], -1
    )
    err["merged"] = float((mer(x) - expect).abs().max())
    # QKV: KV heads split, then replicated (tp > Hkv)
    d, hq = 5, 2 * tp
    for label, hkv in (("qkv_split", tp), ("qkv_replicated", 1)):
        wq, wk, wv = rand(hq * d, h), rand(hkv * d, h), rand(hkv * d, h)
        bq, bk, bv = rand(hq * d), rand(hkv * d), rand(hkv * d)
        qkv = QKVParallelLinear(h, d, hq, hkv, bias=True, **kw)
        for name, wt, bt in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            qkv.load(wt, name)
            qkv.load(bt, name, bias=True)
        lq = hq // tp
        q_heads = range(r * lq, (r + 1) * lq)
        kv_of = sorted({hd // (hq // hkv) for hd in q_heads})  # the KV heads this rank's query heads read
        rows_q = [hd * d + j for hd in q_heads for j in range(d)]
        rows_kv = [hd * d + j for hd in kv_of for j in range(d)]
        expect = torch.cat(
            [
                F.linear(x, wq, bq)[:, rows_q],
                F.linear(x, wk, bk)[:, rows_kv],
                F.linear(x, wv, bv)[:, rows_kv],
            ],
            -1,
        )
        err[label] = float((qkv(x) - expect).abs().max())
        err[f"{label}_heads"] = float(abs(qkv.num_kv_heads - len(kv_of)) + abs(qkv.num_heads - lq))
    # row-parallel, bias (added once)
    k = 3 * tp
    w, b, xr = rand(h, k), rand(h), rand(t, k)
    row = RowParallelLinear(k, h, bias=True, **kw)
    row.load(w)
    row.load(b, bias=True)
    kl = k // tp
    err["row"] = float((row(xr[:, r * kl : (r + 1) * kl]) - F.linear(xr, w, b)).abs().max())
    # vocabulary-parallel embedding and LM head (V = 11: padded for tp 2 and 3)
    v = 11
    emb_w, ids = rand(v, h), torch.tensor([0, 10, 3, 5, 7, 1, 9, 2, 4, 6, 8, 10])
    emb = VocabParallelEmbedding(v, h, **kw)
    emb.load(emb_w)
    err["embedding"] = float((emb(ids) - F.embedding(ids, emb_w)).abs().max())
    head = ParallelLMHead(v, h, **kw)
    head.load(emb_w)
    lg = head.logits(x)
    err["lm_head"] = float((lg - F.linear(x, emb_w)).abs().max()) + float(lg.shape != (t, v))
    # MoE: each expert's intermediate split (TP) and experts partitioned (EP), per-expert and fused tensors
    e, inter = 5, 2 * tp
    moe = MoEConfig(num_experts=e, top_k=2, norm_topk_prob=True, intermediate_size=inter)
    gate, w13, w2 = rand(e, h), rand(e, 2 * inter, h), rand(e, h, inter)
    ref = SparseMoE(h, moe, device=torch.device("cpu"), dtype=torch.float64)
    ref.load(gate, "gate")
    ref.load(w13, "gate_up_proj")
    ref.load(w2, "down_proj")
    xm = rand(9, h)
    expect = ref(xm)
    for ep in (False, True):
        for fused in (False, True):
            m = ParallelSparseMoE(h, moe, **{**kw, "parallel": replace(state, ep=ep)})
            m.load(gate, "gate")
            if fused:
                m.load(w13, "gate_up_proj")
                m.load(w2, "down_proj")
            else:
                for j in range(e):
                    m.load(w13[j, :inter], "gate_proj", j)
                    m.load(w13[j, inter:], "up_proj", j)
                    m.load(w2[j], "down_proj", j)
            err[f"moe_{'ep' if ep else 'tp'}_{'fused' if fused else 'experts'}"] = float(
                (m(xm) - expect).abs().max()
            )
    return err


# ------------------------------------------------------------------------------------------- model scenario
def model_logits(state: Any, path: str, ep: bool = False) -> list[torch.Tensor]:
    """The checkpoint's model on this rank (float32, real safetensors through ``load_model_weights``, a paged
    KV pool of ``model.num_local_kv_heads`` heads): the logits ``[T, V]`` of every row of a two-sequence
    prefill, then the ``[2, V]`` logits of one decode step reading that KV."""
    from dataclasses import replace

    import layerzero as lz
    from layerzero.engine.config import ModelConfig
    from layerzero.engine.loader import load_model_weights
    from layerzero.engine.models.registry import build_model
    from layerzero.engine.worker.input_batch import ScheduledChunk, build_forward_batch

    state = replace(state, ep=ep)
    dev, bs = torch.device("cpu"), 4
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, 64, dev, torch.float32, parallel=state)
    load_model_weights(model, path)
    caches = [
        lz.allocate_kv_cache(16, bs, model.num_local_kv_heads, cfg.head_dim, torch.float32, "NHD", dev)
        for _ in range(cfg.num_layers)
    ]
    g = torch.Generator().manual_seed(3)
    seqs = [[1, *torch.randint(3, cfg.vocab_size, (n - 1,), generator=g).tolist()] for n in (7, 13)]
    tables = [[0, 1], [2, 3, 4, 5]]
    with torch.no_grad():
        chunks = [ScheduledChunk(s, 0, len(s), tb, True) for s, tb in zip(seqs, tables, strict=True)]
        batch = build_forward_batch(chunks, bs, dev)
        n = sum(len(s) for s in seqs)
        batch.logits_indices, batch.logits_all = torch.arange(n), True
        prefill = model(batch, caches)
        nxt = [int(prefill[len(seqs[0]) - 1].argmax()), int(prefill[-1].argmax())]
        chunks = [
            ScheduledChunk([*s, tok], len(s), 1, tb, True)
            for s, tok, tb in zip(seqs, nxt, tables, strict=True)
        ]
        decode = model(build_forward_batch(chunks, bs, dev), caches)
    return [prefill, decode]


def suite(state: Any, layers: bool, models: list[tuple[str, bool]]) -> dict[str, Any]:
    """One spawn for several checks (a rank's start-up costs seconds): :func:`layer_cases` when ``layers``,
    then :func:`model_logits` of each ``(checkpoint, ep)``."""
    return {
        "layers": layer_cases(state) if layers else None,
        "models": [model_logits(state, path, ep) for path, ep in models],
    }


SCENARIOS: dict[str, Callable[..., Any]] = {"suite": suite}
