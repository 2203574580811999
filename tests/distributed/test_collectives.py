"""lz.all_reduce / all_gather / reduce_scatter / all_to_all over Gloo on CPU (issue 38).

Two spawned groups (world sizes 2 and 3; tests/distributed/_coll_harness.py) check every op on odd shapes
in float32/float64/bfloat16 against a float64 single-process oracle of every rank's seeded inputs, through the
chosen kernels and through the locked reference kernels; the selection on CPU (torch_dist chosen, symm_mem
refused with reasons naming CUDA); typed errors. In-process tests cover what needs no peer.
"""

from __future__ import annotations

import datetime

import pytest
import torch
from _coll_harness import spawn

import layerzero as lz
from layerzero import InvalidInputError

pytestmark = pytest.mark.distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _check(results: list[dict], world: int) -> None:
    for r in results:
        assert r["which"] == {op: f"torch_dist.{op}" for op in OPS}, r["which"]
        assert r["n_checked"] > 100 and not r["bad"], (r["rank"], r["bad"])
        assert not r["ref_bad"] and r["ref_which"] == "reference.all_reduce", r["ref_bad"]
        assert all(r["unchanged"]), "lz.all_reduce wrote into its input"
        assert r["chosen"] == "torch_dist.all_reduce"
        assert r["ctx"] == {"world_size": world, "message_bytes": 128, "comm_backend": "gloo"}, r["ctx"]
        for k in ("symm_mem.one_shot", "symm_mem.two_shot", "symm_mem.one_shot_push"):
            codes = {c for c, _m in r["rejected"][k]}
            assert {
                "DEVICE_TYPE_UNSUPPORTED",
                "COMM_BACKEND_UNSUPPORTED",
                "SYMM_MEM_UNAVAILABLE",
                "MULTICAST_ENABLED",
            } <= codes, codes
            text = " ".join(m for _c, m in r["rejected"][k])
            assert "cuda" in text and "NCCL" in text and "enable_symm_mem" in text
        assert "MULTICAST_ENABLED" not in r["codes_multicast_off"]
        assert "WORLD_SIZE_UNSUPPORTED" not in r["codes_multicast_off"]
        e = r["errors"]
        assert e["rs_indivisible"]["type"] == "InvalidInputError"
        assert f"a multiple of the world size {world}" in e["rs_indivisible"]["message"]
        assert f"got {2 * world + 1}" in e["rs_indivisible"]["message"]
        for name in ("a2a_len", "a2a_sum", "a2a_neg", "a2a_out_missing", "dtype", "dim", "avg_int", "op"):
            assert e[name]["type"] == "InvalidInputError", (name, e[name])
            assert "expected" in e[name]["message"] and "got" in e[name]["message"], e[name]
        assert "sum(input_split_sizes)" in e["a2a_sum"]["message"]
        assert e["symm_gloo"]["type"] == "ConfigurationError" and "NCCL" in e["symm_gloo"]["message"]
        assert r["int_sum"] == [world * (world + 1) // 2] * 3


def test_two_ranks(tmp_path):
    _check(spawn(2, tmp_path), 2)


def test_three_ranks(tmp_path):
    _check(spawn(3, tmp_path), 3)


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("op", OPS)
def test_without_a_process_group_every_op_raises_typed(op):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(InvalidInputError, match="init_process_group"):
        getattr(lz, op)(torch.ones(4, 2))


def test_validation_comes_before_the_group_check():
    with pytest.raises(InvalidInputError, match=r"x\.dtype: expected one of float32"):
        lz.all_reduce(torch.ones(3, dtype=torch.uint8))
    with pytest.raises(InvalidInputError, match="a torch.Tensor"):
        lz.all_gather([1.0, 2.0])


def test_multicast_must_stay_off(monkeypatch):
    from layerzero.backends.symm_mem import buffers
    from layerzero.core.errors import ConfigurationError

    monkeypatch.setenv(buffers.MULTICAST_ENV, "0")
    with pytest.raises(ConfigurationError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST: expected '1'"):
        buffers.require_multicast_off()
    monkeypatch.delenv(buffers.MULTICAST_ENV)
    buffers.require_multicast_off()
    import os

    assert os.environ[buffers.MULTICAST_ENV] == "1"


def test_one_rank_group_explains_the_choice(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'init'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=20),
    )
    try:
        x = torch.randn(1000, dtype=torch.bfloat16)  # 2000 bytes -> bucket 2048
        rep = lz.explain("all_reduce", x)
        assert rep.chosen == "torch_dist.all_reduce"
        assert (rep.context.world_size, rep.context.message_bytes, rep.context.dtype) == (
            1,
            2048,
            torch.bfloat16,
        )
        reasons = {c.kernel_id: {r.code.value for r in c.reasons} for c in rep.candidates}
        assert "WORLD_SIZE_UNSUPPORTED" in reasons["symm_mem.one_shot"]
        from layerzero.core.dispatch import capture_key
        from layerzero.ops import OPS

        for op, args in {
            "all_reduce": (x,),
            "all_gather": (x,),
            "reduce_scatter": (x,),
            "all_to_all": (x, [1000], [1000]),
        }.items():
            prepare, build_ctx = OPS[op]
            key, _ = prepare(*args)
            cap = capture_key(key)
            assert cap is not None and cap.capture is True and cap._replace(capture=False) == key, op
            assert build_ctx(cap).graph_capture and not build_ctx(key).graph_capture
        assert torch.equal(lz.all_reduce(x), x) and torch.equal(
            lz.all_gather(x.view(10, 100), dim=1), x.view(10, 100)
        )
    finally:
        dist.destroy_process_group()
