"""Manifests: the list of op calls a process will make, for ``lz.solve``, ``lz.warmup`` and ``lz.dry_run``.

A :class:`Manifest` holds :class:`Case` objects ``(op, args, kwargs, critical)``: exactly the arguments of
``lz.<op>(*args, **kwargs)`` (as ``lz.tune`` and ``lz.warmup(op, cases)`` take them). Build one from a list,
from JSON (tensor *specs*, materialized as seeded random tensors on a device), or record it from a model run
(``lz.dry_run(fn, *inputs).manifest``).

JSON format (schema version 1)::

    {"version": 1, "device": "cpu",
     "cases": [
       {"op": "rms_norm", "critical": true,
        "args": [{"shape": [2, 16, 64], "dtype": "float32"}, {"shape": [64], "dtype": "float32"}],
        "kwargs": {"eps": 1e-6}},
       {"op": "attention",
        "args": [{"shape": [1, 8, 16, 64]}, {"shape": [1, 8, 16, 64]}, {"shape": [1, 8, 16, 64]}],
        "kwargs": {"is_causal": true}}]}

A dict with a ``"shape"`` key is a tensor spec (``dtype`` default ``float32``, ``device`` default the
manifest's ``device``); anything else (numbers, bools, strings, null, lists of them) is passed as is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from layerzero.core.errors import ConfigurationError, expected_got

MANIFEST_VERSION = 1


class ManifestError(ConfigurationError):
    """A manifest (list or JSON) is malformed: the message names the case and field, expected vs got."""


@dataclass(frozen=True)
class Case:
    """One op call: ``lz.<op>(*args, **kwargs)``; ``critical`` cases are warmed first (synchronously)."""

    op: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    critical: bool = False

    def shape_summary(self) -> str:
        """``"f32[2,16,64], f32[64], eps=1e-06"``-style summary of the arguments (tensors by dtype and
        shape)."""
        parts = [_summ(a) for a in self.args] + [f"{k}={_summ(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)


def _summ(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).replace("torch.", "")
        return f"{dt}[{','.join(str(s) for s in v.shape)}]"
    return repr(v)


@dataclass
class Manifest:
    """An ordered list of :class:`Case`; iterate it, ``len()`` it, ``to_dict()``/``save()`` it as JSON
    specs."""

    cases: list[Case] = field(default_factory=list)

    def __iter__(self) -> Iterator[Case]:
        return iter(self.cases)

    def __len__(self) -> int:
        return len(self.cases)

    def add(self, op: str, *args: Any, critical: bool = False, **kwargs: Any) -> Manifest:
        """Append ``lz.<op>(*args, **kwargs)``; returns ``self`` (chainable)."""
        self.cases.append(Case(op, tuple(args), dict(kwargs), critical))
        return self

    def critical_first(self) -> list[Case]:
        """The critical cases, then the others, each group in manifest order."""
        return [c for c in self.cases if c.critical] + [c for c in self.cases if not c.critical]

    @classmethod
    def of(cls, cases_or_manifest: Any, where: str = "manifest") -> Manifest:
        """A :class:`Manifest` from a manifest, a list of :class:`Case` / ``(op, args, kwargs)`` /
        ``(op, args, kwargs, critical)`` tuples. Raises :class:`ManifestError` naming the bad entry."""
        if isinstance(cases_or_manifest, Manifest):
            return cases_or_manifest
        if isinstance(cases_or_manifest, (str, bytes, dict)) or not isinstance(cases_or_manifest, Iterable):
            raise ManifestError(
                expected_got(
                    where,
                    "a Manifest or a list of (op, args, kwargs)",
                    type(cases_or_manifest).__name__,
                    "For a JSON file use lz.load_manifest(path).",
                )
            )
        out = cls()
        for i, c in enumerate(cases_or_manifest):
            if isinstance(c, Case):
                out.cases.append(c)
                continue
            ok = (
                isinstance(c, (tuple, list))
                and len(c) in (3, 4)
                and isinstance(c[0], str)
                and isinstance(c[1], (tuple, list))
                and isinstance(c[2], dict)
            )
            if not ok:
                raise ManifestError(
                    expected_got(
                        f"{where} case {i}",
                        "(op, args, kwargs[, critical]) with op a str, args a tuple and kwargs a dict",
                        repr(c)[:120],
                    )
                )
            out.cases.append(Case(c[0], tuple(c[1]), dict(c[2]), bool(c[3]) if len(c) == 4 else False))
        return out

    # ---------------------------------------------------------------- JSON specs
    def to_dict(self) -> dict[str, Any]:
        """The JSON form (tensors as ``{"shape", "dtype", "device"}`` specs; their values are not kept)."""
        return {
            "version": MANIFEST_VERSION,
            "cases": [
                {
                    "op": c.op,
                    "critical": c.critical,
                    "args": [_spec(a) for a in c.args],
                    "kwargs": {k: _spec(v) for k, v in c.kwargs.items()},
                }
                for c in self.cases
            ],
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, data: Any, *, device: str | None = None, source: str = "<manifest>") -> Manifest:
        """Materialize a JSON manifest: tensor specs become seeded random tensors (seed 0) on ``device`` (else
        the spec's or the manifest's ``device``, else cpu). Raises :class:`ManifestError`."""
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise ManifestError(
                expected_got(
                    f"{source}",
                    f'a JSON object with "version": {MANIFEST_VERSION}',
                    repr(data)[:80] if not isinstance(data, dict) else f"version {data.get('version')!r}",
                )
            )
        cases = data.get("cases")
        if not isinstance(cases, list):
            raise ManifestError(expected_got(f"{source}: cases", "a list", type(cases).__name__))
        default_dev = device or data.get("device") or "cpu"
        gen = torch.Generator().manual_seed(0)
        out = cls()
        for i, c in enumerate(cases):
            where = f"{source}: cases[{i}]"
            if not isinstance(c, dict) or not isinstance(c.get("op"), str):
                raise ManifestError(expected_got(where, 'an object with an "op" string', repr(c)[:80]))
            args, kwargs = c.get("args", []), c.get("kwargs", {})
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise ManifestError(
                    expected_got(
                        where,
                        '"args" a list and "kwargs" an object',
                        f"{type(args).__name__} / {type(kwargs).__name__}",
                    )
                )
            mat = [
                _materialize(a, f"{where}.args[{j}]", device or default_dev, device is not None, gen)
                for j, a in enumerate(args)
            ]
            kw = {
                k: _materialize(v, f"{where}.kwargs.{k}", device or default_dev, device is not None, gen)
                for k, v in kwargs.items()
            }
            out.cases.append(Case(c["op"], tuple(mat), kw, bool(c.get("critical", False))))
        return out


def load_manifest(path: str | os.PathLike[str], *, device: str | None = None) -> Manifest:
    """Read a JSON manifest (format: this module's docstring, docs/planning.md) and materialize its tensors on
    ``device`` (default: the file's ``device``, else cpu). Raises :class:`ManifestError` (bad JSON or schema),
    ``OSError`` (unreadable file)."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from None
    return Manifest.from_dict(data, device=device, source=str(path))


def _spec(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "device": v.device.type}
    if isinstance(v, (tuple, list)):
        return [_spec(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def _materialize(v: Any, where: str, device: str, force_device: bool, gen: torch.Generator) -> Any:
    if isinstance(v, list):
        return [_materialize(x, f"{where}[{i}]", device, force_device, gen) for i, x in enumerate(v)]
    if not isinstance(v, dict):
        return v
    shape, dtype_name = v.get("shape"), v.get("dtype", "float32")
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ManifestError(expected_got(f"{where}.shape", "a list of ints >= 0", repr(shape)[:60]))
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(
            expected_got(f"{where}.dtype", "a torch dtype name like 'float32' or 'int64'", repr(dtype_name))
        )
    dev = device if force_device else v.get("device", device)
    if dtype.is_floating_point:
        t = torch.randn(*shape, generator=gen).to(dtype)
    elif dtype == torch.bool:
        t = torch.ones(*shape, dtype=torch.bool)
    else:
        t = torch.randint(0, int(v.get("high", 2)), tuple(shape), generator=gen, dtype=torch.int64).to(dtype)
    return t.to(dev)


__all__ = ["MANIFEST_VERSION", "Case", "Manifest", "ManifestError", "load_manifest"]
