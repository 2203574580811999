"""Probe: a batch-1 Qwen3 decode layer's QKV block as one kernel (``_qkv_rope_kernels._qkv_rope_cache``: input
RMSNorm + residual, the packed QKV projection with one program per head, q / k RMSNorm, RoPE, the K/V cache write)
against the engine's two (``lz.rms_norm_linear`` -> ``lz.qk_norm_rope_cache``), in 28-layer CUDA graphs
(PDL-launched, best of 7 replays, µs per layer): the QKV block alone and whole decode layers
(:class:`decode_layer_chain.Model`), with the fused kernel's ``BK`` / warps / stages varied. The fused kernel's q and
cache rows are compared with the two-kernel path's first.

Usage: ``PYTHONPATH=src:benchmarks:benchmarks/engine python benchmarks/engine/qkv_rope_probe.py [--contexts 384]
[--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse

import torch
from attention_block import D, HQ
from decode_layer_chain import Model, resources
from gemv_prefetch import chain_us, run_info, save_report

import layerzero as lz
from layerzero.backends.triton import _launch, paged
from layerzero.backends.triton import _qkv_rope_kernels as kq

HKV = 8
CONFIGS = [(128, 4, 3), (128, 4, 4), (256, 4, 3), (128, 8, 4), (64, 4, 4), (256, 8, 3), (128, 2, 4)]
"""(BK, num_warps, num_stages) of the fused kernel."""


def fused(m: Model, i: int, cfg: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The QKV block of layer ``i`` in one launch -> (q ``[1, Hq, D]``, new residual ``[1, hidden]``)."""
    bk, warps, stages = cfg
    x, r, cache = m.x, m.res, m.caches[i]
    w = m.w_qkv[i]
    q = torch.empty(1, HQ, D, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x)
    st = cache.stride()
    _launch.launch(kq._qkv_rope_cache, (HQ + 2 * HKV,), x, r, h, m.nw, w, w, q, cache, m.qw, m.kw, m.cos, m.sin,
                   m.pos, m.slots, 1, x.stride(0), r.stride(0), h.stride(0), w.stride(0), q.stride(0), q.stride(1),
                   m.cos.stride(0), m.sin.stride(0), st[0], st[1], st[2], st[3], cache.shape[2], 1e-6, 1e-6, HQ, HKV,
                   K=x.shape[1], D=D, BM=16, BK=bk, HAS_BIAS=False, RESIDUAL=True, QK_NORM=True, INTERLEAVED=False,
                   UPCAST=False, num_warps=warps, num_stages=stages, **_launch.pdl_kwargs(x, 1))
    return q, h


def two_kernels(m: Model, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's QKV block of layer ``i``: ``lz.rms_norm_linear`` then ``lz.qk_norm_rope_cache``."""
    qkv, res = lz.rms_norm_linear(m.x, m.nw, m.w_qkv[i], eps=1e-6, residual=m.res)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    q, _ = lz.qk_norm_rope_cache(q.view(1, HQ, D), k.view(1, HKV, D), v.view(1, HKV, D), m.qw, m.kw, m.cos, m.sin,
                                 m.caches[i], m.slots, position_ids=m.pos, eps=1e-6)
    return q, res


def layer_fused(m: Model, i: int, cfg: tuple[int, int, int]) -> torch.Tensor:
    """A whole decode layer with the fused QKV block (the rest as :meth:`Model.layer`)."""
    q, res = fused(m, i, cfg)
    o = paged.paged_decode(q, m.caches[i], m.bt, m.lens, D ** -0.5)
    h = lz.linear(o.reshape(1, HQ * D), m.o_w[i])
    gu, res = lz.rms_norm_linear(h, m.nw, m.w_gu[i], eps=1e-6, residual=res)
    return lz.swiglu_linear(gu[:, :3072], gu[:, 3072:], m.w_down[i])


def check(m: Model, ctx: int) -> list[str]:
    """Max abs differences of q, the new residual and the cache's new row: fused vs two kernels."""
    rows = []
    slot = ctx - 1
    blk, off = divmod(slot, m.caches[0].shape[2])
    q0, h0 = two_kernels(m, 0)
    kv0 = m.caches[0][blk, :, off].clone()
    m.caches[0][blk, :, off].zero_()
    for cfg in CONFIGS[:2]:
        q1, h1 = fused(m, 0, cfg)
        kv1 = m.caches[0][blk, :, off]
        rows.append(f"| {ctx} | check {cfg} | q {(q1 - q0).abs().max().item():.3g}, residual "
                    f"{(h1 - h0).abs().max().item():.3g}, cache row {(kv1.float() - kv0.float()).abs().max().item():.3g}"
                    f" (|q| max {q0.abs().max().item():.3g}) | |")
    return rows


def run(ctx: int) -> list[str]:
    m = Model(ctx)
    rows = check(m, ctx)
    rows.append(f"| {ctx} | QKV block: rms_norm_linear + qk_norm_rope_cache | {chain_us(lambda i: two_kernels(m, i)):.2f} | |")
    print(rows[-1], flush=True)
    for cfg in CONFIGS:
        rows.append(f"| {ctx} | QKV block fused, BK {cfg[0]}, {cfg[1]} warps, {cfg[2]} stages | "
                    f"{chain_us(lambda i, c=cfg: fused(m, i, c)):.2f} | |")
        print(rows[-1], flush=True)
    for rnd in range(2):
        rows.append(f"| {ctx} | layer: engine's kernels (round {rnd}) | {chain_us(lambda i: m.layer(i, (None,) * 4)):.2f} | |")
        print(rows[-1], flush=True)
        for cfg in CONFIGS[:4]:
            rows.append(f"| {ctx} | layer: fused QKV block {cfg} (round {rnd}) | "
                        f"{chain_us(lambda i, c=cfg: layer_fused(m, i, c)):.2f} | |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="384")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = [f"# Fused QKV block probe, 28-layer graphs ({run_info()})", "",
             "| KV len | chain | µs per layer | |", "| ---: | --- | ---: | --- |"]
    for ctx in (int(c) for c in a.contexts.split(",")):
        lines += run(ctx)
    lines += ["", "| kernel | registers | spills | shared bytes | warps | stages |", "| --- | ---: | ---: | ---: | ---: | ---: |",
              *resources()]
    print("\n".join(lines), flush=True)
    save_report(lines, a.out)


if __name__ == "__main__":
    main()
