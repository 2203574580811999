"""Triton kernel of ``triton.apply_token_bitmask``. Imported only after ``import triton`` succeeded.

A 2-D grid: axis 0 the masked rows, axis 1 blocks of ``BLOCK`` tokens (a multiple of 32). Each program reads
its row's logits index (``indices[r]``, or ``r``), loads the word of each of its tokens (words past ``W`` read
as 0: banned), tests the token's bit and stores -inf where it is off, in place: no bool tensor, no gather or
scatter of logits rows, allowed tokens never written.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask(
    Logits,
    Bits,
    Indices,
    stride_l,
    stride_b,
    vocab,
    width,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(Indices + r).to(tl.int64) if HAS_INDICES else r
    tok = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    word = tok // 32
    in_vocab = tok < vocab
    words = tl.load(Bits + r * stride_b + word, mask=in_vocab & (word < width), other=0)
    banned = ((words >> (tok % 32).to(tl.int32)) & 1) == 0
    tl.store(Logits + row * stride_l + tok, float("-inf"), mask=in_vocab & banned)
