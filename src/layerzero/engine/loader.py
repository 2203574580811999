"""Checkpoint directory -> model weights: ``*.safetensors`` (one file or a sharded index), streamed one tensor
at a time with ``safetensors`` (no pickle, no remote code), converted to the engine's dtype and device."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from .errors import bad_config

__all__ = ["iter_weights", "load_model_weights", "safetensors_files"]


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of ``model.safetensors.index.json`` when present, else every
    ``*.safetensors`` in the directory (sorted).

    Raises:
        ConfigurationError: none found (e.g. a ``.bin``-only checkpoint: convert it to safetensors).
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise bad_config("checkpoint weights", "*.safetensors files (or model.safetensors.index.json)",
                         f"none in {path}", "Pickled .bin checkpoints are not loaded; save with safetensors.")
    return files


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of every tensor of the checkpoint, one at a time (memory: one tensor)."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_model_weights(model: nn.Module, path: str | Path) -> None:
    """Load the checkpoint at ``path`` into ``model`` (its ``load_weights``). Every parameter is first filled
    with NaN, so a tensor the checkpoint lacks (or a packed shard or expert it lacks) is found afterwards.

    Raises:
        ConfigurationError: an unknown or mis-shaped tensor, or parameters the checkpoint did not fill.
    """
    for p in model.parameters():
        p.fill_(float("nan"))
    model.load_weights(iter_weights(path))
    missing = [n for n, p in model.named_parameters() if bool(torch.isnan(p).any())]
    if missing:
        raise bad_config("checkpoint", "a tensor for every parameter", f"{len(missing)} not (fully) filled: "
                         f"{missing[:5]}", "The checkpoint is incomplete or of another architecture.")
