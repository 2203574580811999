"""Which adapter a tokenizer argument gets, cached.

Three small LRU tables, guarded by one lock:

- by content: sha256 key (:attr:`Adapter.key`) -> adapter, so two content-equal tokenizers share one adapter;
- by object: ``id(obj)`` -> (weak reference, cheap fingerprint, adapter), so a tokenizer seen before is not
  hashed again (hashing a 150k-token vocabulary takes tens of milliseconds); the fingerprint (vocabulary
  size, added tokens) sends an object that gained tokens in place back to hashing, and an adapter whose
  object changed that way is never handed out again;
- by path: (resolved path, mtime, size) -> adapter, so a tokenizer file is loaded once.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from layerzero.core.errors import InvalidInputError, expected_got

from ._adapters import Adapter, TokenizersAdapter, TransformersAdapter
from ._adapters_tiktoken_sp import SentencePieceAdapter, TiktokenAdapter

__all__ = ["cache_info", "clear_cache", "resolve"]

MAX_ADAPTERS = 8
MAX_OBJECTS = 64
MAX_PATHS = 8

ADAPTERS: tuple[tuple[str, str, type[Adapter]], ...] = (
    ("tokenizers", "Tokenizer", TokenizersAdapter),
    ("transformers", "PreTrainedTokenizerBase", TransformersAdapter),
    ("tiktoken", "Encoding", TiktokenAdapter),
    ("sentencepiece", "SentencePieceProcessor", SentencePieceAdapter),
)
"""(module, class, adapter): an object that is an instance of ``module.class`` gets that adapter."""

_lock = threading.Lock()
_by_key: OrderedDict[str, Adapter] = OrderedDict()
_by_obj: OrderedDict[int, tuple[Any, tuple, Adapter]] = OrderedDict()
_by_path: OrderedDict[tuple[str, int, int], Adapter] = OrderedDict()


def _put(table: OrderedDict, key: Any, value: Any, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


def adapter_class(obj: Any) -> type[Adapter]:
    """The adapter class for ``obj``. Raises InvalidInputError for an object of no supported library."""
    for module, cls_name, adapter in ADAPTERS:
        mod = sys.modules.get(module)  # obj's library is imported if obj is one of its objects
        cls = getattr(mod, cls_name, None) if mod is not None else None
        if cls is not None and isinstance(obj, cls):
            return adapter
    raise InvalidInputError(
        expected_got(
            "tokenizer",
            "a tokenizers.Tokenizer, a transformers PreTrainedTokenizerBase, a tiktoken.Encoding, a "
            "sentencepiece.SentencePieceProcessor, or a path to tokenizer.json / tokenizer.model",
            f"{type(obj).__module__}.{type(obj).__qualname__}",
            "Pass the tokenizer object itself (for transformers: the tokenizer, not the processor or model).",
        )
    )


def _ref(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:  # not weak-referenceable: keep it alive while its entry lives (the table is bounded)
        return lambda: obj


def _from_object(obj: Any) -> Adapter:
    cls = adapter_class(obj)
    fp = cls.fingerprint(obj)
    with _lock:
        hit = _by_obj.get(id(obj))
        if hit is not None and hit[0]() is obj and hit[1] == fp and not hit[2].stale():
            _by_obj.move_to_end(id(obj))
            return hit[2]
    fresh = cls(obj)  # hashes the content, outside the lock
    with _lock:
        adapter = _by_key.get(fresh.key)
        if adapter is None or adapter.stale():  # stale: its object was changed in place after hashing
            adapter = fresh
        _put(_by_key, fresh.key, adapter, MAX_ADAPTERS)
        _put(_by_obj, id(obj), (_ref(obj), fp, adapter), MAX_OBJECTS)
    return adapter


def _load(path: Path) -> Any:
    """A tokenizer object from a file or a checkpoint directory."""
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return _load(path / name)
        raise InvalidInputError(
            expected_got(
                f"tokenizer directory {str(path)!r}",
                "a tokenizer.json or tokenizer.model in it",
                "neither",
                "Pass the tokenizer file, or load the tokenizer yourself.",
            )
        )
    if path.suffix == ".json":
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    if path.suffix == ".model":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    raise InvalidInputError(
        expected_got(
            f"tokenizer file {str(path)!r}",
            "a tokenizers .json file or a sentencepiece .model file",
            repr(path.suffix or "no suffix"),
            "tiktoken files carry no split pattern: build a tiktoken.Encoding.",
        )
    )


def _from_path(arg: str | os.PathLike) -> Adapter:
    path = Path(arg).expanduser().resolve()
    try:
        st = path.stat()
    except OSError as e:
        raise InvalidInputError(
            expected_got("tokenizer path", "an existing file or directory", str(arg), f"({e.strerror})")
        ) from e
    if path.is_dir():  # a directory's identity is its tokenizer file's
        st = next(
            ((path / n).stat() for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()), st
        )
    key = (str(path), st.st_mtime_ns, st.st_size)
    with _lock:
        hit = _by_path.get(key)
        if hit is not None:
            _by_path.move_to_end(key)
            return hit
    adapter = _from_object(_load(path))
    with _lock:
        _put(_by_path, key, adapter, MAX_PATHS)
    return adapter


def resolve(tokenizer: Any) -> Adapter:
    """The (cached) adapter of a tokenizer object or a tokenizer path.

    Raises:
        InvalidInputError: an unsupported object, a missing path, a file that is not a tokenizer.
    """
    if isinstance(tokenizer, Adapter):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        return _from_path(tokenizer)
    return _from_object(tokenizer)


def clear_cache() -> None:
    """Forget every cached adapter (the next call hashes and loads again)."""
    with _lock:
        _by_key.clear()
        _by_obj.clear()
        _by_path.clear()


def cache_info() -> dict[str, int]:
    """Entries per table: ``{"adapters": ..., "objects": ..., "paths": ...}``."""
    with _lock:
        return {"adapters": len(_by_key), "objects": len(_by_obj), "paths": len(_by_path)}
