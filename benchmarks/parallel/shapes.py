"""Write config.json-only model directories of published shapes (Qwen3-0.6B, Qwen3-8B, Qwen3-30B-A3B)
for ``load_format="dummy"`` runs (issue 38's benchmarks: no checkpoint download, seeded random weights built
on the GPUs directly). The values are the published Hugging Face config.json fields the engine reads.

    python benchmarks/parallel/shapes.py --out /tmp/shapes   # qwen3-0.6b, qwen3-8b, qwen3-30b-a3b
    layerzero bench-engine --model /tmp/shapes/qwen3-8b --load-format dummy \
        --tensor-parallel-size 2 --hf-batch 0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
QWEN3_30B_A3B = {
    **QWEN3_0_6B,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def write(out: Path) -> list[Path]:
    """One directory per shape under ``out``, each holding only config.json; returns them."""
    dirs = []
    for name, cfg in SHAPES.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        dirs.append(d)
    return dirs


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    for d in write(ap.parse_args().out):
        print(d)
