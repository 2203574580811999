"""Weight loading from safetensors per GPU at tensor-parallel sizes 1 and N (issue 38: >= 2 GB/s per GPU from
page-cached files). Writes a Qwen3-8B-shaped checkpoint with seeded random bf16 weights (``--layers`` of its
36 decoder layers; Hugging Face's tensor names, 4 GB shards), reads every file once so the page cache holds
it, then starts the engine at each size and reports rank 0's ``weights_bytes`` / ``weights_load_s``
(``LLM.stats()``: the shard this rank reads, from the files to the GPU, synchronised).

    PYTHONPATH=src:benchmarks python benchmarks/parallel/bench_weight_load.py --tp 1 2 --out DIR

Writes ``DIR/weight_load.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHARD_BYTES = 4 << 30


def write_checkpoint(out: Path, layers: int) -> Path:
    """A Qwen3-8B-shaped checkpoint of ``layers`` layers under ``out`` (config.json + shards + index)."""
    from parallel.shapes import QWEN3_8B
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": layers})
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3ForCausalLM(cfg).state_dict().items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    size = n = 0

    def flush() -> None:
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard, size, n = {}, 0, n + 1

    for k, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        if k.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.uniform_(-0.05, 0.05, generator=gen)
        shard[k] = t.cpu()
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    cfg.save_pretrained(str(out))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return out


def page_cache(path: Path) -> int:
    """Read every safetensors file of ``path`` once (into the page cache); returns the bytes read."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen3-8b-ckpt"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from layerzero.engine import LLM

    t0 = time.perf_counter()
    write_checkpoint(a.ckpt, a.layers)
    wrote = time.perf_counter() - t0
    t0 = time.perf_counter()
    file_bytes = page_cache(a.ckpt)
    cached = time.perf_counter() - t0
    rows = []
    for tp in a.tp:
        llm = LLM(
            str(a.ckpt),
            device="cuda",
            dtype=torch.bfloat16,
            tensor_parallel_size=tp,
            max_model_len=1024,
            max_num_seqs=8,
            enforce_eager=True,
            warmup=False,
        )
        st = llm.stats()
        llm.shutdown()
        rows.append(
            {
                "tp": tp,
                "weights_bytes": st["weights_bytes"],
                "weights_load_s": st["weights_load_s"],
                "gb_per_s": st["weights_bytes"] / 1e9 / st["weights_load_s"],
                "startup_s": st["startup_s"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "checkpoint_bytes": file_bytes,
        "layers": a.layers,
        "write_s": wrote,
        "page_cache_read_s": cached,
    }
    (a.out / "weight_load.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Weight loading, Qwen3-8B shape ({a.layers} layers, {file_bytes / 1e9:.2f} GB), {meta['gpu']}, "
        f"{meta['date']}",
        "",
        f"torch {meta['torch']}. Files page-cached first (read at {file_bytes / 1e9 / cached:.1f} GB/s). "
        "Rank 0's shard, from the files to its GPU.",
        "",
        "| TP | GB per GPU | load s | GB/s per GPU | engine start-up s |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['tp']} | {r['weights_bytes'] / 1e9:.2f} | {r['weights_load_s']:.2f} | {r['gb_per_s']:.2f} | "
        f"{r['startup_s']:.1f} |"
        for r in rows
    ]
    (a.out / "weight_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
