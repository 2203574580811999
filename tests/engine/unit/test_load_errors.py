"""A broken or unsupported checkpoint is a ``layerzero.ConfigurationError`` naming the file (what failed,
expected vs got, how to fix), raised by ``LLM(path)`` and ``ModelConfig.from_pretrained``, never a raw
traceback from json, transformers, safetensors or torch, and never silently wrong tokens (issue 35). Each case
corrupts a copy of one tiny checkpoint built once per session (``checkpoints`` fixture)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import layerzero as lz

pytestmark = pytest.mark.integration

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def plain(checkpoints, tmp_path_factory) -> Path:
    """The qwen3 checkpoint without tokenizer files: config and weights only."""
    d = tmp_path_factory.mktemp("plain") / "qwen3"
    shutil.copytree(checkpoints["qwen3"], d)
    for f in TOKENIZER_FILES:
        (d / f).unlink(missing_ok=True)
    return d


def _copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    return d


def _edit_json(file: Path, **changes) -> None:
    cfg = json.loads(file.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    file.write_text(json.dumps(cfg))


def _llm(d: Path):
    from layerzero.engine import LLM

    return LLM(d, device="cpu", max_model_len=32, num_kv_blocks=8)


def _refused(d: Path, match: str, *, config: bool = True) -> None:
    """``LLM(d)`` (and ``ModelConfig.from_pretrained(d)`` when ``config``) raise ConfigurationError
    matching."""
    from layerzero.engine.config import ModelConfig

    if config:
        with pytest.raises(lz.ConfigurationError, match=match):
            ModelConfig.from_pretrained(d)
    with pytest.raises(lz.ConfigurationError, match=match):
        _llm(d)


# ------------------------------------------------------------------------------------------------ config.json
@pytest.mark.parametrize(
    "text,got",
    [
        ("{not json", "invalid JSON"),
        ("", "an empty file"),
        ("  \n", "an empty file"),
        ("[1, 2]", "a JSON array"),
        ('"qwen3"', "a JSON string"),
        ("null", "a JSON null"),
    ],
)
def test_corrupted_config_json(plain, tmp_path, text, got):
    d = _copy(plain, tmp_path)
    (d / "config.json").write_text(text)
    _refused(
        d, rf"config\.json: expected a JSON object \(the model's Hugging Face config\), got {got}.*download"
    )


def test_corrupted_config_json_with_a_tokenizer(checkpoints, tmp_path):
    """AutoTokenizer reads config.json too: the error is still config.json's, not a raw OSError."""
    d = _copy(checkpoints["qwen3"], tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(lz.ConfigurationError, match=r"config\.json: expected a JSON object.*invalid JSON"):
        _llm(d)


CONFIG_CASES = [
    # (changes to config.json, expected message)
    (
        dict(model_type=None),
        r"model_type in .*config\.json: expected one of \['llama', 'qwen3', 'qwen3_moe'\].*got no "
        r"model_type key",
    ),
    (
        dict(model_type="gpt2"),
        r"model_type in .*config\.json: expected one of \['llama', 'qwen3', 'qwen3_moe'\]",
    ),
    (
        dict(max_position_embeddings=-5),
        r"max_position_embeddings in .*config\.json: expected an int >= 1, got -5\. "
        r"Fix config\.json",
    ),
    (dict(vocab_size=0), r"vocab_size in .*config\.json: expected an int >= 1, got 0"),
    (dict(hidden_size=-1), r"hidden_size in .*: expected an int >= 1, got -1"),
    (dict(hidden_size=128.5), r"hidden_size in .*: expected an int >= 1, got 128\.5"),
    (dict(intermediate_size=0), r"intermediate_size in .*: expected an int >= 1, got 0"),
    (dict(num_hidden_layers=0), r"num_hidden_layers in .*: expected an int >= 1, got 0"),
    (dict(num_attention_heads=0), r"num_attention_heads in .*: expected an int >= 1, got 0"),
    (dict(num_key_value_heads=0), r"num_key_value_heads in .*: expected an int >= 1, got 0"),
    (dict(num_key_value_heads="2"), r"num_key_value_heads in .*: expected an int >= 1, got '2'"),
    (dict(num_key_value_heads=True), r"num_key_value_heads in .*: expected an int >= 1, got True"),
    (
        dict(num_key_value_heads=3),
        r"num_attention_heads % num_key_value_heads in .*config\.json: expected 0, "
        r"got 8 % 3",
    ),
    (dict(head_dim=15), r"head_dim in .*config\.json: expected an even number.*got 15"),
    (dict(rms_norm_eps=-1.0), r"rms_norm_eps in .*: expected a finite float > 0, got -1\.0"),
    (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}),
        r"rope_theta in .*: expected a finite number "
        r"> 0, got 0\.0",
    ),
    (
        dict(eos_token_id=512),
        r"eos_token_id in .*config\.json: expected token ids in \[0, 512\) \(vocab_size\), "
        r"got 512",
    ),
    (dict(eos_token_id=-1), r"eos_token_id in .*config\.json: expected token ids in \[0, 512\)"),
    (
        dict(eos_token_id=[2, 600]),
        r"eos_token_id in .*config\.json: expected token ids in \[0, 512\).*got \[2, 600\]",
    ),
    # features the engine does not implement: refused, not ignored
    (
        dict(hidden_act="gelu"),
        r"hidden_act in .*config\.json: expected one of \('silu', 'swish'\).*got 'gelu'",
    ),
    (dict(mlp_bias=True), r"mlp_bias in .*config\.json: expected false"),
    (
        dict(use_sliding_window=True, sliding_window=8, layer_types=None, max_window_layers=1),
        r"sliding-window attention in .*config\.json: expected full attention on every layer.*got "
        r"sliding_window=8 on layers \[1\]",
    ),
    (
        dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        r"sliding-window attention .*got sliding_window=8 on layers \[0\]",
    ),
    (
        dict(layer_types=["full_attention", "chunked_attention"]),
        r"layer_types in .*: expected only 'full_attention' "
        r"layers, got \['chunked_attention'\]",
    ),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor in .*: expected 1\.0.*got 0\.5"),
    (
        dict(quantization_config={"quant_method": "fp8"}),
        r"quantization_config in .*: expected none.*got quant_method "
        r"'fp8'.*LLM\(quantization=",
    ),
]


@pytest.mark.parametrize(
    "changes,match",
    CONFIG_CASES,
    ids=lambda v: ",".join(f"{k}={v[k]!r}" for k in v) if isinstance(v, dict) else "",
)
def test_bad_or_unsupported_config(plain, tmp_path, changes, match):
    d = _copy(plain, tmp_path)
    _edit_json(d / "config.json", **changes)
    _refused(d, match)


@pytest.mark.parametrize(
    "changes",
    [
        dict(use_sliding_window=False, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        dict(
            use_sliding_window=True, sliding_window=256, layer_types=None, max_window_layers=0
        ),  # covers every position
        dict(hidden_act="swish"),  # transformers' other name of SiLU
    ],
    ids=["window-off", "window-covers-everything", "swish"],
)
def test_what_runs_as_implemented_is_accepted(plain, tmp_path, changes):
    """transformers runs these as full attention / SiLU too: accepted."""
    from layerzero.engine.config import ModelConfig

    d = _copy(plain, tmp_path)
    _edit_json(d / "config.json", **changes)
    assert ModelConfig.from_pretrained(d).num_layers == 2


def test_generation_config_eos(plain, tmp_path):
    from layerzero.engine.config import ModelConfig

    d = _copy(plain, tmp_path)
    _edit_json(d / "generation_config.json", eos_token_id=[2, 5])
    assert ModelConfig.from_pretrained(d).eos_token_ids == (
        2,
        5,
    )  # config.json's, then generation_config.json's
    _edit_json(d / "generation_config.json", eos_token_id=[2, 9999])
    _refused(
        d, r"eos_token_id in .*generation_config\.json: expected token ids in \[0, 512\).*got \[2, 9999\]"
    )
    (d / "generation_config.json").write_text("{")
    _refused(d, r"generation_config\.json: expected a JSON object.*invalid JSON")


# ---------------------------------------------------------------------------------------------------- weights
def _rewrite(d: Path, name: str, value) -> None:
    w = load_file(str(d / "model.safetensors"))
    w[name] = value(w[name])
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_truncated_or_empty_safetensors(plain, tmp_path):
    d = _copy(plain, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _refused(
        d,
        r"safetensors file .*model\.safetensors: expected a complete safetensors file, got .*download it "
        r"again",
        config=False,
    )
    f.write_bytes(b"")
    _refused(d, r"safetensors file .*model\.safetensors: expected a complete safetensors file", config=False)


def test_index_naming_a_missing_shard(plain, tmp_path):
    d = _copy(plain, tmp_path)
    names = list(load_file(str(d / "model.safetensors")))
    wmap = {n: "model.safetensors" for n in names}
    wmap[names[0]] = "model-00002-of-00002.safetensors"
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    _refused(
        d,
        r"shards named by .*model\.safetensors\.index\.json: expected every shard file.*got 1 of 2 missing: "
        r"\['model-00002-of-00002\.safetensors'\]",
        config=False,
    )
    index.write_text("{")
    _refused(d, r"model\.safetensors\.index\.json: expected a JSON object.*invalid JSON", config=False)
    index.write_text(json.dumps({"metadata": {}}))
    _refused(d, r"weight_map in .*index\.json: expected a non-empty object", config=False)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn])
def test_a_weight_of_a_non_float_dtype(plain, tmp_path, dtype):
    d = _copy(plain, tmp_path)
    _rewrite(d, "model.norm.weight", lambda t: t.to(dtype))
    _refused(
        d,
        rf"tensor model\.norm\.weight of .*model\.safetensors: expected a float dtype \(torch\.float32, "
        rf"torch\.float16, torch\.bfloat16, torch\.float64\), got {dtype}",
        config=False,
    )


@pytest.mark.parametrize("value,count", [(float("nan"), 128), (float("inf"), 1)])
def test_non_finite_weights(plain, tmp_path, value, count):
    def poison(t):
        t = t.clone()
        if count == t.numel():
            t.fill_(value)
        else:
            t[3] = value
        return t

    d = _copy(plain, tmp_path)
    _rewrite(d, "model.norm.weight", poison)
    _refused(
        d,
        rf"tensor model\.norm\.weight of .*model\.safetensors: expected finite values, got {count} of 128 "
        rf"non-finite values \(NaN/Inf\)",
        config=False,
    )


def test_sizes_that_do_not_match_the_weights(plain, tmp_path):
    d = _copy(plain, tmp_path)
    _edit_json(d / "config.json", head_dim=32)
    _refused(
        d,
        r"checkpoint tensor .*: expected \[.*\], got \[.*\]\. The checkpoint does not match its config\.json"
        r".*head_dim.*\(loading tensor model\.layers\.0\..* of .*model\.safetensors\)",
        config=False,
    )


# -------------------------------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize(
    "file,text,match",
    [
        ("tokenizer.json", "{garbage", r"tokenizer\.json: expected a JSON object.*invalid JSON"),
        ("tokenizer.json", "", r"tokenizer\.json: expected a JSON object.*an empty file"),
        (
            "tokenizer.json",
            json.dumps({"model": {"type": "Nope"}}),
            r"tokenizer files \[.*tokenizer\.json.*\] in .*: "
            r"expected a tokenizer transformers' AutoTokenizer "
            r"can load, got .*download them again",
        ),
        ("tokenizer_config.json", "[]", r"tokenizer_config\.json: expected a JSON object.*a JSON array"),
        (
            "config.json",
            "{",
            r"config\.json: expected a JSON object \(the model's",
        ),  # AutoTokenizer reads it too
    ],
)
def test_malformed_tokenizer(checkpoints, tmp_path, file, text, match):
    from layerzero.engine.loader import load_tokenizer

    d = _copy(checkpoints["qwen3"], tmp_path)
    (d / file).write_text(text)
    with pytest.raises(lz.ConfigurationError, match=match):
        load_tokenizer(d)


def test_malformed_tokenizer_through_llm(checkpoints, tmp_path):
    d = _copy(checkpoints["qwen3"], tmp_path)
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nope"}}))
    with pytest.raises(lz.ConfigurationError, match=r"tokenizer files"):
        _llm(d)


def test_load_tokenizer_of_a_good_checkpoint_and_of_none(checkpoints, plain):
    from layerzero.engine.loader import load_tokenizer

    assert load_tokenizer(plain) is None
    assert load_tokenizer(checkpoints["qwen3"]).eos_token_id == 2


# ----------------------------------------------------------------------------------------------------- device
@pytest.mark.parametrize(
    "device,match",
    [
        ("cuda", r"LLM device: expected a device this process can use, got 'cuda', but"),
        ("cuda:0", r"got 'cuda:0', but"),
        ("bogus", r"LLM device: expected a torch device string"),
        ("cuda:x", r"LLM device: expected a torch device string"),
        ("meta", r"LLM device: expected a device of type \('cpu', 'cuda'\)"),
        (0, r"LLM device: expected a torch device string.*got 0"),
    ],
)
def test_bad_device(plain, monkeypatch, device, match):
    from layerzero.engine import LLM
    from layerzero.engine.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(lz.ConfigurationError, match=match):
        resolve_device(device)
    with pytest.raises(lz.ConfigurationError, match=match):
        LLM(plain, device=device)


def test_resolve_device(monkeypatch):
    from layerzero.engine.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu") == resolve_device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(None) == torch.device("cuda") and resolve_device("cuda:1") == torch.device(
        "cuda", 1
    )
    with pytest.raises(lz.ConfigurationError, match=r"expected a CUDA index in \[0, 2\).*got 'cuda:2'"):
        resolve_device("cuda:2")
