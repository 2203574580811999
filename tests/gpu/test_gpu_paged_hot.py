"""``lz.paged_attention``'s exact-key hot path on a real GPU (``pytest -m gpu``): after two calls the exact
key is filed and later calls skip the checks; calls with the same shapes but new index values (sequence
lengths, block tables) still compute the right answer (float64 reference over the gathered pages), so nothing
value-dependent is kept in the key."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME
from layerzero.ops import paged

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _oracle(q, cache, table, lens):
    """float64 decode attention of q [B, Hq, D] over each sequence's first lens[b] cached tokens (NHD
    cache)."""
    b, hq, d = q.shape
    hkv, page = cache.shape[3], cache.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for s in range(b):
        n = int(lens[s])
        blocks = table[s, : (n + page - 1) // page].long().cpu()
        kv = cache.cpu().double()[blocks]  # [nb, 2, P, Hkv, D]
        k = kv[:, 0].reshape(-1, hkv, d)[:n].transpose(0, 1)  # [Hkv, n, D]
        v = kv[:, 1].reshape(-1, hkv, d)[:n].transpose(0, 1)
        qs = q[s].cpu().double().view(hkv, hq // hkv, d)
        att = torch.softmax(qs @ k.transpose(1, 2) / d**0.5, dim=-1)
        out[s] = (att @ v).reshape(hq, d)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hot_path_keeps_every_value_out_of_the_key(dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    b, hq, hkv, d, page, width = 5, 16, 4, 128, 16, 9
    cache = lz.allocate_kv_cache(64, page, hkv, d, dtype, "NHD", DEV)
    cache.normal_(generator=g)
    q = torch.randn(b, hq, d, device=DEV, dtype=dtype, generator=g)
    cpu = torch.Generator().manual_seed(1)
    hot = paged._hot_key(
        q,
        cache,
        torch.zeros(b, width, dtype=torch.int32, device=DEV),
        torch.ones(b, dtype=torch.int32, device=DEV),
        None,
        None,
        True,
        "NHD",
    )
    assert hot is not None
    for step in range(6):  # same shapes every step: new lengths and block ids each time
        lens = torch.randint(1, width * page + 1, (b,), generator=cpu, dtype=torch.int32)
        table = torch.randperm(64, generator=cpu)[: b * width].view(b, width).to(torch.int32)
        out = lz.paged_attention(q, cache, table.to(DEV), lens.to(DEV))
        torch.testing.assert_close(out.double().cpu(), _oracle(q, cache, table, lens), rtol=2e-2, atol=2e-2)
        if step >= 1:
            assert hot in RUNTIME.cache.hot  # filed after the first cache hit
