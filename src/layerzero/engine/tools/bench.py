"""``layerzero bench-engine``: nano-vllm's throughput benchmark on a Qwen3-0.6B-shaped checkpoint, side by
side with transformers' batched ``generate`` and the memory roofline.

The workload is nano-vllm's ``bench.py`` exactly: ``random.seed(0)``; 256 requests; prompt lengths
``randint(100, 1024)`` of token ids ``randint(0, 10000)``; ``max_tokens = randint(100, 1024)``;
``ignore_eos``; temperature 0.6; one warm-up request first; output tokens / wall seconds. ``--scale cpu``
shrinks the model and the workload for a CPU (same generator, smaller bounds). The roofline replays the run's
decode steps with every unfinished request in the batch and charges each step the weights plus the KV read by
every request, at the device's measured copy bandwidth; prefill (compute bound) is not charged, so the bound
is optimistic.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "QWEN3_0_6B",
    "SCALES",
    "Workload",
    "copy_bandwidth",
    "default_checkpoint",
    "make_workload",
    "roofline_tokens_per_s",
    "run",
]

QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
"""The published Qwen/Qwen3-0.6B config.json (weights here are random)."""
SCALES: dict[str, dict[str, Any]] = {
    "full": {"model": {}, "num_seqs": 256, "max_input": 1024, "max_output": 1024, "min_len": 100},
    "cpu": {
        "model": {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 10240,
            "bos_token_id": 10238,
            "eos_token_id": 10239,
        },  # in the smaller vocabulary (ModelConfig checks)
        "num_seqs": 16,
        "max_input": 96,
        "max_output": 48,
        "min_len": 16,
    },
}


@dataclass(frozen=True)
class Workload:
    """The requests: prompt token ids and max_tokens of each."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        """Tokens the run generates (ignore_eos: exactly the max_tokens)."""
        return sum(self.max_tokens)


def make_workload(scale: str = "full") -> Workload:
    """nano-vllm's requests (see the module docstring), drawn with ``random.seed(0)`` in its order."""
    s = SCALES[scale]
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(s["min_len"], s["max_input"]))]
        for _ in range(s["num_seqs"])
    ]
    max_tokens = [random.randint(s["min_len"], s["max_output"]) for _ in range(s["num_seqs"])]
    return Workload(prompts, max_tokens)


def build_checkpoint(directory: Path, scale: str, dtype: torch.dtype) -> Path:
    """A Qwen3-0.6B-shaped checkpoint (scaled by ``scale``) with seeded random weights, written once."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    want = {**QWEN3_0_6B, **SCALES[scale]["model"]}
    if (directory / "config.json").is_file():
        try:
            have = json.loads((directory / "config.json").read_text())
        except ValueError:
            have = {}
        if isinstance(have, dict) and have.get("eos_token_id") == want["eos_token_id"]:
            # else written by an older version (EOS outside the scaled vocabulary): write it again
            return directory
    cfg = Qwen3Config(**want)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    model.save_pretrained(str(directory))
    return directory


def default_checkpoint(scale: str, dtype: torch.dtype) -> Path:
    """The benchmark's checkpoint of ``scale`` under ``~/.cache/layerzero/qwen3-0.6b-<scale>`` (built once by
    :func:`build_checkpoint`)."""
    return build_checkpoint(Path.home() / ".cache" / "layerzero" / f"qwen3-0.6b-{scale}", scale, dtype)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a ``nbytes`` buffer, best of 5)."""
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * x.element_size() / best


def roofline_tokens_per_s(w: Workload, weight_bytes: int, kv_bytes_per_token: int, bandwidth: float) -> float:
    """Output tokens / s if every decode step only moved the weights and the batch's KV at ``bandwidth``."""
    ctx = [len(p) for p in w.prompts]
    left = list(w.max_tokens)
    seconds = 0.0
    while any(left):
        live = [i for i, n in enumerate(left) if n > 0]
        seconds += (weight_bytes + kv_bytes_per_token * sum(ctx[i] for i in live)) / bandwidth
        for i in live:
            ctx[i] += 1
            left[i] -= 1
    return w.output_tokens / seconds


def _hf_throughput(
    path: Path, w: Workload, device: torch.device, dtype: torch.dtype, batch: int
) -> dict[str, Any]:
    """transformers' batched greedy-free sampling ``generate`` (left padded, its default cache) over the first
    ``batch`` requests, all at once: output tokens / s."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    reqs = list(zip(w.prompts[:batch], w.max_tokens[:batch], strict=True))
    width = max(len(p) for p, _ in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    new = max(n for _, n in reqs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=0.6,
            top_k=0,
            pad_token_id=0,
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    useful = sum(n for _, n in reqs)
    return {
        "requests": len(reqs),
        "seconds": took,
        "output_tokens_per_s": useful / took,
        "note": "batched generate runs every request to the longest max_tokens; only each request's own "
        "max_tokens count as output",
    }


def _batch1(llm: Any, dev: torch.device, prompt: list[int], new: int) -> dict[str, Any]:
    """One request alone (greedy, ``new`` tokens after its prompt), the latency-bound case that CUDA-graph
    decode exists for: ``output_tokens_per_s`` over the whole ``generate`` (time to the first token included),
    and ``decode_tokens_per_s``, the tokens after the first over the time after it, from a streamed run
    (``LLM.stream``, whose deltas arrive as the steps finish): the per-step rate the issue's batch-1 target is
    about."""
    from .. import SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new)
    llm.generate([prompt], sp, use_tqdm=False)  # its shapes warm
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    took = time.perf_counter() - t0
    stamps = []  # (seconds since the start, output tokens so far) per streamed delta
    t1, got = time.perf_counter(), 0
    for delta in llm.stream(prompt, sp):
        got += len(delta.outputs[0].token_ids)
        stamps.append((time.perf_counter() - t1, got))
    (t_first, n_first), (t_last, n_last) = stamps[0], stamps[-1]
    decode = (n_last - n_first) / (t_last - t_first) if t_last > t_first else float("nan")
    return {
        "prompt_tokens": len(prompt),
        "output_tokens": new,
        "seconds": took,
        "output_tokens_per_s": new / took,
        "first_token_ms": t_first * 1e3,
        "decode_tokens_per_s": decode,
    }


def run(
    *,
    scale: str = "full",
    model: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    hf_batch: int = 64,
    out: Path | None = None,
    enforce_eager: bool = False,
    engine_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns (and with ``out`` writes ``bench_engine.json``) the results.
    ``engine_options``: more :class:`~layerzero.engine.LLM` keyword arguments (e.g.
    ``async_scheduling=False``)."""
    from .. import LLM, SamplingParams

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = {
        "auto": torch.bfloat16 if dev.type == "cuda" else torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
    }[dtype]
    path = Path(model) if model else default_checkpoint(scale, dt)
    w = make_workload(scale)
    llm = LLM(
        path,
        device=str(dev),
        dtype=dt,
        enforce_eager=enforce_eager,
        max_model_len=max(len(p) for p in w.prompts) + max(w.max_tokens) + 16,
        **(engine_options or {}),
    )
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up (nano-vllm does one)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in w.max_tokens]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(w.prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    stats = llm.stats()
    batch1 = _batch1(llm, dev, w.prompts[0][:256], 512 if scale == "full" else 32)
    cfg = llm.engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dt.itemsize
    bw = copy_bandwidth(dev, 1 << 28 if dev.type == "cpu" else 1 << 30)
    roof = roofline_tokens_per_s(w, weight_bytes, kv_token, bw)
    res = {
        "scale": scale,
        "device": str(dev),
        "dtype": str(dt),
        "requests": len(w.prompts),
        "output_tokens": w.output_tokens,
        "seconds": took,
        "output_tokens_per_s": w.output_tokens / took,
        "roofline_tokens_per_s": roof,
        "fraction_of_roofline": w.output_tokens / took / roof,
        "copy_bandwidth_gb_s": bw / 1e9,
        "batch1": batch1,
        "weight_bytes": weight_bytes,
        "engine_stats": stats,
        "workload": asdict(w) | {"prompts": None},
    }
    llm.shutdown()  # the TP workers and the process group too
    del llm
    if hf_batch:
        res["transformers"] = _hf_throughput(path, w, dev, dt, min(hf_batch, len(w.prompts)))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_engine.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    return res
