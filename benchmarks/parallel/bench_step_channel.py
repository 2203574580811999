"""Host cost of the tensor-parallel step message (issue 38: "the step's batch goes to the other ranks each
step with a measured host cost"): rank 0 encodes each step's ``SchedulerOutput``, every worker decodes it.
Two codecs side by side in one process: the plain one (``to_dict`` + msgpack, then ``from_dict``: nested-list
block tables, every request's sampling parameters every step) and ``executor/step_codec.py`` (raw block
tables, parameters once per request). Decode steps of B rows, block tables 16 blocks wide per 256 tokens of
context, each request with its own seeded parameters; median of repeats, after a warm-up, in µs per step.

    python benchmarks/parallel/bench_step_channel.py --out benchmarks/results/parallel/step_channel.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from layerzero.engine.core.sched.output import SamplingMetadata, SchedulerOutput
from layerzero.engine.executor.channel import pack, unpack
from layerzero.engine.executor.step_codec import StepDecoder, StepEncoder
from layerzero.engine.sampling_params import SamplingParams


def decode_step(batch: int, width: int, params: list[SamplingParams]) -> SchedulerOutput:
    """A decode step of ``batch`` rows (one token each) with block tables ``width`` blocks wide."""
    return SchedulerOutput(
        req_ids=[f"req-{i}#{i}" for i in range(batch)],
        seq_ids=list(range(batch)),
        num_computed_tokens=[width * 16 - 1] * batch,
        num_scheduled_tokens=[1] * batch,
        new_token_ids=[[] for _ in range(batch)],
        pending_src=list(range(batch)),
        sample=[True] * batch,
        block_tables=np.arange(batch * width, dtype=np.int32).reshape(batch, width),
        sampling=SamplingMetadata(
            params=params[:batch],
            seeds=[p.seed for p in params[:batch]],
            num_output_tokens=[100] * batch,
            prompt_token_ids=[None] * batch,
            output_token_ids=[None] * batch,
        ),
    )


def _median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _cpu() -> tuple[str, str]:
    name, flags = platform.processor() or "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("?", "", "x86_64"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                keep = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
                flags = " ".join(f for f in line.split(":", 1)[1].split() if f in keep)
                break
    except OSError:
        pass
    return name, flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=30)
    ns = ap.parse_args()
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=512, seed=i) for i in range(512)]
    rows = []
    for batch, ctx in ((1, 256), (64, 2048), (256, 2048), (256, 4096)):
        width = ctx // 16
        out = decode_step(batch, width, params)
        plain_bytes = pack(["step", out.to_dict()])
        enc, dec = StepEncoder(), StepDecoder()
        dec.decode(enc.encode(out))  # the requests' first step: their parameters travel
        new_bytes = enc.encode(out)
        dec.decode(new_bytes)
        plain_enc = _median_us(lambda o=out: pack(["step", o.to_dict()]), ns.repeats)
        plain_dec = _median_us(lambda b=plain_bytes: SchedulerOutput.from_dict(unpack(b)[1]), ns.repeats)
        new_enc = _median_us(lambda o=out, e=enc: e.encode(o), ns.repeats)
        new_dec = _median_us(lambda b=new_bytes, d=dec: d.decode(b), ns.repeats)
        rows.append((batch, width, len(plain_bytes), plain_enc, plain_dec, len(new_bytes), new_enc, new_dec))
    name, flags = _cpu()
    import torch

    lines = [
        "# Tensor-parallel step message: host cost per step",
        "",
        f"`benchmarks/parallel/bench_step_channel.py`, {datetime.date.today()}, {name} ({flags}); "
        f"Python {platform.python_version()}, torch {torch.__version__}; median of {ns.repeats} after a "
        "warm-up, one process, no other load. Decode steps (one token per row), every request with its own "
        "seeded sampling parameters, in a steady state (each request's second step or later).",
        "",
        "| rows | table width (blocks) | plain bytes | plain encode µs | plain decode µs | step_codec bytes "
        "| step_codec encode µs | step_codec decode µs | encode + decode, plain / step_codec |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b, w, pb, pe, pd, nb, ne, nd in rows:
        lines.append(
            f"| {b} | {w} | {pb:,} | {pe:,.0f} | {pd:,.0f} | {nb:,} | {ne:,.0f} | {nd:,.0f} | "
            f"{(pe + pd) / (ne + nd):.1f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text)


if __name__ == "__main__":
    main()
