"""Quantization of the engine's linears (``LLM(quantization=...)``: weight-only int8 / int4 / fp8 and W8A8
fp8): memory, tokens/s and logprob drift.

For each of None / int8 / int4 / fp8 on one random Qwen3-shaped checkpoint (LM head sharpened like the test
checkpoints, so top-1 margins are not float noise):

- weight bytes: every parameter and buffer of the model, and those of the quantized linears alone;
- greedy agreement: the quantized engine's greedy tokens vs the unquantized ones (tokens equal before the
  first difference, summed over prompts, and positions equal);
- drift, teacher-forced: the quantized model runs the unquantized model's token sequences (prompt + its greedy
  output); over the generated positions, |log p_q(t) - log p(t)| of the token t the unquantized model chose
  (max and mean) and the share of positions whose argmax is unchanged;
- tokens/s: output tokens of ``--prompts`` greedy requests of ``--tokens`` tokens each, batched, best of
  ``--repeat`` (CPU: one dequantization per linear per step is included).

    python benchmarks/engine/bench_quantization.py [--device cpu] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time
from pathlib import Path

import torch

MODEL = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHARPEN = 3.0
SHAPES = {
    "small": MODEL,
    "qwen3-0.6b": {
        **MODEL,
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 4096,
    },
}
"""``--shape``: the small CPU model, or Qwen3-0.6B's published dimensions (untied LM head, random weights)."""


def build(directory: Path, seed: int = 0, shape: dict | None = None) -> Path:
    """A random Qwen3 checkpoint of :data:`MODEL`'s shape (norm weights perturbed, LM head x
    :data:`SHARPEN`)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**(shape or MODEL))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    f = directory / "model.safetensors"
    t = load_file(str(f))
    t["lm_head.weight"] = (t["lm_head.weight"] * SHARPEN).contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    return directory


def cpu_flags() -> str:
    """The CPU model name and its SIMD flags of interest (from /proc/cpuinfo; empty elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    keep = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return f"{name}; flags: {' '.join(keep)}"


def run(
    device: str,
    prompts: int,
    tokens: int,
    repeat: int,
    dtype: torch.dtype = torch.float32,
    shape: str = "small",
) -> list[dict]:
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.layers.quantized_linear import QuantizedLinear
    from layerzero.engine.tools.drift import teacher_forced_logprobs, weight_bytes

    g = torch.Generator().manual_seed(0)
    batch = [
        [1, *torch.randint(3, MODEL["vocab_size"], (int(n),), generator=g).tolist()]
        for n in torch.randint(8, 33, (prompts,), generator=g)
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "ckpt", shape=SHAPES[shape])
        for q in (None, "int8", "int4", "fp8", "fp8_w8a8"):
            llm = LLM(
                str(path),
                device=device,
                dtype=dtype,
                max_model_len=256,
                num_kv_blocks=max(256, prompts * 16),
                enable_prefix_caching=False,
                quantization=q,
            )
            model = llm.engine.runner.model
            lin = sum(
                m.weight.numel() * m.weight.element_size() if q is None else m.qtensor().nbytes
                for n, m in model.named_modules()
                if type(m).__name__ in ("Linear", "QuantizedLinear") and not n.endswith("lm_head")
            )
            outs = llm.generate(batch, sp, use_tqdm=False)  # warm-up, and the tokens
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                llm.generate(batch, sp, use_tqdm=False)
                best = min(best, time.perf_counter() - t0)
            toks = [list(o.outputs[0].token_ids) for o in outs]
            if ref is None:
                ref = toks
            pairs = list(zip(toks, ref, strict=True))
            prefix = sum(
                next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                for x, y in pairs
            )
            equal = sum(a == b for x, y in zip(toks, ref, strict=True) for a, b in zip(x, y, strict=True))
            drift, same = [], 0
            if q is not None:
                base = rows[0]["_llm"]
                for p, out in zip(batch, ref, strict=True):
                    seq = p + out
                    lp, lq = (teacher_forced_logprobs(m, seq).double().cpu() for m in (base, llm))
                    pos = torch.arange(len(p) - 1, len(seq) - 1)
                    chosen = torch.tensor(out)
                    drift.append((lq[pos, chosen] - lp[pos, chosen]).abs())
                    same += int((lq[pos].argmax(-1) == chosen).sum())
            d = torch.cat(drift) if drift else torch.zeros(1, dtype=torch.float64)
            rows.append(
                {
                    "quantization": q or f"none ({str(dtype).removeprefix('torch.')})",
                    "model_mib": weight_bytes(llm) / 2**20,
                    "linear_mib": lin / 2**20,
                    "layers": sum(isinstance(m, QuantizedLinear) for m in model.modules()),
                    "prefix": prefix,
                    "equal": equal,
                    "total": prompts * tokens,
                    "tf_same": same if q else prompts * tokens,
                    "drift_max": float(d.max()),
                    "drift_mean": float(d.mean()),
                    "tok_s": prompts * tokens / best,
                    "_llm": llm if q is None else None,
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    out = [
        "| quantization | model MiB | decoder linears MiB (x smaller) | greedy tokens equal: before 1st diff "
        "/ all | teacher-forced argmax kept | chosen-token \\|dlogprob\\| max / mean | tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['quantization']} | {r['model_mib']:.2f} | {r['linear_mib']:.2f} "
            f"({base['linear_mib'] / r['linear_mib']:.2f}x) | {r['prefix']} / {r['equal']} of {r['total']} | "
            f"{r['tf_same']} of {r['total']} | {r['drift_max']:.4f} / {r['drift_mean']:.4f} | "
            f"{r['tok_s']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the model dtype (the unquantized baseline and the activations)",
    )
    ap.add_argument("--shape", choices=tuple(SHAPES), default="small")
    ap.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    ap.add_argument(
        "--lock",
        action="append",
        default=[],
        help="op=kernel_id for every run (repeatable), e.g. quantized_linear=triton.quantized_linear "
        "(the fused low-bit GEMM)",
    )
    a = ap.parse_args(argv)
    import layerzero as lz

    for item in a.lock:
        op, _, kernel = item.partition("=")
        lz.lock(op, kernel)
    rows = run(a.device, a.prompts, a.tokens, a.repeat, getattr(torch, a.dtype), a.shape)
    shape = SHAPES[a.shape]
    cfg = ", ".join(
        f"{k}={shape[k]}"
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    )
    gpu = f", {torch.cuda.get_device_name()}" if a.device.startswith("cuda") else ""
    head = [
        f"# Engine weight-only quantization ({a.device}{gpu}, {a.dtype} activations)",
        "",
        f"- date: {datetime.date.today()}; torch {torch.__version__}; threads {torch.get_num_threads()}",
        f"- machine: {platform.machine()}, {cpu_flags()}",
        f"- model: random Qwen3 ({cfg}), LM head x{SHARPEN}; {a.prompts} greedy prompts of 9-33 tokens x "
        f"{a.tokens} output tokens, batched; tokens/s best of {a.repeat}",
        f"- locks: {', '.join(a.lock) or 'none (default kernels)'}",
        "",
    ]
    report = "\n".join([*head, table(rows), ""])
    print(report)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
