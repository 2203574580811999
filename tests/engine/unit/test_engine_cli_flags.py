"""The engine flags ``generate`` and ``serve`` share (``layerzero.cli_engine.add_engine_args``): each maps to
the ``LLM`` keyword of the same name, with ``LLM``'s default; the oracle is the keyword dicts written out by
hand. ``serve`` adds the server's flags when it parses (checked with a stand-in server module, and with the
real one when it is there)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import layerzero as lz

pytestmark = pytest.mark.unit

DEFAULTS = {  # LLM(...)'s defaults, by hand (its docstring / signature)
    "model": "m",
    "dtype": None,
    "device": None,
    "max_model_len": None,
    "max_num_seqs": 256,
    "max_num_batched_tokens": None,
    "block_size": 16,
    "num_kv_blocks": None,
    "kv_cache_memory_fraction": 0.9,
    "enable_prefix_caching": True,
    "prefix_cache": "radix",
    "scheduling_policy": "fcfs",
    "enforce_eager": False,
    "seed": 0,
    "cpu_kv_cache_bytes": 1 << 30,
    "quantization": None,
    "kv_cache_dtype": "auto",
    "async_scheduling": None,
    "cascade_attention": None,
    "freeze_gc": None,
    "warmup": None,
    "tensor_parallel_size": 1,
    "enable_expert_parallel": False,
    "data_parallel_size": 1,
    "load_format": "auto",
    "speculative_config": None,
    "logits_processors": (),
    "idle_poll_s": None,
}

CASES = [
    (["--dtype", "float16"], {"dtype": torch.float16}),
    (["--dtype", "bfloat16"], {"dtype": torch.bfloat16}),
    (["--dtype", "float32"], {"dtype": torch.float32}),
    (["--dtype", "auto"], {"dtype": None}),
    (["--device", "cpu"], {"device": "cpu"}),
    (["--device", "cuda:1"], {"device": "cuda:1"}),
    (["--max-model-len", "128"], {"max_model_len": 128}),
    (["--max-num-seqs", "8"], {"max_num_seqs": 8}),
    (["--max-num-batched-tokens", "512"], {"max_num_batched_tokens": 512}),
    (["--block-size", "32"], {"block_size": 32}),
    (["--num-kv-blocks", "100"], {"num_kv_blocks": 100}),
    (["--kv-cache-memory-fraction", "0.5"], {"kv_cache_memory_fraction": 0.5}),
    (["--cpu-kv-cache-bytes", "1048576"], {"cpu_kv_cache_bytes": 1048576}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    (["--prefix-cache", "hash"], {"prefix_cache": "hash"}),
    (["--scheduling-policy", "priority"], {"scheduling_policy": "priority"}),
    (["--scheduling-policy", "lpm"], {"scheduling_policy": "lpm"}),
    (["--enforce-eager"], {"enforce_eager": True}),
    (["--quantization", "int4"], {"quantization": "int4"}),
    (["--quantization", "fp8_w8a8"], {"quantization": "fp8_w8a8"}),
    (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}),
    (["--kv-cache-dtype", "int8"], {"kv_cache_dtype": "int8"}),
    (["--seed", "7"], {"seed": 7}),
    (["--async-scheduling"], {"async_scheduling": True}),
    (["--no-async-scheduling"], {"async_scheduling": False}),
    (["--cascade-attention"], {"cascade_attention": True}),
    (["--no-cascade-attention"], {"cascade_attention": False}),
    (["--freeze-gc"], {"freeze_gc": True}),
    (["--no-freeze-gc"], {"freeze_gc": False}),
    (["--warmup"], {"warmup": True}),
    (["--no-warmup"], {"warmup": False}),
    (["--tensor-parallel-size", "2"], {"tensor_parallel_size": 2}),
    (["--enable-expert-parallel"], {"enable_expert_parallel": True}),
    (["--data-parallel-size", "2"], {"data_parallel_size": 2}),
    (["--load-format", "dummy"], {"load_format": "dummy"}),
    (["--speculative-config", '{"method": "ngram"}'], {"speculative_config": '{"method": "ngram"}'}),
    (["--logits-processors", "a:B", "c.D"], {"logits_processors": ["a:B", "c.D"]}),
    (["--idle-poll-s", "0.5"], {"idle_poll_s": 0.5}),
]


def _generate_kwargs(flags: list[str]) -> dict:
    from layerzero.cli import build_parser
    from layerzero.cli_engine import engine_kwargs

    return engine_kwargs(build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", *flags]))


def test_defaults_are_llms():
    from layerzero.cli_engine import ENGINE_KWARGS
    from layerzero.engine.config import EngineConfig

    assert _generate_kwargs([]) == DEFAULTS
    # the hand-written defaults are EngineConfig's (what LLM passes on), and every field has a flag
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "cuda_graph"}
    assert set(ENGINE_KWARGS) == set(fields) == set(DEFAULTS)
    assert {k: v for k, v in fields.items() if k != "model"} == {
        k: v for k, v in DEFAULTS.items() if k != "model"
    }


@pytest.mark.parametrize("flags,changed", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_each_flag_sets_its_llm_keyword(flags, changed):
    assert _generate_kwargs(flags) == {**DEFAULTS, **changed}


def test_every_keyword_has_a_case_and_flags_combine():
    from layerzero.cli_engine import ENGINE_KWARGS

    assert {k for _, changed in CASES for k in changed} == set(ENGINE_KWARGS) - {"model"}
    flags = ["--max-num-seqs", "4", "--no-enable-prefix-caching", "--seed", "3", "--dtype", "float16"]
    want = {**DEFAULTS, "max_num_seqs": 4, "enable_prefix_caching": False, "seed": 3, "dtype": torch.float16}
    assert _generate_kwargs(flags) == want


def test_choices_are_what_the_engine_accepts():
    from layerzero import cli_engine
    from layerzero.engine import config

    assert cli_engine.SCHEDULING_POLICIES == config.SCHEDULING_POLICIES
    assert cli_engine.PREFIX_CACHES == config.PREFIX_CACHES
    assert cli_engine.QUANTIZATIONS == config.QUANTIZATIONS
    assert cli_engine.KV_CACHE_DTYPES == tuple(config.KV_CACHE_DTYPES)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--scheduling-policy", "sjf"], "invalid choice: 'sjf'"),
        (["--max-num-seqs", "many"], "invalid int value: 'many'"),
        (["--kv-cache-memory-fraction", "x"], "invalid float value: 'x'"),
        (["--quantization", "int2"], "invalid choice: 'int2'"),
    ],
)
def test_malformed_flags_are_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        _generate_kwargs(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_llm_accepts_every_keyword(checkpoints):
    """``LLM(**engine_kwargs(...))`` builds, and its ``EngineConfig`` holds exactly the flags' values."""
    from layerzero.engine import LLM
    from layerzero.engine.config import EngineConfig

    flags = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4"]
    flags += ["--block-size", "8", "--num-kv-blocks", "40", "--prefix-cache", "hash", "--seed", "5"]
    flags += ["--cpu-kv-cache-bytes", str(1 << 20), "--no-async-scheduling", "--no-freeze-gc"]
    kw = _generate_kwargs(flags)
    kw["model"] = str(checkpoints["qwen3"])
    llm = LLM(**kw)
    assert llm.engine.config == EngineConfig(**kw)
    assert llm.engine.config.num_kv_blocks == 40 and llm.engine.config.prefix_cache == "hash"


def _fake_server(monkeypatch, calls):
    """Stand-in ``layerzero.engine.entrypoints.openai.api_server`` (add_server_args / run_server)."""
    mod = types.ModuleType("api_server")

    def add_server_args(parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--host", default="127.0.0.1")

    def run_server(args, engine_options):
        calls.append((args, engine_options))
        return 0

    mod.add_server_args, mod.run_server = add_server_args, run_server
    base = "layerzero.engine.entrypoints"
    for name in (base, f"{base}.openai"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, f"{base}.openai.api_server", mod)


def test_serve_has_engine_and_server_flags(monkeypatch):
    from layerzero.cli import main
    from layerzero.cli_engine import engine_kwargs

    calls: list = []
    _fake_server(monkeypatch, calls)
    rc = main(["serve", "--model", "/ckpt/qwen", "--port", "9001", "--max-num-seqs", "3", "--enforce-eager"])
    ((ns, options),) = calls
    assert rc == 0 and ns.port == 9001 and ns.host == "127.0.0.1"
    want = {**DEFAULTS, "model": "/ckpt/qwen", "max_num_seqs": 3, "enforce_eager": True}
    assert engine_kwargs(ns) == want and options == want


def test_serve_without_the_server_says_how_to_install_it(monkeypatch, capsys):
    from layerzero.cli import main

    monkeypatch.setitem(sys.modules, "layerzero.engine.entrypoints.openai.api_server", None)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "m"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "the server is unavailable" in err and "layerzero[serve]" in err


def test_serve_help_lists_engine_and_server_flags(capsys):
    try:
        from layerzero.engine.entrypoints.openai.api_server import add_server_args  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"the server (layerzero.engine.entrypoints.openai.api_server) is not importable: {exc}")
    from layerzero.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ("--model", "--max-num-seqs", "--no-enable-prefix-caching", "--kv-cache-dtype", "--port"):
        assert flag in out
    assert "--api-server-count" in out


def test_api_server_count_defaults_to_the_data_parallel_size_and_is_checked():
    import argparse

    pytest.importorskip("fastapi", reason="the server extra is not installed")
    from layerzero.engine.entrypoints.openai.api_server import _api_server_count

    ns = argparse.Namespace(api_server_count=None)
    assert _api_server_count(ns, {"data_parallel_size": 3}) == 3 and _api_server_count(ns, {}) == 1
    assert _api_server_count(argparse.Namespace(api_server_count=2), {"data_parallel_size": 1}) == 2
    for bad in (0, -1, True, 1.5):
        with pytest.raises(lz.ConfigurationError, match="--api-server-count: expected an int >= 1"):
            _api_server_count(argparse.Namespace(api_server_count=bad), {})
