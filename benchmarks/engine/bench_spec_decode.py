"""Speculative decoding's speed (issue 39 section 3): output tok/s of greedy decoding at batch 1, 8 and 32
with each method against plain decoding in the same process, with the measured acceptance.

Rows (one engine each, every batch size on it; the plain engine first):
- ``plain``: no speculation (the baseline);
- ``ngram``: prompt lookup (k = ``--k``) on a repetitive workload (each prompt a random 16-token pattern
  repeated);
- ``draft``: a small draft model (``--draft``, default a Qwen3-0.6B shape): with random weights it agrees with
  the target almost never, so this row measures the cost of speculating when nothing is accepted;
- ``draft=target``: the target's own shape as the draft (dummy weights are seeded by the engine's seed, so the
  draft IS the target: acceptance 1.0): the overhead frontier, the most a draft this size can give;
- ``layer_skip``: the target's first quarter of layers as the draft (self-speculation).

Issue 39's target: where acceptance >= 0.8 with k = 4, batch-1 speedup >= 2x. Verification steps run eager
(no CUDA graph for them yet) while plain decode replays graphs: that gap is part of what is measured.

    python benchmarks/engine/bench_spec_decode.py --out /tmp/spec   # H200: Qwen3-8B-shaped target, dummy
    python benchmarks/engine/bench_spec_decode.py --tiny            # CPU smoke run (a tiny checkpoint)
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from layerzero.engine import LLM, SamplingParams
from layerzero.engine.spec_decode.ahead import AHEAD_MAX_ROWS
from layerzero.engine.tools.bench import QWEN3_0_6B

QWEN3_8B = {
    **QWEN3_0_6B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}


def _shape_dir(root: Path, name: str, cfg: dict[str, Any]) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def _prompts(n: int, vocab: int, seed: int, pattern: int = 16, repeats: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (pattern,), generator=g).tolist() * repeats for _ in range(n)]


def _repeated(vocab: int) -> Any:
    """The default prompts: ``(n, seed) -> n`` repeated random patterns (:func:`_prompts`)."""
    return lambda n, seed: _prompts(n, vocab, seed)


def _measure(llm: LLM, batch: int, max_tokens: int, vocab: int, prompts: Any = None) -> dict[str, Any]:
    """One timed greedy run of ``batch`` prompts (``prompts(n, seed)``; default the repeated patterns)."""
    prompts = prompts or _repeated(vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts(batch, 1), warm, use_tqdm=False)
    before = dict(llm.stats().get("spec_decode") or {})
    t0 = time.perf_counter()
    outs = llm.generate(prompts(batch, 2), sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    after = llm.stats().get("spec_decode") or {}
    row: dict[str, Any] = {"batch": batch, "tokens": toks, "seconds": dt, "tok_per_s": toks / dt}
    if after:
        drafts = after["num_drafts"] - before.get("num_drafts", 0)
        dtok = after["num_draft_tokens"] - before.get("num_draft_tokens", 0)
        acc = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
        row.update(
            acceptance_rate=acc / dtok if dtok else 0.0,
            mean_acceptance_length=1 + acc / drafts if drafts else 0.0,
            num_drafts=drafts,
        )
    return row


def _timeline(llm: LLM, name: str, vocab: int, prompts: Any, out: Path) -> None:
    """One profiled batch-1 generate of 64 tokens on ``llm``: its GPU timeline into ``out/timeline_<name>.md``
    (per step: per verification round when speculating)."""
    from gpu_timeline import profile_events, summarize  # benchmarks/engine on sys.path

    prompts = prompts or _repeated(vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    before = (llm.stats().get("spec_decode") or {}).get("num_drafts", 0)
    events = profile_events(lambda: llm.generate(prompts(1, 3), sp, use_tqdm=False))
    rounds = (llm.stats().get("spec_decode") or {}).get("num_drafts", 0) - before
    steps = rounds or 64
    what = f"a 64-token batch-1 generate, {name} ({steps} {'rounds' if rounds else 'steps'})"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"timeline_{name}.md").write_text(summarize(events, what, steps))


def run(
    target: Path,
    draft: Path | None,
    device: str,
    dtype: torch.dtype,
    batches: list[int],
    max_tokens: int,
    k: int,
    dummy: bool,
    num_layers: int,
    only: list[str] | None = None,
    out: Path | None = None,
    constructed: float | None = None,
    timeline: bool = False,
    ahead_ab: bool = False,
) -> list[dict[str, Any]]:
    """One engine per configuration (``only``: those names; ``plain`` always runs first: the baseline), every
    batch size on it; returns the rows (speedups vs ``plain``), also written to ``out`` after each row.
    ``constructed``: every model's weights made to walk a known permutation (``spec_constructed``), drafts
    agreeing with the target on that fraction of tokens, and the prompts that walk's noisy copy.
    ``timeline``: each engine also profiles one batch-1 generate of 64 tokens (torch.profiler) into
    ``out/timeline_<config>.md`` (``gpu_timeline.summarize``: where the GPU idles in a step or round).
    ``ahead_ab``: each device-draft engine also runs every batch with ``DraftProposer.ahead_max_rows`` 0
    (rows ``<config> (no ahead)``, right after the rows with it on)."""
    cfg = json.loads((target / "config.json").read_text())
    vocab = cfg["vocab_size"]
    prompts = None
    if constructed is not None:
        import spec_constructed as sc

        succ = sc.successors(vocab)
        dsucc = sc.draft_successors(succ, constructed)
        head = 16

        def prompts(n: int, seed: int) -> list[list[int]]:
            return sc.walk_prompts(succ, n, head, max_tokens + k + 8, constructed, seed)

    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("plain", None),
        (
            "ngram",
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        ),
        ("draft=target", {"method": "draft_model", "num_speculative_tokens": k, "model": str(target)}),
        ("layer_skip", {"method": "layer_skip", "num_speculative_tokens": k, "num_layers": num_layers}),
    ]
    if draft is not None:
        configs.insert(
            2, ("draft", {"method": "draft_model", "num_speculative_tokens": k, "model": str(draft)})
        )
    if only is not None:
        configs = [c for c in configs if c[0] == "plain" or c[0] in only]
    opts = dict(
        device=device,
        dtype=dtype,
        max_model_len=16 * 8 + 2 * (max_tokens + 16 + k + 8) + k + 1,
        max_num_seqs=max(batches),
        load_format="dummy" if dummy else "auto",
    )
    if device == "cpu":
        opts["num_kv_blocks"] = max(batches) * -(-opts["max_model_len"] // 16) + 1
    rows, base = [], {}
    for name, spec in configs:
        llm = LLM(target, speculative_config=spec, **opts)
        if constructed is not None:
            sc.construct_llm(llm, succ, dsucc)
            sc.check_walk(llm, succ)
        # a device drafter with and without its next-round first draft step launched ahead (same engine)
        drafter = llm.engine.executor.worker.drafter
        variants = [(name, True)]
        if ahead_ab and spec is not None and spec["method"] != "ngram":
            variants.append((f"{name} (no ahead)", False))
        for b in batches:
            for label, ahead in variants:
                if drafter is not None:
                    drafter.ahead_max_rows = AHEAD_MAX_ROWS if ahead else 0
                r = {"config": label, **_measure(llm, b, max_tokens, vocab, prompts)}
                if name == "plain":
                    base[b] = r["tok_per_s"]
                r["speedup"] = r["tok_per_s"] / base[b]
                rows.append(r)
                print(json.dumps(r), flush=True)
                if out is not None:  # after every row: a run cut short keeps what it measured
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "spec_decode.json").write_text(json.dumps(rows, indent=2) + "\n")
                    (out / "spec_decode.md").write_text(table(rows) + "\n")
        if timeline and out is not None:
            _timeline(llm, name, vocab, prompts, out)
        llm.shutdown()
        del llm
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows."""
    lines = [
        "| config | batch | tok/s | speedup vs plain | acceptance | mean accepted length |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
        mal = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['tok_per_s']:.0f} | {r['speedup']:.2f}x | {acc} | {mal} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny checkpoint")
    ap.add_argument("--target", type=Path, default=None, help="checkpoint (default: a Qwen3-8B shape, dummy)")
    ap.add_argument("--draft", type=Path, default=None, help="draft (default: a Qwen3-0.6B shape, dummy)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--out", type=Path, default=None, help="write spec_decode.json and spec_decode.md here")
    ap.add_argument(
        "--configs", default=None, help="subset of ngram,draft,draft=target,layer_skip (plain always)"
    )
    ap.add_argument(
        "--constructed",
        type=float,
        default=None,
        metavar="AGREE",
        help="weights that walk a known permutation, drafts agreeing on this fraction (spec_constructed.py)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="also profile a batch-1 generate per engine into --out/timeline_<config>.md (GPU idle gaps)",
    )
    ap.add_argument(
        "--ahead-ab",
        action="store_true",
        help="device drafters also run with the next round's first draft step not launched ahead",
    )
    ns = ap.parse_args(argv)
    batches = [int(b) for b in ns.batches.split(",")]
    only = None if ns.configs is None else ns.configs.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    if ns.tiny:
        from layerzero.testing.checkpoints import build_checkpoint

        target = build_checkpoint("qwen3", tmp / "tiny", seed=0)
        rows = run(
            target,
            None,
            "cpu",
            torch.float32,
            [1, 4],
            16,
            ns.k,
            False,
            1,
            only,
            ns.out,
            ns.constructed,
            ns.timeline,
            ns.ahead_ab,
        )
    else:
        target = ns.target or _shape_dir(tmp, "qwen3-8b", QWEN3_8B)
        untied = {**QWEN3_0_6B, "tie_word_embeddings": False}  # a constructed draft needs its own LM head
        draft = ns.draft or _shape_dir(
            tmp, "qwen3-0.6b", untied if ns.constructed is not None else QWEN3_0_6B
        )
        layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
        dummy = ns.target is None
        rows = run(
            target,
            draft,
            "cuda",
            torch.bfloat16,
            batches,
            ns.max_tokens,
            ns.k,
            dummy,
            layers // 4,
            only,
            ns.out,
            ns.constructed,
            ns.timeline,
            ns.ahead_ab,
        )
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
