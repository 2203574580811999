"""``lz.rope_paged_attention`` (optional per-head q/k RMSNorm, RoPE, the new K/V written into a paged cache,
then causal paged attention) against a float64 oracle written out here (no lz op in it): the default kernel
(composite) and the reference, float32/float64/float16/bfloat16, seeded odd shapes, GQA, both KV layouts, page
sizes 1 and 16, decode batches of different lengths and ragged prefill batches, with and without q/k weights,
interleaved and not, partial rotary, a skipped (-1) slot; plus bit equality with the three calls it fuses, its
typed errors (nothing written), its key and selection context, a custom kernel's canonical arguments, and
``torch.compile``."""

from __future__ import annotations

import math
import random

import pytest
import torch

import layerzero as lz
from layerzero.core.custom import CANONICAL_ARGS
from layerzero.core.kv_layout import KVLayout
from layerzero.ops import OPS
from layerzero.ops.rope_paged_attention import context as rpa_context
from layerzero.ops.rope_paged_attention import prepare as rpa_prepare

pytestmark = pytest.mark.correctness
OP = "rope_paged_attention"
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

# (layout, page size, decode, q/k weights, interleaved, partial rotary): every feature in some case
SPECS = [
    ("NHD", 16, True, True, False, False),
    ("HND", 1, True, False, True, False),
    ("NHD", 1, False, True, True, True),
    ("HND", 16, False, False, False, True),
    ("HND", 16, True, True, True, False),
    ("NHD", 16, False, True, False, False),
    ("NHD", 1, True, False, False, True),
    ("HND", 1, False, False, True, False),
]
SPEC_IDS = [
    f"{lay}-p{p}-{'dec' if d else 'pre'}-{'norm' if w else 'rope'}{'-il' if i else ''}{'-part' if r else ''}"
    for lay, p, d, w, i, r in SPECS
]


def rope_table(max_pos, r, interleaved, g):
    """Real RoPE cos/sin ``[max_pos, R]`` (halves equal for NeoX, pairs equal for GPT-J), a random base."""
    base = 100.0 + 9900.0 * torch.rand((), generator=g).item()
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    f = f.repeat_interleave(2, -1) if interleaved else torch.cat((f, f), -1)
    return f.cos(), f.sin()


def case(dtype, spec, seed):
    """The inputs of one call as a dict of ``lz.rope_paged_attention``'s arguments, seeded."""
    layout, page, decode, weights, interleaved, partial = spec
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    hkv, group, batch = rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.randint(1, 5)
    hq = hkv * group
    d = rng.choice([9, 13, 20]) if partial else rng.choice([8, 16, 24])
    r = 2 * max(1, d // 4) if partial else d
    q_lens = [1] * batch if decode else [rng.randint(0, 5) for _ in range(batch)]
    if not decode and sum(q_lens) == 0:
        q_lens[0] = 3
    seq_lens = [q + rng.randint(0 if q else 1, 23) for q in q_lens]
    need = [math.ceil(s / page) for s in seq_lens]
    nblocks = sum(need) + 2
    ids = torch.randperm(nblocks, generator=g).tolist()
    width = max(need)
    rows = []
    for n in need:
        rows.append(ids[:n] + [0] * (width - n))
        ids = ids[n:]
    tables = torch.tensor(rows, dtype=torch.int32)
    pos, slots = [], []
    for s, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for i in range(ql):
            p = sl - ql + i
            pos.append(p)
            slots.append(rows[s][p // page] * page + p % page)
    t = len(pos)
    slots = torch.tensor(slots, dtype=torch.int64 if seed % 2 else torch.int32)
    slots[rng.randrange(t)] = -1  # a padded token: not written (attention reads what the slot held)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)  # views of one packed projection
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cos, sin = rope_table(max(seq_lens) + 3, r, interleaved, g)
    cache = lz.allocate_kv_cache(nblocks, page, hkv, d, dtype, layout)
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    a = dict(
        q=q.view(t, hq, d),
        k=k.view(t, hkv, d),
        v=v.view(t, hkv, d),
        cos=cos.to(dtype),
        sin=sin.to(dtype),
        kv_cache=cache,
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        position_ids=torch.tensor(pos, dtype=torch.int64 if seed % 3 else torch.int32),
        interleaved=interleaved,
        kv_layout=layout,
        eps=1e-6,
    )
    if weights:
        a["q_weight"] = (torch.rand(d, generator=g) + 0.5).to(dtype)
        a["k_weight"] = (torch.rand(d, generator=g) + 0.5).to(dtype)
    if not decode:
        a["cu_seqlens_q"] = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return a


def call(a, fn=None):
    a = dict(a)
    args = [
        a.pop(n)
        for n in ("q", "k", "v", "cos", "sin", "kv_cache", "slot_mapping", "block_tables", "seq_lens")
    ]
    return (fn or lz.rope_paged_attention)(*args, **a)


def oracle(a):
    """float64: per-head RMSNorm (with weights), RoPE on the first R dims, the writes into a float64 copy of
    the cache, then per sequence plain causal attention (bottom-right) over K/V gathered through its
    block-table row. Returns ``(out [T, Hq, D], rotated k [T, Hkv, D])``."""
    q, k, v = a["q"].double(), a["k"].double(), a["v"].double()
    if "q_weight" in a:
        eps = a["eps"]
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * a["q_weight"].double()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * a["k_weight"].double()
    pos = a["position_ids"].long()
    c, s = a["cos"].double()[pos][:, None, :], a["sin"].double()[pos][:, None, :]
    r = c.shape[-1]

    def rope(x):
        x1 = x[..., :r]
        if a["interleaved"]:
            rot = torch.stack((-x1[..., 1::2], x1[..., 0::2]), -1).flatten(-2)
        else:
            rot = torch.cat((-x1[..., r // 2 :], x1[..., : r // 2]), -1)
        return torch.cat((x1 * c + rot * s, x[..., r:]), -1)

    q, k = rope(q), rope(k)
    cache = a["kv_cache"].double()
    nhd = cache if a["kv_layout"] == "NHD" else cache.transpose(2, 3)  # [N, 2, P, Hkv, D]
    page = nhd.shape[2]
    for t, slot in enumerate(a["slot_mapping"].tolist()):
        if slot >= 0:
            nhd[slot // page, 0, slot % page] = k[t]
            nhd[slot // page, 1, slot % page] = v[t]
    lens = a["seq_lens"].tolist()
    cu = a["cu_seqlens_q"].tolist() if "cu_seqlens_q" in a else list(range(len(lens) + 1))
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    out = torch.zeros_like(q)
    for b, kv_len in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        row = a["block_tables"][b].tolist()
        keys = torch.stack([nhd[row[j // page], 0, j % page] for j in range(kv_len)])  # [kv_len, Hkv, D]
        vals = torch.stack([nhd[row[j // page], 1, j % page] for j in range(kv_len)])
        for i in range(q1 - q0):
            last = kv_len - (q1 - q0) + i  # causal, aligned bottom-right: keys 0..last
            for h in range(hq):
                sc = keys[: last + 1, h // group] @ q[q0 + i, h] / math.sqrt(d)
                out[q0 + i, h] = torch.softmax(sc, 0) @ vals[: last + 1, h // group]
    return out, k


def check_cache(a, before, want_k, tol):
    """The cache holds the rotated k (to ``tol``) and v (exactly) at the written slots, and nothing else
    changed."""
    lay = a["kv_layout"]
    nhd = a["kv_cache"] if lay == "NHD" else a["kv_cache"].transpose(2, 3)
    old = before if lay == "NHD" else before.transpose(2, 3)
    page = nhd.shape[2]
    written = torch.zeros(nhd.shape[0], page, dtype=torch.bool)
    for t, slot in enumerate(a["slot_mapping"].tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, page)
        written[b, o] = True
        err = (nhd[b, 0, o].double() - want_k[t]).abs().max() / want_k.abs().max()
        assert err.item() <= tol, f"cached k of token {t}: relative error {err.item():.2e}"
        assert torch.equal(nhd[b, 1, o], a["v"][t])
    keep = (~written)[:, None, :].expand(-1, 2, -1)  # [N, 2, P]
    assert torch.equal(nhd[keep], old[keep]), "no other slot changes (-1 skips)"


@pytest.mark.parametrize("kernel", [None, "reference.rope_paged_attention"], ids=["default", "reference"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=["f32", "f64", "f16", "bf16"]
)
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_cpu_kernels_match_float64(kernel, dtype, spec):
    a = case(dtype, spec, seed=SPECS.index(spec) * 31 + 7)
    before = a["kv_cache"].clone()
    want, want_k = oracle(a)
    if kernel is not None:
        lz.lock(OP, kernel)
    try:
        out = call(a)
    finally:
        if kernel is not None:
            lz.unlock(OP)
    tol = TOL[dtype]
    assert out.shape == a["q"].shape and out.dtype == dtype
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    check_cache(a, before, want_k, tol)


def test_the_default_on_cpu_is_the_composite():
    a = case(torch.float32, SPECS[0], seed=3)
    assert call(a, lambda *args, **kw: lz.which(OP, *args, **kw)) == "composite.rope_paged_attention"


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_equals_the_three_calls_bit_for_bit(spec):
    """Default kernel == ``lz.qk_norm_rope`` (``lz.rope``) + ``lz.reshape_and_cache`` +
    ``lz.paged_attention``, the output and the whole cache, on CPU float32."""
    a = case(torch.float32, spec, seed=SPECS.index(spec) + 100)
    b = {**a, "kv_cache": a["kv_cache"].clone()}
    out = call(a)
    pos = b["position_ids"].view(1, -1)
    if "q_weight" in b:
        q, k = lz.qk_norm_rope(
            b["q"][None],
            b["k"][None],
            b["q_weight"],
            b["k_weight"],
            b["cos"],
            b["sin"],
            eps=b["eps"],
            position_ids=pos,
            interleaved=b["interleaved"],
            layout="BSHD",
        )
    else:
        q, k = lz.rope(
            b["q"][None],
            b["k"][None],
            b["cos"],
            b["sin"],
            position_ids=pos,
            interleaved=b["interleaved"],
            layout="BSHD",
        )
    lz.reshape_and_cache(k[0], b["v"], b["kv_cache"], b["slot_mapping"], b["kv_layout"])
    want = lz.paged_attention(
        q[0],
        b["kv_cache"],
        b["block_tables"],
        b["seq_lens"],
        cu_seqlens_q=b.get("cu_seqlens_q"),
        is_causal=True,
        kv_layout=b["kv_layout"],
    )
    assert torch.equal(out, want)
    assert torch.equal(a["kv_cache"], b["kv_cache"])


def test_scale_is_passed_to_the_attention():
    """Without the norm RoPE is linear: q scaled by ``c * sqrt(D)`` at the default scale equals
    ``scale=c``."""
    a = case(torch.float64, SPECS[3], seed=11)
    scaled = call({**a, "scale": 0.37})
    assert not torch.allclose(call(a), scaled)
    torch.testing.assert_close(call({**a, "q": a["q"] * (0.37 * math.sqrt(a["q"].shape[-1]))}), scaled)


# ----------------------------------------------------------------------------------------------- bad inputs
def _prefill(seed=5):
    return case(torch.float32, SPECS[2], seed)  # prefill with weights, NHD, page 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda a: {**a, "k_weight": None},
            r"q_weight / k_weight: expected both \[D\] tensors .* or both None",
        ),
        (lambda a: {**a, "q_weight": None}, r"q_weight / k_weight"),
        (
            lambda a: {**a, "kv_cache": a["kv_cache"].to(torch.float8_e4m3fn)},
            r"kv_cache\.dtype: expected .*unquantized.*lz\.reshape_and_cache\(k_scale=",
        ),
        (
            lambda a: {k: v for k, v in a.items() if k != "cu_seqlens_q"},
            r"num_tokens \(decode\): expected one query",
        ),
        (
            lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"][:-1]},
            r"cu_seqlens_q shape: expected \[batch \+ 1\]",
        ),
        (lambda a: {**a, "v": a["v"][:, :, 1:]}, r"k/v shape"),
        (lambda a: {**a, "k": a["k"][:, :, 1:]}, r"k shape: expected the batch, sequence and head_dim of q"),
        (
            lambda a: {**a, "position_ids": a["position_ids"][:-1]},
            r"position_ids shape: expected \[num_tokens\]",
        ),
        (lambda a: {**a, "q": a["q"][None]}, r"q rank: expected 3 dims"),
        (lambda a: {**a, "q_weight": a["q_weight"][:2]}, r"q_weight shape"),
        (
            lambda a: {**a, "slot_mapping": a["slot_mapping"] + 10_000},
            r"slot_mapping\[\d+\]: expected -1 \(skip\)",
        ),
        (lambda a: {**a, "seq_lens": a["seq_lens"] + 10_000}, r"seq_lens\[0\]: expected in \[0, max_blocks"),
        (lambda a: {**a, "scale": -1.0}, r"scale: expected None \(1/sqrt\(D\)\) or a finite float > 0"),
        (lambda a: {**a, "eps": 0.0}, r"eps: expected a finite float > 0"),
        (lambda a: {**a, "kv_layout": "NDH"}, r"kv_layout"),
        (lambda a: {**a, "v": a["v"].double()}, r"v\.dtype"),
    ],
    ids=[
        "no-k-weight",
        "no-q-weight",
        "quantized",
        "decode-T!=B",
        "cu-length",
        "v-shape",
        "k-shape",
        "pos-shape",
        "q-rank",
        "weight-shape",
        "slot-range",
        "seq-lens",
        "scale",
        "eps",
        "layout",
        "v-dtype",
    ],
)
def test_bad_inputs_raise_typed_errors_and_write_nothing(change, match):
    a = _prefill()
    cache = a["kv_cache"]
    before = cache.clone()
    with pytest.raises(lz.InvalidInputError, match=r"lz\.rope_paged_attention: " + match):
        call(change(a))
    assert torch.equal(cache, before), "nothing is written before every check passed"


def test_rope_only_errors_name_the_op_too():
    a = case(torch.float32, SPECS[1], seed=2)  # decode, no weights
    before = a["kv_cache"].clone()
    with pytest.raises(lz.InvalidInputError, match=r"lz\.rope_paged_attention: eps"):
        call({**a, "eps": float("nan")})
    with pytest.raises(lz.InvalidInputError, match=r"lz\.rope_paged_attention: rotary dim"):
        call({**a, "cos": a["cos"][:, :3], "sin": a["sin"][:, :3]})
    assert torch.equal(a["kv_cache"], before)


# ------------------------------------------------------------------------------------------ key and context
def test_key_and_context_carry_what_kernels_check():
    dec = case(torch.float32, SPECS[0], seed=21)
    args = [
        dec.pop(n)
        for n in ("q", "k", "v", "cos", "sin", "kv_cache", "slot_mapping", "block_tables", "seq_lens")
    ]
    key, kargs = rpa_prepare(*args, **dec)
    assert key.op == OP and key.qk_norm and key.decode and key.scale_default and key.kv_layout is KVLayout.NHD
    assert key._fields[-5:] == ("stride_last_1", "requires_grad", "deterministic", "capture", "scope")
    assert len(kargs) == len(CANONICAL_ARGS[OP]) and kargs[15] is KVLayout.NHD and kargs[13] is None
    ctx = rpa_context(key)
    q = args[0]
    assert ctx.phase.value == "decode" and ctx.gqa_ratio == q.shape[1] // args[1].shape[1]
    assert ctx.kv_layout == "NHD" and ctx.page_size == 16 and ctx.rotary_dim == ctx.head_dim == q.shape[2]
    assert ctx.is_causal and not ctx.interleaved and ctx.batch == key.batch
    pre = case(torch.float32, SPECS[3], seed=22)  # prefill, HND, partial rotary, no weights
    args = [
        pre.pop(n)
        for n in ("q", "k", "v", "cos", "sin", "kv_cache", "slot_mapping", "block_tables", "seq_lens")
    ]
    key2, kargs2 = rpa_prepare(*args, **pre, scale=0.5)
    assert not key2.qk_norm and not key2.decode and not key2.scale_default and kargs2[13] == 0.5
    assert kargs2[3] is None and kargs2[4] is None
    ctx2 = rpa_context(key2)
    assert ctx2.phase.value == "prefill" and ctx2.kv_layout == "HND" and ctx2.page_size == 16
    assert ctx2.rotary_dim < ctx2.head_dim
    assert OPS[OP] == (rpa_prepare, rpa_context) and OP in lz.__all__


def test_custom_kernel_gets_the_canonical_arguments_in_order():
    seen = []

    def spy(*args):
        seen.append(args)
        return torch.zeros_like(args[0])

    lz.register_kernel(OP, "mylib.rpa_spy", spy, priority=1000, device_types={"cpu"})
    try:
        a = _prefill()
        call(a)
    finally:
        lz.unregister_kernel("mylib.rpa_spy")
    (args,) = seen
    named = dict(zip(CANONICAL_ARGS[OP], args, strict=True))
    for name in (
        "q",
        "k",
        "v",
        "q_weight",
        "k_weight",
        "cos",
        "sin",
        "kv_cache",
        "slot_mapping",
        "position_ids",
        "block_tables",
        "seq_lens",
        "cu_seqlens_q",
    ):
        assert named[name] is a[name], name
    assert named["scale"] is None and named["interleaved"] is True and named["kv_layout"] is KVLayout.NHD
    assert named["eps"] == 1e-6


# -------------------------------------------------------------------------------------------- torch.compile
def _step(q, k, v, cos, sin, cache, slots, tables, lens, pos, qw, kw, cu, interleaved):
    out = lz.rope_paged_attention(
        q,
        k,
        v,
        cos,
        sin,
        cache,
        slots,
        tables,
        lens,
        position_ids=pos,
        q_weight=qw,
        k_weight=kw,
        cu_seqlens_q=cu,
        interleaved=interleaved,
        kv_layout="HND",
    )
    return out * 2 + 1


@pytest.mark.parametrize("weights", [True, False], ids=["norm", "rope"])
def test_compiles_fullgraph_and_matches_eager(weights):
    """One ``torch.ops.layerzero.rope_paged_attention`` node (no graph break); the compiled cache write
    happens, exactly as eager's."""
    torch._dynamo.reset()
    a = case(torch.float32, SPECS[4] if weights else SPECS[3], seed=40 + weights)
    names = (
        "q",
        "k",
        "v",
        "cos",
        "sin",
        "kv_cache",
        "slot_mapping",
        "block_tables",
        "seq_lens",
        "position_ids",
    )
    args = [a[n] for n in names] + [
        a.get("q_weight"),
        a.get("k_weight"),
        a.get("cu_seqlens_q"),
        a["interleaved"],
    ]
    eager_args = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    assert (
        torch._dynamo.explain(_step)(
            *[t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        ).graph_break_count
        == 0
    )
    got = torch.compile(_step, fullgraph=True)(*args)
    want = _step(*eager_args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(args[5], eager_args[5])
