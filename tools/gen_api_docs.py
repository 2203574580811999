"""Write docs/api.md from the docstrings of the public API (``python tools/gen_api_docs.py``)."""

from __future__ import annotations

import inspect
from pathlib import Path

import layerzero as lz

SECTIONS = {
    "Ops": [],  # every op not in another section, in definition order (derived from lz.ops.OPDEFS below)
    "Quantization (docs/quantization.md)": ["quantize", "dequantize", "quantized_linear", "fp8_linear"],
    "Tokenization (docs/tokenization.md)": ["tokenize", "detokenize", "IncrementalDetokenizer"],
    "Sampling distribution and seeded streams (docs/decoding.md)": [
        "sampling_probs",
        "seeded_exponential",
        "seeded_uniform",
    ],
    "Paged KV cache (serving)": [
        "paged_attention",
        "reshape_and_cache",
        "qk_norm_rope_cache",
        "rope_paged_attention",
        "allocate_kv_cache",
    ],
    "Configuration and policy": [
        "configure",
        "get_config",
        "load_config",
        "reload",
        "lock",
        "unlock",
        "get_locks",
        "prefer",
        "disabled",
        "load_capabilities",
    ],
    "Inspection": ["select", "explain", "which", "validate", "list_kernels", "trace", "doctor"],
    "Kernels and tuning": [
        "register_kernel",
        "kernel",
        "unregister_kernel",
        "tune",
        "configure_knobs",
        "knobs",
        "get_knobs",
        "reset_knobs",
    ],
    "Block planning (docs/block_planning.md)": ["plan_block", "BlockPlan", "BlockOp"],
    "CUDA graphs": ["is_graph_safe", "warmup", "validate_graph_capture"],
    "Offline plans and readiness (docs/planning.md)": [
        "solve",
        "DispatchTable",
        "load_table",
        "install_table",
        "uninstall_table",
        "compile",
        "uncompile",
        "dry_run",
        "readiness_check",
        "Manifest",
        "load_manifest",
    ],
    "Integrations": ["patch_model", "patch_diffusers", "register_hub_kernel"],
    "Distributed (lz.distributed, docs/distributed.md)": [
        "distributed.sync_selection",
        "distributed.unsync",
        "distributed.current",
    ],
}
_ELSEWHERE = {name for names in SECTIONS.values() for name in names}
SECTIONS["Ops"] = [
    d.public.__name__ for d in lz.ops.OPDEFS if d.public is not None and d.public.__name__ not in _ELSEWHERE
]


def render() -> str:
    """The markdown text of docs/api.md."""
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `tools/gen_api_docs.py`; `import layerzero as lz`.",
        "",
    ]
    for title, names in SECTIONS.items():
        out += [f"## {title}", ""]
        for name in names:
            obj = lz
            for part in name.split("."):
                obj = getattr(obj, part)
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            out += [f"### `lz.{name}{sig}`", "", inspect.cleandoc(obj.__doc__ or ""), ""]
    out += ["## Errors", ""]
    for name in (
        "LayerZeroError",
        "InvalidInputError",
        "NoKernelFoundError",
        "KernelExecutionError",
        "PolicyValidationError",
        "BackendNotAvailableError",
        "ConfigurationError",
        "UnknownOperationError",
        "UnknownKernelError",
        "CudaGraphUnsafeError",
        "SelectionTimeoutError",
        "CacheCorruptionError",
        "DistributedMismatchError",
        "DistributedSelectionError",
        "TableMismatchError",
    ):
        cls = getattr(lz, name)
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        out += [f"- `{name}({bases})`: {inspect.cleandoc(cls.__doc__ or '').splitlines()[0]}"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    Path(__file__).resolve().parents[1].joinpath("docs", "api.md").write_text(render(), encoding="utf-8")
