"""The ``one_pass`` knob (``PagedDecodeKnobs``) under Triton's interpreter on CPU: at batch 1 in a table of at
most ``small_batch``'s width, a split of ``triton.paged_decode`` / ``triton.rope_paged_decode`` gathers its 1,
2 or 4 tiles at once (block ids read below the table's width, K / V below the sequence's length) instead of
looping over them; with ``early_kv`` (off by default) every position but the newest before the PDL wait, the
newest after it (here there is no wait: the same values in another order). Checked against the float64 oracles
of ``test_triton_paged_interpret`` / ``test_triton_rope_paged_interpret`` (unused pages and slots NaN, garbage
ids past the used ones), bit for bit against the tile loop it replaces, and the plans a 132-SM and a 58-SM GPU
make. Compiled on a GPU by tests/gpu/test_gpu_paged_one_pass.py."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first @triton.jit of the session (kernels load lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _triton_interp import needs_interpreter  # noqa: E402
from test_triton_paged_interpret import close, make_case, oracle  # noqa: E402
from test_triton_rope_paged_interpret import TOL as ROPE_TOL  # noqa: E402
from test_triton_rope_paged_interpret import case as rope_case  # noqa: E402
from test_triton_rope_paged_interpret import oracle as rope_oracle  # noqa: E402
from test_triton_rope_paged_interpret import run as rope_run  # noqa: E402

from layerzero.backends.triton import _paged_launch as tpl  # noqa: E402
from layerzero.backends.triton import paged as tp  # noqa: E402
from layerzero.backends.triton import rope_paged as trp  # noqa: E402
from layerzero.core.knobs import knobs  # noqa: E402
from layerzero.core.kv_quant import dequantize_kv, quantize_kv  # noqa: E402

pytestmark = [pytest.mark.correctness, needs_interpreter("tests/gpu/test_gpu_paged_one_pass.py")]


@pytest.fixture
def paged_knobs():
    """``paged_knobs(field=value, ...)``: set ``triton.paged_decode`` knobs until the test ends (each change
    drops the cached plans)."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(knobs(tp.KNOBS, **fields))


def spy(monkeypatch, paged_knobs) -> list[dict]:
    """The constexprs of every split-kernel launch from now on (plans made afresh: the knobs are read by
    them). Splits of up to four tiles take the one pass here (``one_pass_max_tiles`` 4: the kernel's every
    form), with ``early_kv`` on."""
    monkeypatch.setattr(tpl, "_PLANS", {})
    # early_kv (off by default): the newest position read apart, tested here
    paged_knobs(one_pass_max_tiles=4, early_kv=True)
    seen: list[dict] = []
    real = tpl.launch_pinned
    monkeypatch.setattr(
        tpl,
        "launch_pinned",
        lambda fn, pin, grid, *a, **k: (
            seen.append(k) if fn.__name__ == "paged_decode_split" else None,
            real(fn, pin, grid, *a, **k),
        ),
    )
    return seen


# (seed, page, lens, forced splits -> tiles a split gathers, dtype): a 1024-token table (64 pages of 16, 205
# of 5)
CASES = [
    (0, 16, [1], 32, torch.float32),  # one tile a split, most splits empty
    (1, 16, [33], 16, torch.float32),  # two a split, tile 1 (split 1's first) holds one position: the newest
    (2, 16, [700], 16, torch.bfloat16),
    (3, 16, [1024], 8, torch.float32),  # four a split, the table full
    (4, 16, [290], 8, torch.float16),
    (5, 5, [517], 16, torch.float32),  # a page size that is not a power of two (table 1025 tokens)
]


@pytest.mark.parametrize(
    ("seed", "page", "lens", "splits", "dtype"), CASES, ids=lambda x: str(x).replace("torch.", "")
)
def test_one_pass_matches_the_oracle_and_the_tile_loop_bit_for_bit(
    monkeypatch, paged_knobs, seed, page, lens, splits, dtype
):
    seen = spy(monkeypatch, paged_knobs)
    spare = -(-1024 // page) - -(-lens[0] // page)  # table columns past the used blocks: garbage ids
    q, cache, table, lens_t = make_case(
        seed, layout="NHD", page=page, ratio=2, hkv=2, d=16, lens=lens, dtype=dtype, spare_cols=spare
    )
    assert table.shape[1] * page >= 1024 and tp.small_batch(1, table.shape[1] * page, 16, q.element_size())
    got = tp.paged_decode(q, cache, table, lens_t, num_splits=splits)
    tiles = -(-table.shape[1] * page // 32)
    per_split = -(-tiles // splits)  # tiles of the table a split has at most
    chunks = (
        1 << (per_split - 1).bit_length()
    )  # gathered as 1, 2 or 4 (page 5: 33 tiles, 3 a split, 4 gathered)
    assert (
        seen[-1]["ONE_PASS"]
        and seen[-1]["EARLY"]
        and seen[-1]["CHUNKS"] == chunks
        and seen[-1]["BLOCK_N"] == 32
    )
    close(got, oracle(q, cache, table, lens_t, "NHD"), dtype)
    paged_knobs(
        early_kv=False
    )  # every load after the (here absent) PDL wait: the same tiles (plans made afresh)
    late = tp.paged_decode(q, cache, table, lens_t, num_splits=splits)
    assert seen[-1]["ONE_PASS"] and not seen[-1]["EARLY"] and torch.equal(got, late)
    paged_knobs(one_pass=False)
    loop = tp.paged_decode(q, cache, table, lens_t, num_splits=splits)
    assert (
        not seen[-1]["ONE_PASS"] and not seen[-1]["EARLY"] and torch.equal(got, loop)
    )  # same tiles, same order


def test_plan_on_a_132_sm_gpu(monkeypatch, paged_knobs):
    """On an H100 / H200 (132 SMs) a batch-1 call with a 2048-token table runs 32 splits of two tiles in one
    pass; a second sequence, a wider table, a forced ``block_n``, splits of three tiles (58 SMs: more than
    ``one_pass_max_tiles``) or ``one_pass`` off take the tile loop."""
    monkeypatch.setattr(tpl, "sm_count", lambda device: 132)
    monkeypatch.setattr(tpl, "_PLANS", {})
    kern = tp._KERNELS.get()

    def plan(batch: int, width: int, **kw):
        q = torch.zeros(batch, 16, 128)
        cache = torch.zeros(4, 2, 16, 8, 128)
        return tp._plan(
            kern,
            q,
            cache,
            torch.zeros(batch, width // 16, dtype=torch.int32),
            torch.ones(batch, dtype=torch.int32),
            "NHD",
            False,
            None,
            kw.get("block_n"),
            None,
            None,
        )

    p = plan(1, 2048)
    assert p.grid == (1, 8, 32) and p.split_kw["ONE_PASS"] and p.split_kw["CHUNKS"] == 2
    assert p.split_ints[11] == 2048  # table_len: the block ids a split reads
    # the merge lets the next kernel launch before its own wait; K / V read before the wait only with early_kv
    assert p.merge_kw["TRIGGER_FIRST"] and not p.split_kw["TRIGGER_FIRST"] and not p.split_kw["EARLY"]
    paged_knobs(early_kv=True)
    assert plan(1, 2048).split_kw["EARLY"]
    two = plan(2, 2048)
    assert not (two.split_kw["ONE_PASS"] or two.split_kw["EARLY"] or two.merge_kw["TRIGGER_FIRST"])
    assert not plan(2, 2048).split_kw["ONE_PASS"] and not plan(1, 4096).split_kw["ONE_PASS"]
    assert not plan(1, 2048, block_n=32).split_kw["ONE_PASS"]
    monkeypatch.setattr(
        tpl, "sm_count", lambda device: 58
    )  # an L4: 22 splits of three tiles, not measured: the loop
    assert plan(1, 2048).grid == (1, 8, 22) and not plan(1, 2048).split_kw["ONE_PASS"]
    monkeypatch.setattr(tpl, "sm_count", lambda device: 132)
    paged_knobs(one_pass=False)
    assert not plan(1, 2048).split_kw["ONE_PASS"]


@pytest.mark.parametrize(
    ("seed", "dtype", "splits", "skip"),
    [
        (0, torch.float32, 16, False),
        (1, torch.bfloat16, 8, False),
        (2, torch.float32, 4, True),
        (3, torch.float16, 8, False),
    ],
)
def test_rope_paged_one_pass_matches_the_oracle(monkeypatch, paged_knobs, seed, dtype, splits, skip):
    """``triton.rope_paged_decode`` in one pass (a 512-token table: 16 / 8 / 4 splits gather 1 / 2 / 4 tiles):
    the new token from registers, its position masked out of the gathered tiles; a -1 slot (``skip``) reads it
    from the cache."""
    seen: list[dict] = []
    paged_knobs(one_pass_max_tiles=4)
    monkeypatch.setattr(
        trp, "_PLANS", {}
    )  # rope_paged's plans hold paged_decode's: made afresh under the knobs
    monkeypatch.setattr(trp, "launch_pinned", _rope_spy(seen, trp.launch_pinned))
    args = rope_case(seed, dtype, 1, 4, 2, 32, 16, "NHD", True, False, skip=skip, width=32)
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    want, want_cache = rope_oracle(
        q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens, 32**-0.5, 1e-6, False, "NHD"
    )
    got = rope_run(args, False, "NHD", splits)
    assert seen and seen[-1]["ONE_PASS"] and seen[-1]["CHUNKS"] == 16 // splits
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= ROPE_TOL[dtype], err
    diff = (cache.double() - want_cache.double()).abs().max().item()
    assert diff <= ROPE_TOL[dtype] * 4 * want_cache.double().abs().max().item(), diff


LAUNCH_OPTIONS = {"num_warps", "num_stages", "launch_pdl"}


def _rope_spy(seen: list[dict], real):
    """``rope_paged``'s ``launch_pinned`` (imported there by name) recording the fused kernel's constexprs,
    which must all be its parameters (the interpreter ignores unknown keywords; a compiled launch raises
    ``KeyError``: the plan is derived from ``triton.paged_decode``'s, whose own flags must be dropped)."""

    def spy(fn, pin, grid, *a, **k):
        if fn.__name__ == "rope_paged_decode_split":
            unknown = set(k) - set(fn.arg_names) - LAUNCH_OPTIONS
            assert not unknown, f"not parameters of {fn.__name__}: {sorted(unknown)}"
            seen.append(k)
        return real(fn, pin, grid, *a, **k)

    return spy


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_one_pass_over_a_quantized_cache_equals_the_loop(monkeypatch, paged_knobs, qdtype):
    """fp8 / int8 codes (one scale by value, one on the device) in one pass: the loop's bits, the dequantized
    float64 oracle within float32's tolerance (a 1024-token table, 8 splits of 4 tiles, 16 of 2)."""
    seen = spy(monkeypatch, paged_knobs)
    q, cache, table, lens = make_case(
        9, layout="HND", page=16, ratio=4, hkv=1, d=32, lens=[611], spare_cols=25
    )
    ks, vs = 0.03, torch.tensor(0.021)
    codes = (
        quantize_kv(torch.nan_to_num(cache[:, 0:1]), ks, qdtype),
        quantize_kv(torch.nan_to_num(cache[:, 1:2]), vs, qdtype),
    )
    qcache = torch.cat(codes, dim=1)
    deq = torch.cat(
        (dequantize_kv(codes[0], ks, torch.float64), dequantize_kv(codes[1], vs, torch.float64)), dim=1
    )
    want = oracle(q, deq, table, lens, "HND")
    for splits in (8, 16):
        got = tp.paged_decode(q, qcache, table, lens, None, "HND", num_splits=splits, k_scale=ks, v_scale=vs)
        assert seen[-1]["ONE_PASS"] and seen[-1]["QUANT"] and seen[-1]["CHUNKS"] == 32 // splits
        close(got, want, torch.float32)
        with knobs(tp.KNOBS, one_pass=False):  # plans made afresh on entry and on exit
            loop = tp.paged_decode(
                q, qcache, table, lens, None, "HND", num_splits=splits, k_scale=ks, v_scale=vs
            )
        assert not seen[-1]["ONE_PASS"] and torch.equal(got, loop)
