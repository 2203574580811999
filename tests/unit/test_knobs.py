"""Tuning knobs (``layerzero.core.knobs``): frozen, typed dataclasses registered per kernel module, and the
engine's ``CudaGraphKnobs``. Defaults against a hand-written table (today's measured choices), unknown fields
and wrong types refused with the names in the message, the ``knobs(...)`` block restored also when it raises,
the generation counter, frozen instances, plan caches dropped on a change, the loader hook, and a knob
changing a decision: the paged-decode split geometry, the GEMV kernel choice, the sampler's split, the cascade
prefill's tiles and splits, the RoPE heads a program, the quantized GEMM's kernel and int4 configs, the ALiBi
attention's split count, the autotuner's timing, the fused RoPE + paged decode's forced splits, the PDL
choice, the RMSNorm and SwiGLU tiles, the chunked linear cross-entropy's chunks and the attention tiles'
shared memory budget, all on CPU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from layerzero.backends.torch_native import linear_ce
from layerzero.backends.triton import (
    _launch,
    attention,
    cascade,
    gemv,
    norms,
    paged,
    rope,
    rope_paged,
    sampling,
    swiglu,
)
from layerzero.backends.triton import quantized_linear as qlin
from layerzero.core import knobs as kb
from layerzero.core.errors import ConfigurationError
from layerzero.engine.config import CudaGraphKnobs, EngineConfig
from layerzero.tuning import autotune

pytestmark = pytest.mark.unit

DEFAULTS = {
    paged.PagedDecodeKnobs: dict(
        max_splits=32,
        min_tiles_per_split=2,
        waves=4,
        tile_bytes=32768,
        block_n_max=128,
        small_batch=(1, 2048, 32, 32),
        one_pass=True,
        one_pass_max_tiles=2,
        early_kv=False,
        trigger_first=("merge",),
        split_warps=4,
        merge_warps=4,
        fused_merge="auto",
        fused_merge_max_bytes=32 * 1024 * 1024,
        fused_merge_in_graphs=False,
    ),
    gemv.GemvKnobs: dict(
        max_rows=8,
        prefetch=True,
        prefetch_max_k=4096,
        prefetch_slab=8192,
        prefetch_warps=2,
        prefetch_long_k=(16384, 8),
        prefetch_wide=None,
        prefetch_by_shape=(),
        trigger_first_rows=1,
    ),
    sampling.SamplingKnobs: dict(
        block=1024,
        race_block=4096,
        split_programs=1056,
        split_block=2048,
        greedy_block=2048,
        greedy_programs_per_sm=2,
        greedy_sms_off_gpu=132,
    ),
    cascade.CascadeKnobs: dict(
        rows=64,
        rows_few=16,
        max_splits=16,
        workspace_bytes=32 * 1024 * 1024,
        min_split_tiles=1,
        programs_per_sm=4,
        launch=(4, 2),
        launch_few=(2, 3),
        seq_pad_min=256,
    ),
    rope.RopeKnobs: dict(block_h_max=4),
    qlin.QuantizedLinearKnobs: dict(
        rows_max=8,
        int4_decode=True,
        int4_rows_max=8,
        int4_chunk_k=4096,
        int4_configs=((1024, 8192, 2), (2048, 8192, 2), (4096, 12288, 2)),
        int4_loop_config=(8192, 4),
        int4_by_shape=(),
        int4_bn_max=16,
        int4_measured_faster=True,
    ),
    attention.AttentionKnobs: dict(
        max_splits=16, min_split_tiles=4, workspace_bytes=32 * 1024 * 1024, smem_use=0.85
    ),
    autotune.AutotuneKnobs: dict(warmup=2, iters=3, repeats=5, max_time_s=0.003, rounds=3),
    rope_paged.RopePagedKnobs: dict(num_splits=None),
    _launch.LaunchKnobs: dict(pdl=True, pdl_max_rows=16),
    norms.NormKnobs: dict(one_pass_max=8192, tile=4096),
    swiglu.SwigluKnobs: dict(block=1024),
    linear_ce.LinearCEKnobs: dict(chunk_elements=4 * 1024 * 1024),
    CudaGraphKnobs: dict(
        packed_inputs=True,
        greedy_in_graph=True,
        h2d_aside=True,
        d2h_aside=True,
        lanes=2,
        lane_max_batch=8,
        narrow_tokens=2048,
        pack_max_bytes=64 * 1024,
        piecewise_max_tokens=None,
    ),
}
"""Every knob's default, written out by hand (the values the module globals had before issue 36)."""
NAMES = {
    paged.KNOBS: paged.PagedDecodeKnobs,
    gemv.KNOBS: gemv.GemvKnobs,
    sampling.KNOBS: sampling.SamplingKnobs,
    cascade.KNOBS: cascade.CascadeKnobs,
    rope.KNOBS: rope.RopeKnobs,
    qlin.KNOBS: qlin.QuantizedLinearKnobs,
    attention.KNOBS: attention.AttentionKnobs,
    autotune.KNOBS: autotune.AutotuneKnobs,
    rope_paged.KNOBS: rope_paged.RopePagedKnobs,
    _launch.KNOBS: _launch.LaunchKnobs,
    norms.KNOBS: norms.NormKnobs,
    swiglu.KNOBS: swiglu.SwigluKnobs,
    linear_ce.KNOBS: linear_ce.LinearCEKnobs,
}


@pytest.mark.parametrize("cls", list(DEFAULTS), ids=lambda c: c.__name__)
def test_defaults_are_the_documented_values(cls):
    assert dataclasses.asdict(cls()) == DEFAULTS[cls]
    assert _documented_fields(cls) == [f.name for f in dataclasses.fields(cls)]  # each with its docstring


def _documented_fields(cls) -> list[str]:
    """The fields of ``cls``'s body that a string literal (the field's docstring) follows."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return [
        node.target.id
        for node, after in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    ]


def test_registered_under_their_names_with_the_defaults():
    assert set(NAMES) <= set(kb.registered())
    for name, cls in NAMES.items():
        assert type(kb.get(name)) is cls and kb.get(name) == cls() and kb.default_knobs(name) == cls()
    assert EngineConfig("m").cuda_graph == CudaGraphKnobs()


@pytest.mark.parametrize("cls", list(DEFAULTS), ids=lambda c: c.__name__)
def test_frozen(cls):
    k = cls()
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(k, field, getattr(k, field))
    with pytest.raises((AttributeError, TypeError)):  # slots: no new attributes either
        k.not_a_field = 1
    hash(k)  # usable as a cache key


def test_unknown_field_names_the_known_ones_and_changes_nothing():
    before, gen = kb.get(paged.KNOBS), kb.knobs_generation()
    with pytest.raises(
        ConfigurationError,
        match=r"unknown field\(s\) \['max_split'\].*Did you mean 'max_splits'\?"
        r".*Known: \[.*'fused_merge'.*'waves'\]",
    ):
        kb.configure_knobs(paged.KNOBS, max_split=8)
    with pytest.raises(ConfigurationError, match="unknown field"):
        with kb.knobs(gemv.KNOBS, prefetch=False, warps=2):
            pass
    assert kb.get(paged.KNOBS) is before and kb.get(gemv.KNOBS) == gemv.GemvKnobs()
    assert kb.knobs_generation() == gen


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        (paged.KNOBS, dict(max_splits="8"), r"PagedDecodeKnobs\.max_splits: expected int, got '8' \(str\)"),
        (paged.KNOBS, dict(one_pass=1), r"PagedDecodeKnobs\.one_pass: expected bool, got 1 \(int\)"),
        (paged.KNOBS, dict(max_splits=True), r"max_splits: expected int, got True \(bool\)"),
        (paged.KNOBS, dict(fused_merge="yes"), r"fused_merge: expected bool \| 'auto', got 'yes'"),
        (
            paged.KNOBS,
            dict(small_batch=[1, 2048, 32, 32]),
            r"small_batch: expected tuple\[int, int, int, int\] \| None",
        ),
        (paged.KNOBS, dict(small_batch=(1, 2048, 24, 32)), r"small_batch: expected None or \(.*power of two"),
        (paged.KNOBS, dict(one_pass_max_tiles=3), r"one_pass_max_tiles: expected 1, 2 or 4, got 3"),
        (
            paged.KNOBS,
            dict(trigger_first=("splits",)),
            r"trigger_first: expected a tuple of 'split' and / or 'merge'",
        ),
        (paged.KNOBS, dict(split_warps=3), r"split_warps: expected a power of two in \[1, 32\], got 3"),
        (
            gemv.KNOBS,
            dict(prefetch_by_shape={(1024, 3072): (8192, 4)}),
            r"prefetch_by_shape: expected tuple\[",
        ),
        (gemv.KNOBS, dict(prefetch_wide=(4096, 3)), r"prefetch_wide: expected \(slab elements >= 1, warps"),
        (
            gemv.KNOBS,
            dict(max_rows=0),
            r"GemvKnobs\.max_rows: expected an int >= 1, got 0\. The default is 8",
        ),
        (sampling.KNOBS, dict(split_block=1000), r"SamplingKnobs\.split_block: expected a power of two"),
        (sampling.KNOBS, dict(split_programs=2.0), r"split_programs: expected int, got 2\.0 \(float\)"),
        (cascade.KNOBS, dict(rows_few=24), r"CascadeKnobs\.rows_few: expected a power of two >= 1, got 24"),
        (cascade.KNOBS, dict(seq_pad_min=4096), r"seq_pad_min: expected at most MAX_SEQS \(2048\)"),
        (cascade.KNOBS, dict(launch_few=(3, 3)), r"launch_few: expected \(num_warps a power of two"),
        (cascade.KNOBS, dict(launch={16: (2, 3)}), r"launch: expected tuple\[int, int\], got \{16"),
        (rope.KNOBS, dict(block_h_max=3), r"RopeKnobs\.block_h_max: expected a power of two >= 1, got 3"),
        (qlin.KNOBS, dict(int4_chunk_k=3000), r"int4_chunk_k: expected a power of two >= 1, got 3000"),
        (
            qlin.KNOBS,
            dict(int4_by_shape={(4096, 1024): (4096, 4)}),
            r"QuantizedLinearKnobs\.int4_by_shape: expected tuple\[",
        ),
        (
            qlin.KNOBS,
            dict(int4_configs=((1024, 8192, 3),)),
            r"int4_configs: expected \(slab codes >= 1, warps",
        ),
        (qlin.KNOBS, dict(int4_decode="no"), r"int4_decode: expected bool, got 'no' \(str\)"),
        (
            attention.KNOBS,
            dict(min_split_tiles=0),
            r"AttentionKnobs\.min_split_tiles: expected an int >= 1, got 0\. The default is 4",
        ),
        (attention.KNOBS, dict(max_splits=16.0), r"max_splits: expected int, got 16\.0 \(float\)"),
        (attention.KNOBS, dict(workspace_bytes=-1), r"workspace_bytes: expected an int >= 1, got -1"),
        (autotune.KNOBS, dict(rounds=0), r"AutotuneKnobs\.rounds: expected an int >= 1, got 0"),
        (autotune.KNOBS, dict(warmup=-1), r"warmup: expected an int >= 0, got -1"),
        (autotune.KNOBS, dict(max_time_s=0), r"max_time_s: expected a number of seconds > 0, got 0"),
        (autotune.KNOBS, dict(iters="3"), r"AutotuneKnobs\.iters: expected int, got '3' \(str\)"),
        (rope_paged.KNOBS, dict(num_splits=0), r"RopePagedKnobs\.num_splits: expected None or an int >= 1"),
        (rope_paged.KNOBS, dict(num_splits=2.0), r"num_splits: expected int \| None, got 2\.0 \(float\)"),
        (_launch.KNOBS, dict(pdl=0), r"LaunchKnobs\.pdl: expected bool, got 0 \(int\)"),
        (_launch.KNOBS, dict(pdl_max_rows=-1), r"pdl_max_rows: expected an int >= 0, got -1"),
        (
            attention.KNOBS,
            dict(smem_use=0),
            r"AttentionKnobs\.smem_use: expected a fraction in \(0, 1\], got "
            r"0",
        ),
        (attention.KNOBS, dict(smem_use=1.5), r"smem_use: expected a fraction in \(0, 1\], got 1\.5"),
        (attention.KNOBS, dict(smem_use="0.5"), r"smem_use: expected float, got '0\.5' \(str\)"),
        (norms.KNOBS, dict(tile=3000), r"NormKnobs\.tile: expected a power of two >= 1, got 3000"),
        (norms.KNOBS, dict(one_pass_max=0), r"one_pass_max: expected a power of two >= 1, got 0"),
        (norms.KNOBS, dict(one_pass_max=8192.0), r"one_pass_max: expected int, got 8192\.0 \(float\)"),
        (swiglu.KNOBS, dict(block=1000), r"SwigluKnobs\.block: expected a power of two >= 1, got 1000"),
        (swiglu.KNOBS, dict(block=True), r"block: expected int, got True \(bool\)"),
        (
            linear_ce.KNOBS,
            dict(chunk_elements=0),
            r"LinearCEKnobs\.chunk_elements: expected an int >= 1, got 0\. The default is 4194304",
        ),
        (linear_ce.KNOBS, dict(chunk_elements="4M"), r"chunk_elements: expected int, got '4M' \(str\)"),
    ],
)
def test_wrong_type_or_range_says_expected_and_got(name, fields, message):
    before = kb.get(name)
    with pytest.raises(ConfigurationError, match=message):
        kb.configure_knobs(name, **fields)
    assert kb.get(name) is before
    with pytest.raises(ConfigurationError, match=message):  # the class checks itself on construction too
        type(before)(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(lanes=0), r"CudaGraphKnobs\.lanes: expected an int >= 1, got 0\. The default is 2"),
        (dict(narrow_tokens=0), r"narrow_tokens: expected an int >= 1 or None, got 0"),
        (dict(packed_inputs="no"), r"packed_inputs: expected True or False, got 'no'"),
        (dict(pack_max_bytes=-1), r"pack_max_bytes: expected an int >= 0, got -1"),
        (
            dict(piecewise_max_tokens=-3),
            r"piecewise_max_tokens: expected an int >= 0 or None, got -3\. The default is None",
        ),
    ],
)
def test_cuda_graph_knobs_are_checked(fields, message):
    with pytest.raises(ConfigurationError, match=message):
        CudaGraphKnobs(**fields)
    assert CudaGraphKnobs(narrow_tokens=None).narrow_tokens is None
    with pytest.raises(ConfigurationError, match=r"LLM cuda_graph: expected a CudaGraphKnobs"):
        EngineConfig("m", cuda_graph={"lanes": 1})


def test_piecewise_default_from_the_environment(monkeypatch):
    """``LAYERZERO_PIECEWISE_MAX_TOKENS`` sets the default when a knob set is made (not at import), an
    explicit value wins, a non-int is refused naming the variable."""
    monkeypatch.setenv("LAYERZERO_PIECEWISE_MAX_TOKENS", "256")
    assert CudaGraphKnobs().piecewise_max_tokens == 256
    assert EngineConfig("m").cuda_graph.piecewise_max_tokens == 256
    assert CudaGraphKnobs(piecewise_max_tokens=0).piecewise_max_tokens == 0
    monkeypatch.setenv("LAYERZERO_PIECEWISE_MAX_TOKENS", "lots")
    with pytest.raises(ConfigurationError, match=r"LAYERZERO_PIECEWISE_MAX_TOKENS: expected an int >= 0"):
        CudaGraphKnobs()
    monkeypatch.delenv("LAYERZERO_PIECEWISE_MAX_TOKENS")
    assert CudaGraphKnobs().piecewise_max_tokens is None


def test_the_block_restores_on_exit_and_on_an_exception():
    default = kb.get(paged.KNOBS)
    with kb.knobs(paged.KNOBS, max_splits=8) as k:
        assert k.max_splits == 8 and kb.get(paged.KNOBS) is k and k.waves == default.waves
        with kb.knobs(paged.KNOBS, waves=2):  # nested: the outer block's value is the base
            assert (kb.get(paged.KNOBS).max_splits, kb.get(paged.KNOBS).waves) == (8, 2)
        assert kb.get(paged.KNOBS) is k
    assert kb.get(paged.KNOBS) is default
    with pytest.raises(RuntimeError, match="boom"):
        with kb.knobs(paged.KNOBS, one_pass=False):
            raise RuntimeError("boom")
    assert kb.get(paged.KNOBS) is default


def test_configure_replace_and_reset():
    try:
        new = kb.configure_knobs(gemv.KNOBS, prefetch_warps=4)
        assert new.prefetch_warps == 4 and kb.get(gemv.KNOBS) is new and new.prefetch_slab == 8192
        again = kb.configure_knobs(gemv.KNOBS, prefetch_slab=4096)  # from the current value, not the default
        assert (again.prefetch_warps, again.prefetch_slab) == (4, 4096)
        whole = dataclasses.replace(gemv.GemvKnobs(), prefetch=False)
        assert kb.replace_knobs(gemv.KNOBS, whole) is whole and kb.get(gemv.KNOBS) is whole
        with pytest.raises(
            ConfigurationError,
            match=r"knobs 'triton.gemv': expected a GemvKnobs instance, got "
            r"SamplingKnobs",
        ):
            kb.replace_knobs(gemv.KNOBS, sampling.SamplingKnobs())
    finally:
        assert kb.reset_knobs(gemv.KNOBS) == gemv.GemvKnobs()
    assert kb.get(gemv.KNOBS) == gemv.GemvKnobs()


def test_generation_bumps_on_every_change():
    gen = kb.knobs_generation()
    with kb.knobs(sampling.KNOBS, block=512):
        inside = kb.knobs_generation()
        assert inside > gen
    assert kb.knobs_generation() > inside  # the restore is a change too
    after = kb.knobs_generation()
    kb.get(sampling.KNOBS)
    assert kb.knobs_generation() == after  # reading is not


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(
        ConfigurationError,
        match=r"knobs name: expected a registered name, got 'triton.paged_decod'.*"
        r"Did you mean 'triton.paged_decode'\?.*Known: \[.*'triton.gemv'",
    ):
        kb.get("triton.paged_decod")
    with pytest.raises(ConfigurationError, match="registered name"):
        kb.configure_knobs("triton.nope", x=1)


# ---------------------------------------------------------------------------------- a knob changes a decision
def test_max_splits_changes_the_paged_decode_split_count():
    """One 32k-token sequence, 8 KV heads, head dim 128, bf16 on a 132-SM GPU: 32 splits of 1024 tokens by
    default (``waves`` x SMs / 8 heads = 66 wanted, capped at ``max_splits``), 8 with ``max_splits=8``."""
    assert paged.geometry(1, 8, 32768, 128, 2, 132) == paged.Geometry(128, 1024, 32, 1, False)
    with kb.knobs(paged.KNOBS, max_splits=8):
        assert paged.geometry(1, 8, 32768, 128, 2, 132).splits == 8
        assert paged.choose_split_len(1, 8, 32768, 132, 128) == (4096, 8)
    with kb.knobs(paged.KNOBS, waves=1):  # 132 / 8 -> 17 splits wanted: 256 tiles in splits of 16 -> 16
        assert paged.geometry(1, 8, 32768, 128, 2, 132).splits == 16
    assert paged.geometry(1, 8, 32768, 128, 2, 132).splits == 32


def test_small_batch_and_one_pass_change_the_batch1_geometry():
    """Batch 1 in a 2048-token table: 32-position tiles, 32 splits of two tiles gathered in one pass; without
    ``small_batch`` the general 128-position tiles and the loop; without ``one_pass`` the same tiles,
    looped."""
    assert paged.geometry(1, 8, 2048, 128, 2, 132) == paged.Geometry(32, 64, 32, 2, True)
    with kb.knobs(paged.KNOBS, small_batch=None):
        assert paged.geometry(1, 8, 2048, 128, 2, 132) == paged.Geometry(128, 256, 8, 1, False)
    with kb.knobs(paged.KNOBS, one_pass=False):
        assert paged.geometry(1, 8, 2048, 128, 2, 132) == paged.Geometry(32, 64, 32, 1, False)
    explicit = dataclasses.replace(
        paged.PagedDecodeKnobs(), tile_bytes=16384
    )  # an instance passed explicitly
    assert paged.geometry(2, 8, 2048, 128, 2, 132, kn=explicit).block_n == 64


def test_gemv_and_sampling_knobs_change_their_choices():
    assert gemv.config(1, 1024, 2048)["kernel"] == "prefetch" and gemv.config(1, 1024, 2048)["num_warps"] == 2
    with kb.knobs(gemv.KNOBS, prefetch=False):
        assert gemv.config(1, 1024, 2048)["kernel"] == "rows"
    with kb.knobs(gemv.KNOBS, prefetch_by_shape=(((1024, 2048), (4096, 1)),)):
        assert gemv.config(1, 1024, 2048)["num_warps"] == 1 and gemv.config(1, 1024, 1024)["num_warps"] == 2
    assert sampling.split_chunks(1, 151936) == (75, 2048)
    with kb.knobs(sampling.KNOBS, split_block=4096):
        assert sampling.split_chunks(1, 151936) == (38, 4096)


def test_cascade_knobs_change_the_prefill_launch():
    """Cascade's shared level (256 one-query "sequences", 16 q / 8 kv heads of 128): 16-row tiles of 8 tokens,
    2 warps and 3 stages, 16 splits; a prefill (8192 tokens of 4 sequences): 64-row tiles, 4 warps, no split
    (the workspace bound)."""
    shared, prefill = (256, 256, 16, 128, 2), (8192, 4, 16, 128, 2)
    assert cascade.prefill_launch(*shared) == cascade.PrefillLaunch(16, 8, 2, 3, 16, 1, 4)
    assert cascade.prefill_launch(*prefill) == cascade.PrefillLaunch(64, 32, 4, 2, 1, 1, 4)
    with kb.knobs(cascade.KNOBS, max_splits=4):
        assert cascade.prefill_launch(*shared).max_splits == 4
    with kb.knobs(cascade.KNOBS, workspace_bytes=256 * 16 * 128 * 4 * 2):  # room for two splits
        assert cascade.prefill_launch(*shared).max_splits == 2
    with kb.knobs(cascade.KNOBS, launch_few=(4, 2)):
        assert cascade.prefill_launch(*shared)[2:4] == (4, 2)
    with kb.knobs(cascade.KNOBS, rows_few=32):  # 32-row tiles, still the few-rows launch config
        assert cascade.prefill_launch(*shared)[:4] == (32, 16, 2, 3)
    assert cascade.prefill_launch(*shared, rows=32)[:4] == (32, 16, 4, 2)  # another height: the general one
    with kb.knobs(cascade.KNOBS, programs_per_sm=8, min_split_tiles=2):
        assert cascade.prefill_launch(*shared)[5:] == (2, 8)
    assert cascade.prefill_launch(*shared, rows=64, num_warps=8, programs_per_sm=2)[:3] == (64, 32, 8)
    assert [cascade.seq_pad(b) for b in (1, 256, 257)] == [256, 256, 512]
    with kb.knobs(cascade.KNOBS, seq_pad_min=16):
        assert [cascade.seq_pad(b) for b in (1, 17, 257)] == [16, 32, 512]


def test_rope_and_quantized_linear_knobs_change_their_choices():
    """Qwen3-0.6B's RoPE (16 q / 8 kv heads of 128: ``per_head`` 128 elements): 4 heads a program by default,
    8 with ``block_h_max=8``. An int4 QKV projection at one row: ``_qgemv_int4`` with 8 columns a program and
    2 warps; the row kernel with ``int4_decode`` off; a per-shape config; the dot tiles past
    ``int4_rows_max``."""
    assert rope.block_h_for(16, 8, 128) == 4
    with kb.knobs(rope.KNOBS, block_h_max=8):
        assert rope.block_h_for(16, 8, 128) == 8 and rope.block_h_for(16, 8, 512) == 4  # the tile bound
    qkv = (1, 4096, 1024, 128)
    default = qlin.config(*qkv)
    assert (default["kernel"], default["BN"], default["num_warps"]) == ("int4", 8, 2)
    with kb.knobs(qlin.KNOBS, int4_decode=False):
        assert qlin.config(*qkv)["kernel"] == "rows"
    with kb.knobs(qlin.KNOBS, int4_by_shape=(((4096, 1024), (4096, 4)),)):
        assert (qlin.config(*qkv)["BN"], qlin.config(*qkv)["num_warps"]) == (4, 4)
    with kb.knobs(qlin.KNOBS, int4_configs=((1024, 16384, 2),), int4_bn_max=8):
        assert qlin.config(*qkv)["BN"] == 8  # 16 columns fit the slab; the bound keeps 8
    with kb.knobs(qlin.KNOBS, int4_rows_max=4, rows_max=4):
        assert qlin.config(5, 4096, 1024, 128)["kernel"] == "dot"
    assert qlin.config(5, 4096, 1024, 128)["kernel"] == "int4"
    with kb.knobs(qlin.KNOBS, int4_chunk_k=512):  # K 1024 of groups of 128 loops over chunks of 4 groups
        assert qlin.config(*qkv)["NGA"] == 4 and qlin.config(*qkv)["NG"] == 8


def test_attention_knobs_change_the_split_count():
    """A decode call of the ALiBi FlashAttention (one tile per KV head: 8 programs, Sk 4096 in 64 tiles of 64
    keys, 1 KiB of workspace per split, 132 SMs): 16 splits of 4 tiles by default; each knob bounds it."""
    decode = (8, 64, 132, 1024)
    assert attention.splits_for(*decode) == 16
    assert attention.splits_for(528, 64, 132, 1024) == 1  # a full grid: no split, whatever the knobs
    with kb.knobs(attention.KNOBS, max_splits=8):
        assert attention.splits_for(*decode) == 8 and attention.splits_for(528, 64, 132, 1024) == 1
    with kb.knobs(attention.KNOBS, max_splits=64, min_split_tiles=2):  # 33: about two programs per SM
        assert attention.splits_for(*decode) == 32  # 64 tiles / 2
    with kb.knobs(attention.KNOBS, max_splits=64, min_split_tiles=1):
        assert attention.splits_for(*decode) == 33  # cdiv(2 x 132, 8)
    with kb.knobs(attention.KNOBS, min_split_tiles=16):
        assert attention.splits_for(*decode) == 4  # 64 tiles / 16
    with kb.knobs(attention.KNOBS, workspace_bytes=3 * 1024):
        assert attention.splits_for(*decode) == 3
    assert attention.splits_for(*decode, kn=attention.AttentionKnobs(max_splits=2)) == 2  # an explicit set
    assert attention.splits_for(*decode) == 16


def test_autotune_knobs_change_the_timing(monkeypatch):
    """``autotune_context`` times with the knobs in force: ``measure_context`` gets their fields."""
    from layerzero.core.runtime import RUNTIME
    from layerzero.ops import OPS

    seen = []

    def fake_measure(runtime, ctx, args, **timing):
        seen.append(timing)
        return []

    class _NoRows:
        def for_bucket(self, *a):
            return []

    monkeypatch.setattr(autotune, "measure_context", fake_measure)
    monkeypatch.setattr(RUNTIME, "perfdb", lambda: _NoRows())
    key, canonical = OPS["rms_norm"][0](torch.ones(2, 8), torch.ones(8))
    ctx = OPS["rms_norm"][1](key)
    autotune.autotune_context(RUNTIME, ctx, canonical)
    with kb.knobs(autotune.KNOBS, rounds=1, repeats=9, max_time_s=0.5):
        autotune.autotune_context(RUNTIME, ctx, canonical)
    autotune.autotune_context(RUNTIME, ctx, canonical)
    default = dict(warmup=2, iters=3, repeats=5, max_time_s=0.003, rounds=3)
    assert seen == [default, dict(default, repeats=9, max_time_s=0.5, rounds=1), default]


def test_rope_paged_knob_forces_the_split_count(monkeypatch):
    """``triton.rope_paged_decode``'s plan asks ``paged._plan`` for the forced split count in force (None:
    the paged-decode rule), and the plan key holds it (a change makes a new plan)."""
    seen = []

    def spy(*args):
        seen.append(args[7])  # paged._plan's num_splits
        raise RuntimeError("stop")

    monkeypatch.setattr(paged, "_KERNELS", type("K", (), {"get": staticmethod(lambda: None)}))
    monkeypatch.setattr(paged, "_plan", spy)
    t = torch.zeros(4)

    def plan():
        with pytest.raises(RuntimeError, match="stop"):
            rope_paged._plan(t, t, t, t, t, t, t, t, "NHD", False, False)

    plan()
    with kb.knobs(rope_paged.KNOBS, num_splits=3):
        plan()
    plan()
    assert seen == [None, 3, None]


def test_launch_knobs_change_the_pdl_choice(monkeypatch):
    """Under capture on an SM 9.0 device: PDL for up to ``pdl_max_rows`` rows; off with ``pdl=False``."""

    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: (9, 0))
    monkeypatch.setattr(_launch, "_SM90", {})
    t = SimpleNamespace(is_cuda=True, get_device=lambda: 0)
    on = {"PDL": True, "launch_pdl": True}
    assert [_launch.pdl_kwargs(t, rows) for rows in (1, 16, 17)] == [on, on, {}]
    with kb.knobs(_launch.KNOBS, pdl_max_rows=1):
        assert [_launch.pdl_kwargs(t, rows) for rows in (1, 2)] == [on, {}]
    with kb.knobs(_launch.KNOBS, pdl=False):
        assert _launch.pdl_kwargs(t, 1) == {}
    assert _launch.pdl_kwargs(t, 16) == on


def _spy_launches(monkeypatch, module):
    """Replace ``module``'s kernel loader and ``launch`` (no Triton): each launch appends ``(grid, constexpr
    keywords)`` to the returned list."""
    seen = []
    monkeypatch.setattr(
        module,
        "_KERNELS",
        type("K", (), {"get": staticmethod(lambda: SimpleNamespace(_rms_norm_fwd=None, _swiglu_fwd=None))}),
    )
    monkeypatch.setattr(module, "launch", lambda fn, grid, *args, **kw: seen.append((grid, kw)))
    return seen


def test_norm_knobs_change_the_row_tiling(monkeypatch):
    """``triton.rms_norm``'s launch: rows whose next power of two is at most ``one_pass_max`` go in one pass
    (``BLOCK`` = that power of two), longer ones in ``tile``-element tiles; the kernel gets both as
    constexprs."""
    seen = _spy_launches(monkeypatch, norms)

    def tiling(h):
        seen.clear()
        norms.rms_norm(torch.ones(2, h), torch.ones(h))
        ((grid, kw),) = seen
        assert grid == (2,)
        return kw["ONE_PASS"], kw["BLOCK"]

    assert [tiling(h) for h in (100, 8192, 8193)] == [(True, 128), (True, 8192), (False, 4096)]
    with kb.knobs(norms.KNOBS, one_pass_max=64):
        assert [tiling(h) for h in (64, 100)] == [(True, 64), (False, 4096)]
    try:
        kb.configure_knobs(norms.KNOBS, tile=1024, one_pass_max=16384)
        assert [tiling(h) for h in (8193, 16385)] == [(True, 16384), (False, 1024)]
    finally:
        assert kb.reset_knobs(norms.KNOBS) == norms.NormKnobs()
    assert [tiling(h) for h in (100, 8193)] == [(True, 128), (False, 4096)]


def test_swiglu_knobs_change_the_column_blocks_and_the_largest_size(monkeypatch):
    """``triton.swiglu``'s launch: ``cdiv(I, block)`` column-block programs a row, ``BLOCK`` = ``block``; the
    selection check's largest intermediate size is 65535 blocks."""
    seen = _spy_launches(monkeypatch, swiglu)

    def blocks(i):
        seen.clear()
        swiglu.swiglu(torch.ones(3, i), torch.ones(3, i))
        ((grid, kw),) = seen
        return grid, kw["BLOCK"]

    def refused(i):
        return [r.code.name for r in swiglu._check(SimpleNamespace(hidden_size=i))]

    big = 65535 * 1024
    assert (
        blocks(3072) == ((3, 3), 1024)
        and refused(big) == []
        and refused(big + 1) == ["HIDDEN_SIZE_UNSUPPORTED"]
    )
    with kb.knobs(swiglu.KNOBS, block=256):
        assert blocks(3072) == ((3, 12), 256) and refused(big // 4 + 1) == ["HIDDEN_SIZE_UNSUPPORTED"]
    try:
        kb.configure_knobs(swiglu.KNOBS, block=4096)
        assert blocks(3072) == ((3, 1), 4096) and refused(big + 1) == [] and swiglu.max_inter() == 4 * big
    finally:
        kb.reset_knobs(swiglu.KNOBS)
    assert blocks(3072) == ((3, 3), 1024) and swiglu.max_inter() == big


def test_linear_ce_knobs_change_the_chunks(monkeypatch):
    """The chunked ``linear_cross_entropy`` computes ``clamp(chunk_elements // V, 1, N)`` rows of logits at a
    time: forward passes counted, the loss the same; a call's ``chunk_rows`` still wins."""
    calls = []
    logits = linear_ce._logits
    monkeypatch.setattr(linear_ce, "_logits", lambda *a: calls.append(1) or logits(*a))
    g = torch.Generator().manual_seed(0)
    h, w, t = torch.randn(10, 4, generator=g), torch.randn(8, 4, generator=g), torch.arange(10) % 8

    def passes(**kw):
        calls.clear()
        loss = linear_ce.linear_cross_entropy(h, w, t, None, -100, "mean", 0.0, None, **kw)
        return len(calls), loss

    n, loss = passes()
    assert n == 1 and linear_ce.chunk_rows_for(10, 8) == 10
    with kb.knobs(linear_ce.KNOBS, chunk_elements=24):  # 3 rows of 8 logits
        assert linear_ce.chunk_rows_for(10, 8) == 3 and passes()[0] == 4
        torch.testing.assert_close(passes()[1], loss)
        assert passes(chunk_rows=5)[0] == 2
    try:
        kb.configure_knobs(linear_ce.KNOBS, chunk_elements=1)  # at least one row
        assert linear_ce.chunk_rows_for(10, 8) == 1 and passes()[0] == 10
    finally:
        kb.reset_knobs(linear_ce.KNOBS)
    assert passes()[0] == 1
    assert linear_ce.chunk_rows_for(10, 8, linear_ce.LinearCEKnobs(chunk_elements=16)) == 2  # an explicit set


def test_attention_smem_use_changes_the_tiles():
    """``config_for`` shrinks the tile until its shared-memory estimate fits ``smem_use`` of the GPU's limit:
    bf16 D 128 on a 99 KB GPU keeps 64 keys a step with the whole budget, 32 with 0.85; an H100's 227 KB at
    0.3 drops a stage and half the keys."""
    ada, h100 = 101376, 232448
    bf16 = (torch.bfloat16, 128, 128, 4096)
    assert attention.config_for(*bf16, ada) == (128, 32, 8, 2)
    assert attention.config_for(*bf16, h100) == (128, 64, 8, 3)
    with kb.knobs(attention.KNOBS, smem_use=1.0):
        assert attention.config_for(*bf16, ada) == (128, 64, 8, 2)
    try:
        kb.configure_knobs(attention.KNOBS, smem_use=0.3)
        assert attention.config_for(*bf16, h100) == (128, 32, 8, 2)
    finally:
        kb.reset_knobs(attention.KNOBS)
    assert attention.config_for(*bf16, ada) == (128, 32, 8, 2)
    assert attention.config_for(*bf16, h100) == (128, 64, 8, 3)
    assert attention.config_for(*bf16, ada, attention.AttentionKnobs(smem_use=1)) == (128, 64, 8, 2)


def test_a_change_drops_the_paged_plans():
    paged._PLANS[("a key",)] = None  # type: ignore[assignment]  # any cached plan
    with kb.knobs(paged.KNOBS, early_kv=True):
        assert not paged._PLANS
        paged._PLANS[("a key",)] = None  # type: ignore[assignment]
    assert not paged._PLANS  # the restore drops plans made under the block


# ---------------------------------------------------------------------------------------- the registry itself
@dataclass(frozen=True, slots=True)
class _Demo:
    """Knobs of this test module."""

    size: int = 4
    """A size."""
    mode: tuple[str, ...] = ("a",)
    """Modes."""
    scale: float | None = None
    """A scale (an int passes for a float)."""

    def __post_init__(self) -> None:
        kb.check_types(self)
        kb.require(self.size >= 1, self, "size", "an int >= 1")


@dataclass(frozen=True)
class _Other:
    size: int = 1


@pytest.fixture
def demo():
    """``"test.demo"`` registered (through the loader hook) for one test, removed after it."""
    calls = []
    kb.install_loader(lambda: (calls.append(1), kb.register("test.demo", _Demo())))
    yield calls
    for table in (kb._CURRENT, kb._DEFAULTS, kb._LISTENERS):
        table.pop("test.demo", None)
    kb._LOADER[0] = None


def test_the_loader_runs_once_on_the_first_miss(demo):
    assert kb.get("test.demo") == _Demo() and demo == [1]
    with pytest.raises(ConfigurationError, match="'test.other'"):
        kb.get("test.other")
    assert demo == [1]  # not run again


def test_register_checks_and_subscribe(demo):
    kb.get("test.demo")
    seen = []
    kb.subscribe("test.demo", lambda: seen.append(kb.get("test.demo").size))
    assert kb.configure_knobs("test.demo", size=2, scale=3).scale == 3
    with kb.knobs("test.demo", mode=("b", "c")):
        pass
    assert seen == [2, 2, 2]  # configure, the block's entry and its exit
    with pytest.raises(
        ConfigurationError, match=r"_Demo\.mode: expected tuple\[str, \.\.\.\], got \('b', 1\)"
    ):
        kb.configure_knobs("test.demo", mode=("b", 1))
    with pytest.raises(
        ConfigurationError, match=r"_Demo\.size: expected an int >= 1, got 0\. The default is 4"
    ):
        kb.configure_knobs("test.demo", size=0)
    with pytest.raises(ConfigurationError, match="a frozen dataclass instance"):
        kb.register("test.bad", {"size": 1})
    with pytest.raises(ConfigurationError, match="a second one"):
        kb.register("test.demo", _Other())
    kb.register("test.demo", _Demo(size=5))  # the same class again (a module reload): the new default
    assert kb.get("test.demo").size == 5 and kb.default_knobs("test.demo").size == 5


def test_public_knobs_api_works_before_any_op_call_and_invalidates_selections():
    """``lz.configure_knobs`` in a fresh interpreter, before any op ran (the package's wiring loads the
    modules that register knobs), and a change bumps the configuration epoch that cached selections are
    checked against."""
    import subprocess
    import sys

    code = (
        "import layerzero as lz\n"
        "from layerzero.core import config\n"
        "e = config._STATE.epoch\n"
        "new = lz.configure_knobs('triton.gemv', max_rows=4)\n"
        "assert new.max_rows == 4 and lz.get_knobs('triton.gemv') is new\n"
        "assert config._STATE.epoch > e, (e, config._STATE.epoch)\n"
        "lz.reset_knobs('triton.gemv')\n"
        "assert lz.get_knobs('triton.gemv').max_rows == 8\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
