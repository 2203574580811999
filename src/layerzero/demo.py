"""Demo: real (tiny) Hugging Face models, stock transformers vs LayerZero, side by side.

For each family (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, or ``--family``) it builds a tiny model with
seeded weights, saves it as safetensors, loads it twice (stock ``"sdpa"``; ``"layerzero"`` +
:func:`layerzero.integrations.transformers.patch_model`), and prints which LayerZero kernel served each op
(from :func:`layerzero.trace`), the logits relative error, whether greedy tokens are identical, and times.
Exit code 0 when every family matches, 1 otherwise, 2 on bad arguments. Needs ``transformers``.

    python -m layerzero.demo
    python -m layerzero.demo --family llama --new-tokens 16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

OPS = ("attention", "rms_norm", "rope")


@dataclass(frozen=True, slots=True)
class FamilyResult:
    """One row of the demo table.

    Attributes:
        family: model family (= ``config.model_type``).
        kernels: op -> ``"kernel_id x calls"`` entries (``"-"`` when the op never ran through LayerZero).
        rel_error: max |lz - stock| / max |stock| of the logits over real (non-pad) tokens, unitless.
        tokens_equal: the greedy continuations are identical.
        stock_ms, lz_ms: wall time of ``generate`` in milliseconds.
    """

    family: str
    kernels: dict[str, str]
    rel_error: float
    tokens_equal: bool
    stock_ms: float
    lz_ms: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """Parity holds and every op was served by LayerZero."""
        return (
            self.tokens_equal
            and self.rel_error <= self.tolerance
            and all(v != "-" for v in self.kernels.values())
        )


def _kernels(counts: dict[tuple[str, str], int]) -> dict[str, str]:
    out: dict[str, str] = {}
    for op in OPS:
        served = sorted(((n, kid) for (o, kid), n in counts.items() if o == op), reverse=True)
        out[op] = ", ".join(f"{kid} x{n}" for n, kid in served) or "-"
    return out


def run_family(
    family: str, *, new_tokens: int = 32, seed: int = 0, tolerance: float = 1e-5, workdir: Path | None = None
) -> FamilyResult:
    """Build, save, load and compare one family; see the module docstring.

    Args:
        family: one of ``layerzero.testing.hf_models.MODEL_FAMILIES``.
        new_tokens: greedy tokens to generate (exactly this many: min = max).
        seed: weight seed.
        tolerance: allowed logits relative error.
        workdir: where to save the checkpoint (a temporary directory when None).

    Raises:
        ConfigurationError: unknown family or transformers missing/too old.
    """
    import layerzero as lz
    from layerzero.integrations.transformers import patch_model
    from layerzero.testing import hf_models

    with tempfile.TemporaryDirectory(prefix=f"lz-demo-{family}-") as tmp:
        path = hf_models.build_and_save(family, (workdir or Path(tmp)) / family, seed=seed)
        stock = hf_models.load(family, path, attn_implementation="sdpa")
        model = hf_models.load(family, path, attn_implementation="layerzero")
    batch = hf_models.padded_batch()
    position_ids = hf_models.left_padded_position_ids(batch["attention_mask"])
    gen = {"do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    with torch.no_grad():  # warm-up, so neither timing pays first-call costs
        stock(**batch)
        model(**batch)
    # Stock first and unpatched: the RoPE swap is module-wide and would also serve the stock model.
    with torch.no_grad():
        want = stock(**batch, position_ids=position_ids).logits
    stock.generate(**batch, **gen)  # untimed: both timings are steady state (LayerZero's selections cached)
    t0 = time.perf_counter()
    want_tokens = stock.generate(**batch, **gen)
    stock_ms = (time.perf_counter() - t0) * 1e3
    with patch_model(model):
        model.generate(**batch, **gen)
        with lz.trace() as tr:
            with torch.no_grad():
                got = model(**batch, position_ids=position_ids).logits
            t0 = time.perf_counter()
            got_tokens = model.generate(**batch, **gen)
            lz_ms = (time.perf_counter() - t0) * 1e3
    return FamilyResult(
        family=family,
        kernels=_kernels(dict(tr.counts)),
        rel_error=hf_models.masked_rel_error(want, got, batch["attention_mask"]),
        tokens_equal=bool(torch.equal(want_tokens, got_tokens)),
        stock_ms=stock_ms,
        lz_ms=lz_ms,
        tolerance=tolerance,
    )


_HEADERS = ("family", "attention", "rms_norm", "rope", "logits rel. err", "greedy equal", "stock ms", "lz ms")


def _rows(results: Sequence[FamilyResult]) -> list[tuple[str, ...]]:
    return [
        (
            r.family,
            *(r.kernels[op] for op in OPS),
            f"{r.rel_error:.1e}",
            "yes" if r.tokens_equal else "NO",
            f"{r.stock_ms:.0f}",
            f"{r.lz_ms:.0f}",
        )
        for r in results
    ]


def render(results: Sequence[FamilyResult], *, use_rich: bool = True) -> str:
    """The results as a table: rich when installed and ``use_rich``, else aligned plain text."""
    rows = _rows(results)
    if use_rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            use_rich = False
        else:
            table = Table(title="LayerZero vs stock transformers (float32, CPU)")
            for header in _HEADERS:
                table.add_column(header)
            for row in rows:
                table.add_row(*row)
            console = Console(width=200, record=True)
            with console.capture() as capture:
                console.print(table)
            return capture.get()
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(_HEADERS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(_HEADERS, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo. Returns 0 when every family matches stock transformers, 1 otherwise."""
    from layerzero.testing.hf_models import MODEL_FAMILIES

    parser = argparse.ArgumentParser(prog="python -m layerzero.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family", action="append", choices=MODEL_FAMILIES, help="model family (repeatable); default: all"
    )
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens to generate (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--tolerance", type=float, default=1e-5, help="allowed logits rel. error (default 1e-5)"
    )
    parser.add_argument("--plain", action="store_true", help="plain-text table even when rich is installed")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error(f"--new-tokens: expected >= 1, got {args.new_tokens}")

    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        print("The demo needs transformers >= 4.56: pip install 'transformers>=4.56'")
        return 1
    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    hf_logging.disable_progress_bar()
    try:
        results = [
            run_family(f, new_tokens=args.new_tokens, seed=args.seed, tolerance=args.tolerance)
            for f in (args.family or MODEL_FAMILIES)
        ]
    finally:
        if not bars_were_off:
            hf_logging.enable_progress_bar()
    print(render(results, use_rich=not args.plain), end="")
    failed = [r.family for r in results if not r.ok]
    print("parity: OK" if not failed else f"parity: FAILED for {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
