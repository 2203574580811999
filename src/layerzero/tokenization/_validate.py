"""Input checks of the tokenization API: texts and token ids. Each raises InvalidInputError (a ValueError)
with what failed, expected vs got, and how to fix it; none is an ``assert``."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from layerzero.core.errors import InvalidInputError, expected_got

__all__ = ["check_id", "check_ids_fit", "id_lists", "text_list"]


def _got(x: Any) -> str:
    return f"{type(x).__name__} {x!r}"[:80]


def text_list(texts: Any, what: str) -> tuple[list[str], bool]:
    """``(texts as a list, whether one str was given)``."""
    if isinstance(texts, str):
        return [texts], True
    if isinstance(texts, (list, tuple)):
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                fix = "Decode bytes first (bytes.decode('utf-8'))." if isinstance(t, bytes) else None
                raise InvalidInputError(expected_got(f"{what}[{i}]", "a str", _got(t), fix))
        return list(texts), False
    fix = (
        "Decode bytes first (bytes.decode('utf-8'))."
        if isinstance(texts, bytes)
        else "Pass one str or a list of str."
    )
    raise InvalidInputError(expected_got(what, "a str or a list/tuple of str", _got(texts), fix))


def _as_int(x: Any, what: str) -> int:
    if type(x) is int:
        return x
    if not isinstance(x, bool):
        try:
            return operator.index(x)  # numpy / torch integer scalars
        except TypeError:
            pass
    raise InvalidInputError(expected_got(what, "an int token id", _got(x), "Token ids are Python ints."))


def _ints(seq: Sequence[Any], what: str) -> list[int]:
    if all(type(x) is int for x in seq):
        return list(seq)
    return [_as_int(x, f"{what}[{i}]") for i, x in enumerate(seq)]


def _is_row(x: Any) -> bool:
    """A sequence of ids (a list, a tuple, a 1-D tensor/array) rather than one id (an int, a 0-d scalar)."""
    return isinstance(x, (list, tuple)) or (hasattr(x, "tolist") and getattr(x, "ndim", 0) > 0)


def id_lists(ids: Any, what: str, single_only: bool = False) -> tuple[list[list[int]], bool]:
    """``(ids as a list of id lists, whether one sequence was given)``. One sequence: a list/tuple of ints or
    a 1-D tensor/array; a batch: a list/tuple of those or a 2-D tensor/array. ``[]`` is one empty sequence."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        ids = ids.tolist()  # torch.Tensor / numpy.ndarray
    if not isinstance(ids, (list, tuple)):
        raise InvalidInputError(
            expected_got(
                what,
                "a list of int token ids (or a list of such lists)",
                _got(ids),
                "Pass token ids as a list, tuple, or 1-D/2-D tensor.",
            )
        )
    if not ids or not _is_row(ids[0]):
        return [_ints(ids, what)], True
    if single_only:
        raise InvalidInputError(
            expected_got(
                what, "one sequence of int token ids", "a list of sequences", "Pass one sequence here."
            )
        )
    out = []
    for r, row in enumerate(ids):
        if not _is_row(row):
            raise InvalidInputError(
                expected_got(
                    f"{what}[{r}]",
                    "a list of int token ids (every row of a batch)",
                    _got(row),
                    "Do not mix ids and id lists in one batch.",
                )
            )
        out.append(_ints(row if isinstance(row, (list, tuple)) else row.tolist(), f"{what}[{r}]"))
    return out, False


def check_ids_fit(what: str, batch: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Raise InvalidInputError for the first id outside ``[0, vocab_size)``."""
    for r, ids in enumerate(batch):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            c, bad = next((c, i) for c, i in enumerate(ids) if not 0 <= i < vocab_size)
            where = f"{what}[{c}]" if len(batch) == 1 else f"{what}[{r}][{c}]"
            raise InvalidInputError(
                expected_got(
                    where,
                    f"a token id in [0, {vocab_size})",
                    bad,
                    "Ids must come from this tokenizer's vocabulary.",
                )
            )


def check_id(x: Any, vocab_size: int, what: str) -> int:
    """One token id, checked."""
    i = _as_int(x, what)
    if not 0 <= i < vocab_size:
        raise InvalidInputError(
            expected_got(
                what, f"a token id in [0, {vocab_size})", i, "Ids must come from this tokenizer's vocabulary."
            )
        )
    return i
