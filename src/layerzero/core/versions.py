"""Version strings of torch and the optional backends, parsed one way everywhere."""

from __future__ import annotations


def release(text: str | None) -> tuple[int, ...]:
    """The leading numeric release of a version string; ``()`` when there is none.

    >>> release("2.7.4.post1"), release("5.23.0.dev0"), release("2.13.0+cpu"), release("garbage")
    ((2, 7, 4), (5, 23, 0), (2, 13, 0), ())
    """
    parts: list[int] = []
    for piece in str(text or "").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)
