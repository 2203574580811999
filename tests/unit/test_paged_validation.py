"""Input validation, cache keys, contexts and routing of ``lz.paged_attention`` / ``lz.reshape_and_cache`` /
``lz.allocate_kv_cache``: every bad input raises ``InvalidInputError`` naming what failed and expected vs
got."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME
from layerzero.ops import paged
from layerzero.ops.kv_cache import KVLayout, check_values

pytestmark = pytest.mark.unit

I32 = torch.int32


def _decode_args(**over):
    """Valid decode inputs: 2 sequences (kv lens 5 and 1), Hq=4, Hkv=2, D=8, page 4, 3 blocks, NHD."""
    args = dict(
        q=torch.randn(2, 4, 8),
        kv_cache=torch.zeros(3, 2, 4, 2, 8),
        block_tables=torch.tensor([[2, 0], [1, -1]], dtype=I32),
        seq_lens=torch.tensor([5, 1], dtype=I32),
    )
    args.update(over)
    return args


def _append_args(**over):
    """Valid append inputs: q_lens 2 and 0 (kv lens 5 and 0), cu_seqlens_q [0, 2, 2]."""
    args = dict(
        q=torch.randn(2, 4, 8),
        kv_cache=torch.zeros(3, 2, 4, 2, 8),
        block_tables=torch.tensor([[2, 0], [-1, -1]], dtype=I32),
        seq_lens=torch.tensor([5, 0], dtype=I32),
        cu_seqlens_q=torch.tensor([0, 2, 2], dtype=I32),
    )
    args.update(over)
    return args


def _call(args):
    a = dict(args)
    return lz.paged_attention(a.pop("q"), a.pop("kv_cache"), a.pop("block_tables"), a.pop("seq_lens"), **a)


def test_valid_inputs_run():
    assert _call(_decode_args()).shape == (2, 4, 8)
    assert _call(_append_args()).shape == (2, 4, 8)
    hnd = _decode_args(kv_cache=torch.zeros(3, 2, 2, 4, 8), kv_layout="HND")
    assert _call(hnd).shape == (2, 4, 8)
    assert _call(_decode_args(kv_layout=KVLayout.NHD)).shape == (2, 4, 8)


BAD_PAGED = [
    ("q not a tensor", _decode_args(q=[1.0]), r"lz.paged_attention: q: expected a torch.Tensor, got list"),
    ("q rank", _decode_args(q=torch.randn(2, 4, 8, 1)), r"q rank: expected 3 dims, got 4 dims"),
    ("q int", _decode_args(q=torch.ones(2, 4, 8, dtype=I32)), r"q.dtype: expected one of float32"),
    ("layout", _decode_args(kv_layout="BHSD"), r"kv_layout: expected 'NHD' .* or 'HND' .*got 'BHSD'"),
    ("layout lower", _decode_args(kv_layout="nhd"), r"kv_layout: .*got 'nhd'"),
    (
        "cache rank",
        _decode_args(kv_cache=torch.zeros(3, 4, 2, 8)),
        r"kv_cache shape \(NHD\): expected \[num_blocks, 2",
    ),
    (
        "cache dim1",
        _decode_args(kv_cache=torch.zeros(3, 3, 4, 2, 8)),
        r"kv_cache shape .*got \[3, 3, 4, 2, 8\]",
    ),
    (
        "cache dtype",
        _decode_args(kv_cache=torch.zeros(3, 2, 4, 2, 8, dtype=torch.float16)),
        r"kv_cache.dtype: expected torch.float32 \(like q\), got torch.float16",
    ),
    (
        "head dim",
        _decode_args(kv_cache=torch.zeros(3, 2, 4, 2, 16)),
        r"kv_cache head_dim: expected q's head_dim D=8",
    ),
    (
        "gqa",
        _decode_args(kv_cache=torch.zeros(3, 2, 4, 3, 8)),
        r"heads: expected Hq divisible by Hkv.*Hq=4, Hkv=3",
    ),
    (
        "wrong layout shape",
        _decode_args(kv_cache=torch.zeros(3, 2, 2, 8, 8), kv_layout="NHD"),
        r"heads: expected Hq divisible by Hkv.*Hq=4, Hkv=8.*Check kv_layout",
    ),
    (
        "block_tables int64",
        _decode_args(block_tables=torch.tensor([[2, 0], [1, 0]])),
        r"block_tables.dtype: expected int32, got torch.int64",
    ),
    (
        "block_tables rank",
        _decode_args(block_tables=torch.tensor([2, 1], dtype=I32)),
        r"block_tables rank: expected 2",
    ),
    ("seq_lens float", _decode_args(seq_lens=torch.tensor([5.0, 1.0])), r"seq_lens.dtype: expected int32"),
    (
        "seq_lens length",
        _decode_args(seq_lens=torch.tensor([5], dtype=I32)),
        r"seq_lens shape: expected \[batch\] = \[2\]",
    ),
    (
        "decode tokens",
        _decode_args(q=torch.randn(3, 4, 8)),
        r"num_tokens \(decode\): expected one query token",
    ),
    (
        "seq_len too long",
        _decode_args(seq_lens=torch.tensor([9, 1], dtype=I32)),
        r"seq_lens\[0\]: expected in \[0, max_blocks \* block_size\] = \[0, 8\].*got 9",
    ),
    (
        "negative seq_len",
        _append_args(seq_lens=torch.tensor([5, -1], dtype=I32)),
        r"seq_lens\[1\]: expected in \[0, max_blocks \* block_size\] = \[0, 8\].*got -1",
    ),
    (
        "decode empty seq",
        _decode_args(seq_lens=torch.tensor([5, 0], dtype=I32)),
        r"seq_lens\[1\] \(decode\): expected >= 1",
    ),
    (
        "block id range",
        _decode_args(block_tables=torch.tensor([[2, 3], [1, 0]], dtype=I32)),
        r"block_tables\[0, 1\]: expected a block id in \[0, num_blocks\) = \[0, 3\).*got 3",
    ),
    (
        "negative block id",
        _decode_args(block_tables=torch.tensor([[2, 0], [-1, 0]], dtype=I32)),
        r"block_tables\[1, 0\]: .*got -1",
    ),
    (
        "cu length",
        _append_args(cu_seqlens_q=torch.tensor([0, 2], dtype=I32)),
        r"cu_seqlens_q shape: expected \[batch \+ 1\] = \[3\]",
    ),
    ("cu int64", _append_args(cu_seqlens_q=torch.tensor([0, 2, 2])), r"cu_seqlens_q.dtype: expected int32"),
    (
        "cu start",
        _append_args(cu_seqlens_q=torch.tensor([1, 2, 2], dtype=I32)),
        r"cu_seqlens_q ends: expected .*== 0",
    ),
    (
        "cu end",
        _append_args(cu_seqlens_q=torch.tensor([0, 1, 1], dtype=I32)),
        r"cu_seqlens_q\[-1\] == num_tokens \(2\)",
    ),
    (
        "cu monotonic",
        _append_args(cu_seqlens_q=torch.tensor([0, 3, 2], dtype=I32), q=torch.randn(2, 4, 8)),
        r"non-decreasing .*cu_seqlens_q\[1\]=3 > cu_seqlens_q\[2\]=2",
    ),
    (
        "q_len > seq_len",
        _append_args(seq_lens=torch.tensor([1, 0], dtype=I32)),
        r"q_len of sequence 0: expected <= its seq_len 1",
    ),
    (
        "scale",
        _decode_args(scale=0.0),
        r"scale: expected None \(1/sqrt\(D\)\) or a finite float > 0, got 0.0",
    ),
    ("scale nan", _decode_args(scale=float("nan")), r"scale: .*got nan"),
    ("is_causal", _decode_args(is_causal=1), r"is_causal: expected a bool, got 1"),
    # batch / token-count consistency (shapes only: these hold on CUDA without reading a value)
    (
        "batch 0 with tokens",
        _append_args(
            q=torch.randn(3, 4, 8),
            block_tables=torch.zeros(0, 2, dtype=I32),
            seq_lens=torch.zeros(0, dtype=I32),
            cu_seqlens_q=torch.zeros(1, dtype=I32),
        ),
        r"num_tokens \(batch 0\): expected 0 query tokens .*got q.shape\[0\] = 3",
    ),
    (
        "decode batch 0 with tokens",
        _decode_args(
            q=torch.randn(3, 4, 8),
            block_tables=torch.zeros(0, 2, dtype=I32),
            seq_lens=torch.zeros(0, dtype=I32),
        ),
        r"num_tokens \(decode\): expected one query token per sequence: q.shape\[0\] == batch = 0, got 3",
    ),
    (
        "cu batch mismatch",
        _append_args(cu_seqlens_q=torch.tensor([0, 1, 2, 2], dtype=I32)),
        r"cu_seqlens_q shape: expected \[batch \+ 1\] = \[3\] \(rows of block_tables \+ 1\), got \[4\]",
    ),
    (
        "seq_lens vs block_tables rows",
        _append_args(seq_lens=torch.tensor([5, 0, 0], dtype=I32)),
        r"seq_lens shape: expected \[batch\] = \[2\] \(rows of block_tables\), got \[3\]",
    ),
    (
        "tokens beyond capacity",
        _append_args(q=torch.randn(17, 4, 8), cu_seqlens_q=torch.tensor([0, 9, 17], dtype=I32)),
        r"num_tokens: expected <= batch \* max_blocks \* block_size = 2 \* 2 \* 4 = 16 .*got q.shape\[0\] = "
        r"17",
    ),
    (
        "decode without block columns",
        _decode_args(block_tables=torch.zeros(2, 0, dtype=I32), seq_lens=torch.ones(2, dtype=I32)),
        r"num_tokens: expected <= batch \* max_blocks \* block_size = 2 \* 0 \* 4 = 0",
    ),
    (
        "empty cache with tokens",
        _decode_args(kv_cache=torch.zeros(0, 2, 4, 2, 8)),
        r"kv_cache num_blocks: expected >= 1 when there are query tokens.*got 0",
    ),
    (
        "batch 0 cu value",
        _append_args(
            q=torch.randn(0, 4, 8),
            block_tables=torch.zeros(0, 2, dtype=I32),
            seq_lens=torch.zeros(0, dtype=I32),
            cu_seqlens_q=torch.ones(1, dtype=I32),
        ),
        r"cu_seqlens_q \(batch 0\): expected \[0\], got \[1\]",
    ),
]


@pytest.mark.parametrize(("args", "match"), [c[1:] for c in BAD_PAGED], ids=[c[0] for c in BAD_PAGED])
def test_bad_paged_attention_inputs(args, match):
    with pytest.raises(lz.InvalidInputError, match=match):
        _call(args)


SHAPE_ONLY = (
    "batch 0 with tokens",
    "decode batch 0 with tokens",
    "cu batch mismatch",
    "tokens beyond capacity",
    "decode without block columns",
    "empty cache with tokens",
)


@pytest.mark.parametrize("name", SHAPE_ONLY)
def test_batch_and_token_checks_need_no_value_read(name):
    """The same inputs on the meta device (whose values cannot be read, like CUDA tensors outside strict mode)
    still raise: these checks use shapes only."""
    args, match = next(c[1:] for c in BAD_PAGED if c[0] == name)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    assert not check_values(meta["seq_lens"])
    with pytest.raises(lz.InvalidInputError, match=match):
        paged.prepare(
            meta.pop("q"), meta.pop("kv_cache"), meta.pop("block_tables"), meta.pop("seq_lens"), **meta
        )


def test_repeated_bad_calls_charge_no_backend_health():
    """Inconsistent shapes are rejected before dispatch, so no kernel crashes on them and no backend's circuit
    breaker moves (before the fix, three batch-0 calls with 3 query tokens returned zeros while each one
    crashed torch_sdpa.paged_attention inside, opening its breaker for 30 s)."""
    RUNTIME.ensure_ready()
    RUNTIME.health.reset()
    bad = [c[1] for c in BAD_PAGED if c[0] in SHAPE_ONLY]
    with lz.trace() as tr:
        for _ in range(lz.get_config().health_failure_threshold + 1):
            for args in bad:
                with pytest.raises(lz.InvalidInputError):
                    _call(args)
    assert tr.fallbacks == [] and tr.counts == {}
    charged = {b: e for b, e in RUNTIME.health.snapshot().items() if e["failures"] or e["state"] != "CLOSED"}
    assert charged == {}
    assert (
        lz.which(
            "paged_attention", *(_decode_args()[k] for k in ("q", "kv_cache", "block_tables", "seq_lens"))
        )
        == "torch_sdpa.paged_attention"
    )


def test_bad_input_count():
    assert len(BAD_PAGED) + len(BAD_CACHE) >= 15


def _cache_args(**over):
    args = dict(
        k=torch.randn(3, 2, 8),
        v=torch.randn(3, 2, 8),
        kv_cache=torch.zeros(2, 2, 4, 2, 8),
        slot_mapping=torch.tensor([0, -1, 7]),
    )
    args.update(over)
    return args


BAD_CACHE = [
    ("k rank", _cache_args(k=torch.randn(3, 16)), r"lz.reshape_and_cache: k rank: expected 3 dims"),
    (
        "v shape",
        _cache_args(v=torch.randn(3, 1, 8)),
        r"k/v shape: expected \[num_tokens, Hkv, D\] = \[3, 2, 8\]",
    ),
    (
        "dtype",
        _cache_args(k=torch.randn(3, 2, 8, dtype=torch.float64)),
        r"k.dtype: expected torch.float32 \(like kv_cache\)",
    ),
    (
        "slot dtype",
        _cache_args(slot_mapping=torch.tensor([0.0, 1.0, 2.0])),
        r"slot_mapping.dtype: expected int32/int64",
    ),
    (
        "slot length",
        _cache_args(slot_mapping=torch.tensor([0, 1])),
        r"slot_mapping shape: expected \[num_tokens\] = \[3\]",
    ),
    (
        "slot range",
        _cache_args(slot_mapping=torch.tensor([0, 8, 1])),
        r"slot_mapping\[1\]: expected -1 \(skip\) or a slot in \[0, num_blocks \* block_size\) = \[0, 8\), "
        r"got 8",
    ),
    ("slot -2", _cache_args(slot_mapping=torch.tensor([-2, 0, 1])), r"slot_mapping\[0\]: .*got -2"),
    ("layout", _cache_args(kv_layout="XYZ"), r"kv_layout: expected 'NHD'"),
    ("cache rank", _cache_args(kv_cache=torch.zeros(8, 2, 8)), r"kv_cache shape \(NHD\)"),
    (
        "grad cache",
        _cache_args(kv_cache=torch.zeros(2, 2, 4, 2, 8, requires_grad=True)),
        r"kv_cache.requires_grad: expected False, got True",
    ),
]


@pytest.mark.parametrize(("args", "match"), [c[1:] for c in BAD_CACHE], ids=[c[0] for c in BAD_CACHE])
def test_bad_reshape_and_cache_inputs(args, match):
    a = dict(args)
    cache = a["kv_cache"]
    before = cache.detach().clone()
    with pytest.raises(lz.InvalidInputError, match=match):
        lz.reshape_and_cache(a.pop("k"), a.pop("v"), a.pop("kv_cache"), a.pop("slot_mapping"), **a)
    assert torch.equal(cache.detach(), before), "a rejected call must not write"


# ------------------------------------------------------------------------------------------ allocate_kv_cache
@pytest.mark.parametrize(("layout", "shape"), [("NHD", (5, 2, 16, 4, 32)), ("HND", (5, 2, 4, 16, 32))])
def test_allocate_kv_cache_shape_and_bytes(layout, shape):
    cache = lz.allocate_kv_cache(5, 16, 4, 32, torch.bfloat16, layout)
    assert tuple(cache.shape) == shape and cache.dtype == torch.bfloat16 and not cache.any()
    assert cache.numel() * cache.element_size() == 2 * 5 * 16 * 4 * 32 * 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_blocks=-1), r"allocate_kv_cache: num_blocks: expected an int >= 0, got -1"),
        (dict(block_size=0), r"block_size: expected an int >= 1, got 0"),
        (dict(num_kv_heads=2.0), r"num_kv_heads: expected an int >= 1, got 2.0"),
        (dict(head_dim=True), r"head_dim: expected an int >= 1, got True"),
        (dict(dtype=torch.int32), r"dtype: expected one of torch.float32"),  # int8: a quantized cache
        (dict(layout="BSHD"), r"layout: expected 'NHD'.*got 'BSHD'"),
    ],
)
def test_allocate_kv_cache_rejects(kwargs, match):
    args = dict(num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32, layout="NHD")
    args.update(kwargs)
    with pytest.raises(lz.InvalidInputError, match=match):
        lz.allocate_kv_cache(**args)


def _alloc(**kw):
    args = dict(num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    args.update(kw)
    return lz.allocate_kv_cache(**args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(device="nope"), r"allocate_kv_cache: device: expected a torch device string .*got 'nope'"),
        (dict(device=None), r"device: expected a torch.device, .*got NoneType None"),
        (dict(device=-1), r"device \(CUDA ordinal\): expected an int >= 0, got -1"),
        # 2 * 2**40 * 4 * 1 * 2**30 * 4 bytes = 2**75: the element count alone overflows int64
        (
            dict(num_blocks=2**40, head_dim=2**30),
            r"cache size: expected at most 9223372036854775807 bytes \(int64\), "
            r"got 37778931862957161709568 bytes = 2 \* 1099511627776 blocks",
        ),
        # 2**53 bytes (8 PiB): fits int64, exceeds any machine's RAM; rejected without allocating
        (
            dict(num_blocks=2**30, block_size=2**10, head_dim=2**10),
            r"cache size: expected at most .*got 9007199254740992 "
            r"bytes",
        ),
    ],
)
def test_allocate_kv_cache_rejects_device_and_size(kwargs, match):
    with pytest.raises(lz.InvalidInputError, match=match):
        _alloc(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0, torch.device("cuda")])
def test_allocate_kv_cache_without_cuda_is_backend_not_available(device):
    with pytest.raises(
        lz.BackendNotAvailableError,
        match=r"allocate_kv_cache: device 'cuda.*': expected a usable "
        r"CUDA device .*pass device='cpu'",
    ):
        _alloc(device=device)


def test_allocate_kv_cache_out_of_memory_is_typed(monkeypatch):
    """An allocation that passes the size checks but that the allocator refuses (torch's CPU message) is an
    InvalidInputError naming the size; other RuntimeErrors pass through unchanged."""

    def oom(*_a, **_k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 256 bytes.")

    monkeypatch.setattr(torch, "zeros", oom)
    with pytest.raises(
        lz.InvalidInputError,
        match=r"cache size: expected what the cpu device can allocate now, got "
        r"512 bytes = 2 \* 2 blocks \* 4 tokens \* 1 heads \* 8 \* 4 bytes",
    ):
        _alloc()

    def other(*_a, **_k):
        raise RuntimeError("something else")

    monkeypatch.setattr(torch, "zeros", other)
    with pytest.raises(RuntimeError, match="something else"):
        _alloc()


def test_allocate_kv_cache_on_meta_and_int_sizes():
    cache = _alloc(device="meta", layout="HND")
    assert cache.device.type == "meta" and tuple(cache.shape) == (2, 2, 1, 4, 8)


# ------------------------------------------------------------------------------------ keys, contexts, routing
def test_key_buckets_and_context_fields():
    a = _decode_args(block_tables=torch.tensor([[2, 0, 1], [1, 0, 0]], dtype=I32))
    key, _ = paged.prepare(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"])
    ctx = paged.context(key)
    assert (ctx.batch, ctx.seq_len_q, ctx.seq_len_kv, ctx.page_size, ctx.kv_layout) == (2, 1, 16, 4, "NHD")
    assert ctx.phase.value == "decode" and ctx.gqa_ratio == 2 and ctx.is_causal
    f = ctx.fields()
    assert f["kv_layout"] == "NHD" and f["page_size"] == 4 and f["op"] == "paged_attention"
    b = _append_args(
        q=torch.randn(3, 4, 8),
        seq_lens=torch.tensor([5, 1], dtype=I32),
        block_tables=torch.tensor([[2, 0], [1, -1]], dtype=I32),
        cu_seqlens_q=torch.tensor([0, 2, 3], dtype=I32),
    )
    key2, _ = paged.prepare(
        b["q"], b["kv_cache"], b["block_tables"], b["seq_lens"], cu_seqlens_q=b["cu_seqlens_q"]
    )
    ctx2 = paged.context(key2)
    assert ctx2.seq_len_q == 4 and ctx2.phase.value == "prefill"
    assert key2 != key


def test_same_bucket_same_key_other_page_size_other_key():
    def key(n, page):
        q = torch.randn(n, 4, 8)
        bt = torch.zeros(n, 2, dtype=I32)
        return paged.prepare(q, torch.zeros(1, 2, page, 2, 8), bt, torch.ones(n, dtype=I32))[0]

    assert key(5, 4) == key(7, 4) != key(9, 4)
    assert key(5, 4) != key(5, 8)


def test_cache_key_and_context():
    a = _cache_args()
    key, args = paged.prepare_cache(a["k"], a["v"], a["kv_cache"], a["slot_mapping"], "NHD")
    ctx = paged.context_cache(key)
    assert (ctx.op, ctx.batch, ctx.num_heads_kv, ctx.head_dim, ctx.page_size, ctx.kv_layout) == (
        "reshape_and_cache",
        4,
        2,
        8,
        4,
        "NHD",
    )
    assert args[-1] is KVLayout.NHD


def test_selection_prefers_sdpa_and_policy_can_match_kv_layout(tmp_path):
    a = _decode_args()
    args = (a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"])
    assert lz.which("paged_attention", *args) == "torch_sdpa.paged_attention"
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\ndeny:\n  - kernels: [torch_sdpa.paged_attention]\n"
        '    when: {kv_layout: NHD, page_size: "<=4"}\n'
    )
    lz.load_config(path)
    assert lz.which("paged_attention", *args) == "reference.paged_attention"
    hnd = (a["q"], torch.zeros(3, 2, 2, 4, 8), a["block_tables"], a["seq_lens"])
    assert lz.which("paged_attention", *hnd, kv_layout="HND") == "torch_sdpa.paged_attention"
    c = _cache_args()
    assert lz.which("reshape_and_cache", c["k"], c["v"], c["kv_cache"], c["slot_mapping"]) == (
        "torch_native.reshape_and_cache"
    )


def test_graph_capture_routing():
    """During CUDA graph capture no paged_attention kernel is eligible (both read index values on the host),
    while the vectorized reshape_and_cache (no host sync) still is."""
    a = _decode_args()
    ctx = paged.context(paged.prepare(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"])[0])
    with pytest.raises(lz.NoKernelFoundError, match="CUDA_GRAPH_UNSAFE|graph"):
        RUNTIME.select_context(replace(ctx, graph_capture=True))
    c = _cache_args()
    cctx = paged.context_cache(paged.prepare_cache(c["k"], c["v"], c["kv_cache"], c["slot_mapping"])[0])
    plan, report = RUNTIME.select_context(replace(cctx, graph_capture=True))
    assert plan.kernel_id == "torch_native.reshape_and_cache"
    assert [r.code.value for r in report.candidate("reference.reshape_and_cache").reasons] == [
        "CUDA_GRAPH_UNSAFE"
    ]


def test_value_checks_run_on_cpu_always_and_elsewhere_only_in_strict_mode():
    meta = torch.empty(3, dtype=I32, device="meta")
    assert check_values(torch.zeros(3, dtype=I32)) is True
    assert check_values(meta) is False
    lz.configure(strict=True)
    assert check_values(meta) is True


def test_unused_block_table_entries_are_not_checked():
    """Entries past ceil(seq_len / block_size) may hold anything (padding), as in vLLM."""
    a = _decode_args(block_tables=torch.tensor([[2, 0], [1, 99]], dtype=I32))
    assert _call(a).shape == (2, 4, 8)


# ------------------------------------------------------------------------------------------ core.kv_layout
def test_kv_layout_lives_in_core_and_is_re_exported():
    from layerzero.core import kv_layout

    assert KVLayout is kv_layout.KVLayout is lz.ops.KVLayout
    assert kv_layout.KV_LAYOUTS == {"NHD", "HND"} and KVLayout.HND == "HND"
    assert KVLayout.NHD.shape == "[num_blocks, 2, block_size, Hkv, D]"


@pytest.mark.parametrize("layout", ["NHD", "HND", KVLayout.NHD, KVLayout.HND])
def test_cache_dims_and_nhd_view_by_hand(layout):
    """N=3 blocks, P=4 tokens, Hkv=2, D=5: the dims come back in (N, P, Hkv, D) order for either layout, and
    nhd_view indexes [block, kv, pos, head, :] as the layout's definition says, as a view."""
    from layerzero.core.kv_layout import cache_dims, cache_shape, nhd_view

    hnd = layout == "HND"
    cache = torch.zeros(cache_shape(3, 4, 2, 5, layout))
    assert tuple(cache.shape) == ((3, 2, 2, 4, 5) if hnd else (3, 2, 4, 2, 5))
    assert cache_dims(cache, layout) == (3, 4, 2, 5)
    view = nhd_view(cache, layout)
    assert tuple(view.shape) == (3, 2, 4, 2, 5) and view.data_ptr() == cache.data_ptr()
    view[2, 1, 3, 0] = 7.0  # block 2, V, position 3, head 0
    written = cache[2, 1, 0, 3] if hnd else cache[2, 1, 3, 0]  # HND: [.., Hkv, P, D]; NHD: [.., P, Hkv, D]
    assert written.tolist() == [7.0] * 5 and cache.sum().item() == 35.0


def test_kv_layout_helpers_reject_unknown_layouts():
    from layerzero.core.kv_layout import cache_dims, nhd_view, parse_kv_layout

    for fn in (
        lambda: parse_kv_layout("nhd"),
        lambda: cache_dims(torch.zeros(1, 2, 1, 1, 1), "BHSD"),
        lambda: nhd_view(torch.zeros(1, 2, 1, 1, 1), None),
    ):
        with pytest.raises(
            lz.InvalidInputError,
            match=r"kv_layout: expected 'NHD' \(\[num_blocks, 2, block_size, "
            r"Hkv, D\]\) or 'HND'",
        ):
            fn()


# --------------------------------------------------------------------------------------- key: stride, capture
def test_keys_are_named_and_end_with_capture_then_scope():
    """Both paged keys are NamedTuples whose capture flag is second to last and scope token last, so
    core.dispatch.capture_key flips only the flag (the graph recipe prepares the capture-time choice)."""
    from layerzero.core.dispatch import capture_key

    a, c = _decode_args(), _cache_args()
    keys = [
        (paged.prepare(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"])[0], paged.context),
        (paged.prepare_cache(c["k"], c["v"], c["kv_cache"], c["slot_mapping"])[0], paged.context_cache),
    ]
    for key, build in keys:
        assert key._fields[-2:] == ("capture", "scope") and key.stride_last_1 is True
        cap = capture_key(key)
        assert cap is not None and cap.capture is True and cap._replace(capture=False) == key
        assert build(cap).graph_capture and not build(key).graph_capture


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a view whose last dim has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _oracle(q, cache, table, lens):
    """float64 decode attention, NHD cache read token by token: query head h uses KV head h // (Hq / Hkv)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.shape[3]
    for s, n in enumerate(lens.tolist()):
        k = torch.stack([cache[int(table[s, t // 4]), 0, t % 4] for t in range(n)]).double()  # [n, Hkv, D]
        v = torch.stack([cache[int(table[s, t // 4]), 1, t % 4] for t in range(n)]).double()
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // group] @ q[s, h].double() / 8**0.5, 0)
            out[s, h] = w @ v[:, h // group]
    return out


@pytest.mark.parametrize("which", ["q", "kv_cache", "block_tables", "seq_lens"])
def test_stride_fact_reaches_the_key_and_filters_triton_paged_decode(monkeypatch, which):
    """An input whose last dim is not stride-1 gives a key with stride_last_1=False: on a (fake) CUDA device
    triton.paged_decode (requires_stride_last_1; it indexes every last dim with a unit stride) is filtered out
    with STRIDE_LAST_DIM_NOT_1 and nothing else, while contiguous inputs leave it eligible; on CPU the call
    still matches a float64 oracle."""
    from layerzero.core.reasons import ReasonCode
    from layerzero.testing.devices import fake_cuda_device

    gen = torch.Generator().manual_seed(7)
    a = _decode_args(
        q=torch.randn(2, 4, 8, generator=gen), kv_cache=torch.randn(3, 2, 4, 2, 8, generator=gen)
    )
    names = ("q", "kv_cache", "block_tables", "seq_lens")
    strided = dict(a, **{which: _strided(a[which])})
    assert strided[which].stride(-1) == 2 and torch.equal(strided[which], a[which])
    key = paged.prepare(*(strided[n] for n in names))[0]
    assert key.stride_last_1 is False and paged.context(key).stride_last_1 is False
    assert paged.prepare(*(a[n] for n in names))[0].stride_last_1 is True

    out = lz.paged_attention(*(strided[n] for n in names))
    torch.testing.assert_close(out.double(), _oracle(*(a[n] for n in names)), rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(paged, "device_spec", lambda _device: fake_cuda_device((9, 0), sms=132))
    report = lz.explain("paged_attention", *(strided[n] for n in names))
    codes = [r.code for r in report.candidate("triton.paged_decode").reasons]
    assert codes == [ReasonCode.STRIDE_LAST_DIM_NOT_1]
    assert report.chosen != "triton.paged_decode"
    contiguous = lz.explain("paged_attention", *(a[n] for n in names))
    assert not contiguous.candidate("triton.paged_decode").reasons
    assert contiguous.chosen == "triton.paged_decode"  # highest priority among the eligible CUDA kernels here


def test_strict_value_checks_skip_while_a_cuda_graph_captures(monkeypatch):
    """Strict mode reads GPU index values (a sync); during CUDA-graph capture a sync is illegal and would
    invalidate the capture (seen on an H200: the engine's strict graph capture failed), so the value check is
    skipped there and only there."""
    from types import SimpleNamespace

    gpu_index = SimpleNamespace(device=torch.device("cuda"))  # check_values reads only .device
    lz.configure(strict=True)
    try:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        assert check_values(gpu_index)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert not check_values(gpu_index)
        assert check_values(torch.zeros(1))  # CPU values are always checked
    finally:
        lz.configure(strict=False)
    assert not check_values(gpu_index)


# ------------------------------------------------------------------------------ the exact (hot) key of a call
def _meta(**over):
    """Valid decode inputs on the meta device (not CPU: the hot path's domain), as _decode_args."""
    args = {k: v.to("meta") for k, v in _decode_args().items()}
    args.update(over)
    return args


def _hk(a, cu=None, scale=None, is_causal=True, kv_layout="NHD"):
    return paged._hot_key(
        a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"], cu, scale, is_causal, kv_layout
    )


def test_hot_key_holds_every_checked_fact():
    """Two calls with the same facts share the exact key; changing any fact prepare() checks or the cache key
    holds changes it (so a hit can never skip a check that would fail)."""
    a = _meta()
    base = _hk(a)
    assert base is not None and base == _hk(_meta())
    assert _hk(a, kv_layout=KVLayout.NHD) == base  # "NHD" and KVLayout.NHD are one layout
    variants = [
        _hk(_meta(seq_lens=torch.zeros(3, dtype=I32, device="meta"))),  # batch disagrees with block_tables
        _hk(_meta(seq_lens=torch.zeros(2, dtype=torch.int64, device="meta"))),
        _hk(_meta(block_tables=torch.zeros(2, 5, dtype=I32, device="meta"))),
        _hk(
            _meta(q=torch.zeros(2, 4, 8, dtype=torch.float16, device="meta"))
        ),  # dtype differs from the cache
        _hk(_meta(q=torch.zeros(2, 6, 8, device="meta"))),  # heads
        _hk(_meta(kv_cache=torch.zeros(3, 2, 2, 4, 8, device="meta"))),  # HND-looking shape
        _hk(
            _meta(
                q=torch.zeros(2, 8, 4, device="meta")[:, :4, :].transpose(1, 2).contiguous().transpose(1, 2)
            )
        ),
        _hk(a, cu=torch.zeros(3, dtype=I32, device="meta")),
        _hk(a, scale=0.5),
        _hk(a, is_causal=False),
        _hk(a, kv_layout="HND"),
    ]
    for v in variants:
        assert v != base
    strided = _meta(q=torch.zeros(2, 8, 4, device="meta").transpose(1, 2))  # last stride 4, not 1
    assert _hk(strided) != _hk(_meta(q=torch.zeros(2, 4, 8, device="meta")))


@pytest.mark.parametrize(
    "change", ["cpu", "strict", "list_layout", "int_scale", "causal_1", "list_lens", "mixed"]
)
def test_hot_key_is_none_where_every_call_needs_the_full_checks(change):
    a, kw = _meta(), {}  # each change alone turns the key off
    if change == "cpu":
        a = _decode_args()  # index values are read on every CPU call
    elif change == "strict":
        lz.configure(strict=True)
    elif change == "list_layout":
        kw["kv_layout"] = ["NHD"]  # unhashable: no TypeError, just no hot key
    elif change == "int_scale":
        kw["scale"] = 1
    elif change == "causal_1":
        kw["is_causal"] = 1
    elif change == "list_lens":
        a["seq_lens"] = [5, 1]  # not a tensor
    elif change == "mixed":
        a["seq_lens"] = torch.tensor([5, 1], dtype=I32)  # CPU index tensor with meta q
    try:
        assert _hk(a, **kw) is None
    finally:
        lz.configure(strict=False)


def test_a_filed_hot_key_skips_the_checks_and_a_new_fact_does_not(monkeypatch):
    """Routing through Runtime.run_hot with the meta device standing in for CUDA: the first call is checked
    (prepare runs) and files the exact key; an identical call is served from it without prepare; a call with
    one fact changed is checked again."""
    calls = {"prepare": 0}
    real_prepare = paged.prepare

    def counting(*args, **kwargs):
        calls["prepare"] += 1
        return real_prepare(*args, **kwargs)

    kid = "metapaged.paged_attention"
    lz.register_kernel(
        "paged_attention",
        kid,
        lambda q, c, bt, sl, cu, s, ic, lay: torch.empty_like(q),
        priority=1000,
        device_types={"meta"},
        dtypes={torch.float32},
    )
    monkeypatch.setattr(paged, "prepare", counting)
    try:
        a = _meta()
        assert lz.paged_attention(**a).shape == (2, 4, 8) and calls["prepare"] == 1  # selected and cached
        assert (
            lz.paged_attention(**_meta()).shape == (2, 4, 8) and calls["prepare"] == 2
        )  # a cache hit files it
        for _ in range(3):
            assert lz.paged_attention(**_meta()).shape == (2, 4, 8)
        assert calls["prepare"] == 2  # hot: no checks
        lz.paged_attention(**_meta(), scale=0.25)
        assert calls["prepare"] == 3
        with pytest.raises(lz.InvalidInputError, match="seq_lens shape"):
            lz.paged_attention(**_meta(seq_lens=torch.zeros(3, dtype=I32, device="meta")))
    finally:
        lz.unregister_kernel(kid)


def test_non_causal_rows_may_outnumber_the_keys():
    """A cascade's shared-prefix call (``is_causal=False``) attends every new token of a group to the prefix:
    20 query tokens over 8 keys is valid there (the capacity check is causal-only), and equals softmax over
    the prefix in float64, worked directly. Found on the H200, where the engine's warm-up ran such a step."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(20, 4, 8, generator=g)
    kv_cache = torch.randn(3, 2, 4, 2, 8, generator=g)  # NHD: [blocks, k/v, block_size 4, Hkv 2, D 8]
    tables = torch.tensor([[2, 0]], dtype=I32)
    out = lz.paged_attention(
        q,
        kv_cache,
        tables,
        torch.tensor([8], dtype=I32),
        cu_seqlens_q=torch.tensor([0, 20], dtype=I32),
        is_causal=False,
    )
    keys = kv_cache[[2, 0], 0].reshape(8, 2, 8).double().repeat_interleave(2, dim=1)  # GQA: 4 heads over 2
    vals = kv_cache[[2, 0], 1].reshape(8, 2, 8).double().repeat_interleave(2, dim=1)
    probs = torch.einsum("thd,khd->htk", q.double(), keys).mul(8**-0.5).softmax(-1)
    want = torch.einsum("htk,khd->thd", probs, vals)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(lz.InvalidInputError, match=r"num_tokens: expected <= batch \* max_blocks"):
        lz.paged_attention(
            q, kv_cache, tables, torch.tensor([8], dtype=I32), cu_seqlens_q=torch.tensor([0, 20], dtype=I32)
        )
