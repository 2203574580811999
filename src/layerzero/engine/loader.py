"""Checkpoint directory -> model weights and tokenizer: ``*.safetensors`` (one file or a sharded index),
streamed one tensor at a time with ``safetensors`` (no pickle, no remote code), converted to the engine's
dtype and device; the tokenizer with transformers' ``AutoTokenizer``. Every way a checkpoint can be broken (a
truncated or missing file, a weight of the wrong dtype or with NaN/Inf) is a ``ConfigurationError`` naming the
file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import layerzero as lz

from .config import ModelConfig, read_json_object
from .errors import bad_config

__all__ = [
    "WEIGHT_DTYPES",
    "LazySlice",
    "iter_weights",
    "load_dummy_weights",
    "load_model_weights",
    "load_tokenizer",
    "safetensors_files",
]

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Dtypes a checkpoint tensor may have (each is converted to the engine's dtype); anything else (integers,
fp8: pre-quantized data needing scales) is refused rather than cast."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_REDOWNLOAD = (
    "The file is truncated or corrupted (an interrupted download? a git-lfs pointer?): download it again."
)


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of ``model.safetensors.index.json`` when present, else every
    ``*.safetensors`` in the directory (sorted).

    Raises:
        ConfigurationError: none found (e.g. a ``.bin``-only checkpoint: convert it to safetensors); an index
            that is not JSON, has no ``weight_map`` of file names, or names a shard that is not in the
            directory.
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wmap = read_json_object(index, "a JSON object with a 'weight_map' (tensor name -> shard file)").get(
            "weight_map"
        )
        if not isinstance(wmap, dict) or not wmap or not all(isinstance(f, str) and f for f in wmap.values()):
            raise bad_config(
                f"weight_map in {index}",
                "a non-empty object of tensor name -> shard file name",
                repr(wmap)[:80],
                _REDOWNLOAD,
            )
        files = sorted({path / f for f in wmap.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise bad_config(
                f"shards named by {index}",
                "every shard file in the checkpoint directory",
                f"{len(missing)} of {len(files)} missing: {missing[:5]}",
                "The download is incomplete: download the missing shards.",
            )
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise bad_config(
            "checkpoint weights",
            "*.safetensors files (or model.safetensors.index.json)",
            f"none in {path}",
            "Pickled .bin checkpoints are not loaded; save with safetensors.",
        )
    return files


def _open(file: Path) -> Any:
    """``safe_open`` of ``file`` on the CPU, its errors (truncated, corrupted, unreadable) as
    ConfigurationError."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors' SafetensorError (not exported under one name), OSError
        raise bad_config(
            f"safetensors file {file}",
            "a complete safetensors file",
            f"{type(exc).__name__}: {exc}",
            _REDOWNLOAD,
        ) from exc


def _unreadable(what: str, exc: Exception, expected: str = "a readable tensor") -> Exception:
    """The ConfigurationError of a tensor (or part of one) safetensors could not read."""
    return bad_config(what, expected, f"{type(exc).__name__}: {exc}", _REDOWNLOAD)


def _tensor(f: Any, name: str, file: Path) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as exc:  # as _open
        raise _unreadable(f"tensor {name} of safetensors file {file}", exc) from exc


def _tensors(path: str | Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, name, CPU tensor) of every tensor of the checkpoint, dtypes checked (see
    :func:`iter_weights`)."""
    for file in safetensors_files(path):
        with _open(file) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = _tensor(f, name, file)
                if tensor.dtype not in WEIGHT_DTYPES:
                    raise _bad_dtype(name, file, tensor.dtype)
                yield file, name, tensor


_SLICE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
"""safetensors' dtype names of :data:`WEIGHT_DTYPES`."""


class LazySlice:
    """A checkpoint tensor not read yet (``safe_open(...).get_slice``): ``shape``, ``dtype``, and indexing
    (``t[a:b]``, ``t[:, a:b]``, ``t[:]``) that reads only the indexed part from the file, as a CPU tensor. A
    tensor-parallel rank's layers index it for their shard (:mod:`..parallel.layers`)."""

    def __init__(self, f: Any, name: str, file: Path) -> None:
        self.name, self.file = name, file
        try:
            self._slice = f.get_slice(name)
            self.shape = tuple(self._slice.get_shape())
            code = self._slice.get_dtype()
        except Exception as exc:  # as _open
            raise _unreadable(f"tensor {name} of safetensors file {file}", exc) from exc
        if code not in _SLICE_DTYPES:
            raise _bad_dtype(name, file, code)
        self.dtype = _SLICE_DTYPES[code]

    def __getitem__(self, index: Any) -> torch.Tensor:
        try:
            return self._slice[index]
        except Exception as exc:  # as _open
            what = f"tensor {self.name}{list(self.shape)} of safetensors file {self.file}, part {index!r}"
            raise _unreadable(what, exc, "a readable slice") from exc


def _bad_dtype(name: str, file: Path, dtype: Any) -> Exception:
    return bad_config(
        f"tensor {name} of {file}",
        f"a float dtype ({', '.join(str(d) for d in WEIGHT_DTYPES)})",
        str(dtype),
        "The engine loads float checkpoints only (no integer or pre-quantized tensors; "
        "LLM(quantization=...) quantizes at load time).",
    )


def _slices(path: str | Path) -> Iterator[tuple[Path, str, LazySlice]]:
    """(file, name, :class:`LazySlice`) of every tensor of the checkpoint, dtypes checked, nothing read yet
    (each slice is valid until the next one is yielded: its file stays open that long)."""
    for file in safetensors_files(path):
        with _open(file) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield file, name, LazySlice(f, name, file)


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of every tensor of the checkpoint, one at a time (memory: one tensor).

    Raises:
        ConfigurationError: see :func:`safetensors_files`; a file safetensors cannot read (truncated,
            corrupted); a tensor whose dtype is not one of :data:`WEIGHT_DTYPES` (names the tensor and the
            file).
    """
    for _, name, tensor in _tensors(path):
        yield name, tensor


def _check_finite(path: str | Path) -> None:
    """Raise for the first checkpoint tensor with a NaN or Inf (a second read: only on the failure path)."""
    for file, name, t in _tensors(path):
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            raise bad_config(
                f"tensor {name} of {file}",
                "finite values",
                f"{int((~finite).sum())} of {t.numel()} non-finite values (NaN/Inf)",
                "The checkpoint is corrupted (or was saved after training diverged).",
            )


@torch.no_grad()
def load_model_weights(model: nn.Module, path: str | Path) -> None:
    """Load the checkpoint at ``path`` into ``model`` (its ``load_weights``). Every parameter is first filled
    with NaN, so a tensor the checkpoint lacks (or a packed shard or expert it lacks) is found afterwards; a
    parameter that is not finite then is explained by reading the checkpoint again for NaN/Inf values.

    A tensor-parallel model (``model.parallel.tp_size > 1``) gets each tensor as a :class:`LazySlice`: its
    layers read only this rank's shard from the file (``get_slice``, then the slice), copied to the model's
    device; replicated tensors are read whole.

    Raises:
        ConfigurationError: see :func:`iter_weights`; an unknown or mis-shaped tensor; a tensor with NaN/Inf
            values (names the tensor and the file); parameters the checkpoint did not fill; values that
            overflow the engine's dtype.
    """
    for p in model.parameters():
        p.fill_(float("nan"))
    at: list[tuple[Path, str]] = []  # the tensor being loaded, for the message of a mismatch the model finds
    parallel = getattr(model, "parallel", None)
    source: Any = _slices if parallel is not None and parallel.tp_size > 1 else _tensors

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for file, name, tensor in source(path):
                at[:] = [(file, name)]
                yield name, tensor
        except lz.ConfigurationError:  # reading failed: the message names the file already
            at.clear()
            raise

    try:
        cast(Any, model).load_weights(tracked())  # the engine's models' loader (models/llama.py)
    except lz.ConfigurationError as exc:
        if not at:
            raise
        raise lz.ConfigurationError(f"{exc} (loading tensor {at[0][1]} of {at[0][0]})") from exc
    bad = [(n, p) for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if not bad:
        return
    _check_finite(path)
    missing = [n for n, p in bad if bool(torch.isnan(p).any())]
    if missing:
        raise bad_config(
            "checkpoint",
            "a tensor for every parameter",
            f"{len(missing)} not (fully) filled: {missing[:5]}",
            "The checkpoint is incomplete or of another architecture.",
        )
    dtype = bad[0][1].dtype
    raise bad_config(
        "checkpoint values",
        f"finite in {dtype}",
        f"Inf in {[n for n, _ in bad][:5]} after conversion",
        "The checkpoint's values overflow this dtype: load it in float32 or bfloat16.",
    )


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill ``model`` with seeded random weights on its own device, no checkpoint read (vLLM's
    ``load_format="dummy"``: benchmark a shape without its weights). Norm weights are 1 and every other
    parameter uniform in [-0.05, 0.05], so activations stay finite at any depth; the values are not a trained
    model's. Each parameter is drawn from a generator seeded with ``seed`` plus a stable hash of its name.

    Tensor parallel (``model.parallel``): a parameter holding this rank's shard (tagged ``tp_shard`` by the
    parallel layers) adds ``tp_rank * 1_000_003`` to its seed, so the ranks' shards differ; replicated
    parameters (norms, the MoE router, a row-parallel bias) get the same values on every rank, as they must
    (every rank routes the same way). The ranks' shards together are not the one-rank model's dummy
    weights."""
    parallel = getattr(model, "parallel", None)
    rank = parallel.tp_rank if parallel is not None else 0
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        module, _, leaf = name.rpartition(".")
        if module.rpartition(".")[2].endswith("norm") and leaf == "weight":  # RMSNorm scales
            p.fill_(1.0)
            continue
        offset = rank * 1_000_003 if getattr(p, "tp_shard", False) else 0
        gen = torch.Generator(device=p.device).manual_seed(seed + _stable_hash(name) + offset)
        p.copy_(
            torch.empty(p.shape, device=p.device, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen)
        )


def _stable_hash(name: str) -> int:
    """A process-independent 31-bit hash of ``name`` (Python's ``hash`` of a str is salted per process)."""
    import zlib

    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def load_tokenizer(path: str | Path) -> Any:
    """transformers' ``AutoTokenizer`` of the checkpoint at ``path`` (no remote code), or None when it has no
    tokenizer files (:data:`TOKENIZER_FILES`).

    The checkpoint's config.json, when present, is checked first (:meth:`ModelConfig.from_pretrained`):
    ``AutoTokenizer`` reads it too, and a broken one would otherwise read as a tokenizer error.

    Raises:
        ConfigurationError: see :meth:`ModelConfig.from_pretrained`; a tokenizer file that is empty or not a
            JSON object, or tokenizer files transformers / tokenizers cannot load (names the files and the
            library's error).
    """
    p = Path(path)
    present = [f for f in TOKENIZER_FILES if (p / f).is_file()]
    if not present:
        return None
    if (p / "config.json").is_file():
        ModelConfig.from_pretrained(p)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name in present:
            read_json_object(p / name, "a JSON object (a Hugging Face tokenizer file)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
    except (
        Exception
    ) as exc:  # tokenizers' / transformers' / sentencepiece's errors vary by library and version
        raise bad_config(
            f"tokenizer files {present} in {p}",
            "a tokenizer transformers' AutoTokenizer can load",
            f"{type(exc).__name__}: {str(exc)[:300]}",
            "The tokenizer files are corrupted or of an unsupported kind: download them again.",
        ) from exc
