"""Structured outputs at speed (issue 39): 64 concurrent JSON-schema requests against the same requests
unconstrained, output tokens / s and their ratio (target >= 0.9x on the H200), on a Qwen3-0.6B-shaped
checkpoint with dummy (seeded random) weights.

The tokenizer must be real for the grammar: a byte-level BPE of the model's vocabulary size is built here
(random merges of printable ASCII pieces, no download; ``--tokenizer-vocab`` ids, the model's vocabulary
padded past it, as Qwen's is), so xgrammar's mask work is that of a 150k-token vocabulary. The constrained run
goes first; the unconstrained run then asks each request for exactly the tokens its constrained twin produced
(``ignore_eos``), so both runs do the same forwards and only the grammar's cost differs. Runs alternate
(``--repeats``) after a warm-up; the medians are reported. ``--tiny``: a 2-layer model, 2k vocabulary, 8
requests, CPU-sized (the smoke test).

Usage::

    PYTHONPATH=src python benchmarks/engine/bench_structured.py --out benchmarks/results/engine/struct_h200
    PYTHONPATH=src python benchmarks/engine/bench_structured.py --tiny --out /tmp/structured_tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from layerzero.engine.tools.bench import QWEN3_0_6B as _BENCH_QWEN3_0_6B

# bench-engine's Qwen3-0.6B config with this benchmark's tokenizer's special ids
QWEN3_0_6B = {**_BENCH_QWEN3_0_6B, "bos_token_id": 1, "eos_token_id": 2}
"""Qwen/Qwen3-0.6B's config.json shape, BOS / EOS moved to the built tokenizer's ids."""
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2080,
}

WORD = {"type": "string", "pattern": "^[a-z]{3,10}$"}
SCHEMA = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": WORD,
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "role": {"enum": ["admin", "editor", "viewer"]},
            },
            "required": ["name", "age", "role"],
        },
        "items": {
            "type": "array",
            "minItems": 2,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "label": WORD,
                    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "label", "ok"],
            },
        },
    },
    "required": ["user", "items"],
}
"""A realistic API schema: nested objects, an array of objects, enums, patterns, bounded integers."""


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A transformers fast tokenizer: byte-level BPE with ``vocab_size`` ids (``<pad>`` ``<s>`` ``</s>`` as
    0 / 1 / 2, the 256 byte symbols, then random merges of printable ASCII pieces up to 12 bytes long)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_sym = {c: c for c in alphabet}
    printable = [chr(b) for b in range(33, 127)] + ["Ġ"]  # 'Ġ': the byte-level space
    printable = [c for c in printable if c in byte_sym]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in sorted(alphabet):
        vocab[c] = len(vocab)
    merges: list[tuple[str, str]] = []
    pieces = list(printable)
    while len(vocab) < vocab_size:
        a, b = rng.choice(pieces), rng.choice(printable if rng.random() < 0.5 else pieces)
        t = a + b
        if t in vocab or len(t) > 12:
            continue
        vocab[t] = len(vocab)
        merges.append((a, b))
        pieces.append(t)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build(directory: Path, tiny: bool, tokenizer_vocab: int) -> Path:
    """config.json (Qwen3-0.6B shape, or :data:`TINY`) and the tokenizer in ``directory`` (weights: dummy)."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {**QWEN3_0_6B, **(TINY if tiny else {})}
    if not (directory / "tokenizer.json").is_file():
        synthetic_tokenizer(tokenizer_vocab).save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


def _machine(device: str) -> dict[str, Any]:
    import llguidance
    import transformers
    import xgrammar

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    try:
        from importlib.metadata import version

        xgr_v, llg_v = version("xgrammar"), version("llguidance")
    except Exception:  # not installed as distributions
        xgr_v, llg_v = getattr(xgrammar, "__version__", "?"), getattr(llguidance, "__version__", "?")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "xgrammar": xgr_v,
        "llguidance": llg_v,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


def _timed(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list[Any]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measurement (see the module docstring); returns the results as plain data."""
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.structured import select_backend
    from layerzero.engine.structured_params import StructuredOutputsParams

    tiny = args.tiny
    device = args.device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    tok_vocab = args.tokenizer_vocab or (2048 if tiny else 151643)
    cache = (
        Path.home()
        / ".cache"
        / "layerzero"
        / f"structured-bench-{'tiny' if tiny else 'qwen3-0.6b'}-{tok_vocab}"
    )
    path = build(cache, tiny, tok_vocab)
    n = args.requests or (8 if tiny else 64)
    max_tokens = args.max_tokens or (400 if tiny else 900)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    llm = LLM(
        path,
        load_format="dummy",
        device=device,
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=n,
    )
    rng = random.Random(0)
    prompts = [[1] + [rng.randint(3, tok_vocab - 1) for _ in range(rng.randint(32, 96))] for _ in range(n)]
    so = StructuredOutputsParams(json=SCHEMA)
    con = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=so)
        for i in range(n)
    ]
    _timed(llm, prompts, con)  # warm-up: compiles, grammar caches, CUDA graphs
    t_c, outs = _timed(llm, prompts, con)
    lens = [len(o.outputs[0].token_ids) for o in outs]
    valid = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            valid += o.outputs[0].finish_reason == "stop"
        except ValueError:
            pass
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=k, ignore_eos=True) for i, k in enumerate(lens)
    ]
    _timed(llm, prompts, free)
    tc, tf = [t_c], []
    for _ in range(args.repeats):
        tf.append(_timed(llm, prompts, free)[0])
        tc.append(_timed(llm, prompts, con)[0])
    total = sum(lens)
    con_tps, free_tps = total / statistics.median(tc), total / statistics.median(tf)
    return {
        "machine": _machine(device),
        "device": device,
        "model": "tiny" if tiny else "Qwen3-0.6B shape (dummy weights)",
        "model_vocab": QWEN3_0_6B["vocab_size"] if not tiny else TINY["vocab_size"],
        "tokenizer_vocab": tok_vocab,
        "requests": n,
        "output_tokens": total,
        "mean_output_len": total / n,
        "valid_json_and_stop": valid,
        "backend": select_backend(so).backend,
        "early_read": not args.no_early_read,
        "structured_tok_s": con_tps,
        "unconstrained_tok_s": free_tps,
        "ratio": con_tps / free_tps,
        "structured_runs_s": tc,
        "unconstrained_runs_s": tf,
        "fill_threads": llm.engine.structured.fill_threads,  # rows bucket -> xgrammar threads chosen
        "schema": SCHEMA,
    }


def write(res: dict[str, Any], out: Path) -> None:
    """``bench_structured.json`` and ``README.md`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_structured.json").write_text(json.dumps(res, indent=1))
    m = res["machine"]
    md = [
        "# Structured outputs: JSON-schema requests vs the same requests unconstrained",
        "",
        f"- date {m['date']}; device {res['device']} (GPU {m['gpu']}, CPU {m['cpu']}); torch {m['torch']}, "
        f"transformers {m['transformers']}, xgrammar {m['xgrammar']}, llguidance {m['llguidance']}, "
        f"python {m['python']}",
        f"- model: {res['model']}, vocabulary {res['model_vocab']} (tokenizer {res['tokenizer_vocab']} ids, "
        f"the rest always banned); backend {res['backend']}; early read {res['early_read']}; xgrammar fill "
        f"threads by rows (measured choice): {res.get('fill_threads', {})}",
        f"- {res['requests']} concurrent requests, {res['output_tokens']} output tokens per run (mean "
        f"{res['mean_output_len']:.1f}); valid JSON ending in stop: "
        f"{res['valid_json_and_stop']}/{res['requests']}",
        "",
        "| run | output tok/s |",
        "| --- | ---: |",
        f"| unconstrained (same token counts, ignore_eos) | {res['unconstrained_tok_s']:.0f} |",
        f"| JSON schema | {res['structured_tok_s']:.0f} |",
        f"| ratio | {res['ratio']:.3f}x |",
        "",
        "Medians of alternated runs after a warm-up; see benchmarks/engine/bench_structured.py.",
    ]
    (out / "README.md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, write ``--out``; print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, 2k vocabulary, 8 requests (CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--tokenizer-vocab", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--no-early-read",
        action="store_true",
        help="async scheduling reads step N before scheduling N+1 for structured rows (EngineLoop."
        "structured_early_read = False): the overlap's A/B",
    )
    args = ap.parse_args(argv)
    if args.no_early_read:
        from layerzero.engine.core.llm_engine import EngineLoop

        EngineLoop.structured_early_read = False
    res = run(args)
    write(res, args.out)
    print(
        f"structured {res['structured_tok_s']:.0f} tok/s, "
        f"unconstrained {res['unconstrained_tok_s']:.0f} tok/s, "
        f"ratio {res['ratio']:.3f}x; valid {res['valid_json_and_stop']}/{res['requests']} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
