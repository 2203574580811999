#!/usr/bin/env python3
"""Re-wrap the lines ``ruff format`` leaves longer than the line limit (a one-off tool for enabling E501).

``ruff format`` never touches the text inside docstrings, comments or string literals, so after it ran over
``src/ tests/ benchmarks/ fuzz/`` about 3,400 lines were still longer than the 110 columns of
``pyproject.toml`` (~2,900 inside docstrings, ~300 in string literals, ~150 in comments). This tool fixes them
mechanically so that ruff's E501 can be enabled, without changing what the code does:

* **Docstrings** (and the other bare string statements, such as attribute docstrings): each paragraph holding
  an over-long line is re-flowed with :mod:`textwrap` (no word is broken, no break at hyphens), keeping the
  paragraph's first-line indent and its continuation indent (from its second line; for a one-line paragraph:
  a hanging indent under a bullet's text, indent + 4 for a ``name: text`` item of an ``Args:`` / ``Raises:``
  / ``Returns:`` ... section, the same indent for prose). Doctest lines and their output, literal blocks (the
  indented lines after ``::``), tables, directives, ``` fences and the placement of the quotes are left
  alone; a one-line docstring that is too long becomes a multi-line one with the closing quotes on its last
  text line, as the project writes them.
* **Comments**: a paragraph of full-line comments holding an over-long line is re-flowed at the same indent
  (a ``# -----`` banner is shortened instead); an over-long trailing comment moves to its own line(s) above
  its code line, unless it is a pragma (``# noqa``, ``# type:``, ``# pragma``, ``# fmt:`` ...).
* **String literals**: a one-line literal (or a run of implicitly concatenated literals, one per line) that
  makes a line too long is split at spaces (or after a ``\\n``) into adjacent literals, one per line (implicit
  concatenation: the same constant); never inside an f-string's ``{...}`` or a ``\\N{...}`` escape. Inside
  brackets the parts go under the literal (under the run's other literals; at the line's indent after code
  on a continuation line, such as ``description="..."``), or one indent deeper on the lines below the code
  when that takes fewer lines; outside brackets the literal gets parentheses in ruff format's layout (the
  aim: ``ruff format`` leaves the result alone). An f-string part left without a replacement field loses its
  ``f`` (ruff's F541); dict keys and lines ending in a pragma comment are left alone.

Every rewritten file must still compile, and its AST must equal the original's once the whitespace inside
bare string statements is collapsed (implicit concatenation gives the same ``Constant`` / ``JoinedStr``);
otherwise the file is left unchanged and reported. Running the tool twice changes nothing the second time.

Usage: ``python tools/rewrap_long_lines.py [--width 110] [--check] [--list] PATH...`` (files or folders;
files are rewritten in place, one line of counts per changed file; ``--list`` prints the lines still too
long with the reason; ``--check`` writes nothing and exits 1 when a file would change).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import textwrap
import time
import tokenize
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------------------------- helpers

PRAGMA_RE = re.compile(r"#\s*(noqa\b|type:|pragma\b|fmt:|isort:|pylint:|mypy:|pyright:|ruff:|nosec\b)")
BANNER_RE = re.compile(r"^(#+\s*)([-=#*~_+])\2{3,}")
SECTION_RE = re.compile(
    r"^(Args|Arguments|Attributes|Example|Examples|Fields|Keyword Args|Keyword Arguments|Methods|Note|Notes"
    r"|Other Parameters|Parameters|Return|Returns|Raise|Raises|References|See Also|Todo|Warning|Warnings"
    r"|Warns|Yield|Yields|Usage|Semantics)\s*:\s*$"
)
ITEM_SECTIONS = {
    "Args", "Arguments", "Attributes", "Fields", "Keyword Args", "Keyword Arguments", "Methods",
    "Other Parameters", "Parameters", "Return", "Returns", "Raise", "Raises", "Warns", "Yield", "Yields",
}  # fmt: skip
CODE_SECTIONS = {"Example", "Examples", "Usage"}
ITEM_RE = re.compile(r"^(\*{0,2}[\w.\[\]`|-]+(, \*{0,2}[\w.\[\]`|-]+)*|:\w+:`[^`]+`)( \([^)]*\))?:(\s|$)")
BULLET_RE = re.compile(r"^([-*+\u2022]|\d+[.)]|#\.)( +)(?=\S)")
TABLE_RE = re.compile(r"^(\|.*\|$|\| |\+[-=]|={3,})")  # a table row or border, an RST line block
UNDERLINE_RE = re.compile(r"^([-=~^*+#`'\"])\1{2,}\s*$")
STRING_PREFIX_RE = re.compile(r"^([A-Za-z]*)('''|\"\"\"|'|\")")
GLUE = "\x00"


def doc_sticky(word: str) -> bool:
    """A word that must not begin a re-flowed docstring line (it would read as a bullet, doctest, table
    ...)."""
    return bool(
        word in ("...", "..", "::")
        or word.startswith((">>>", "```", "|", "+-", "+=", "==="))
        or BULLET_RE.match(word + " x")
        or UNDERLINE_RE.match(word)
        or SECTION_RE.match(word)
    )


def comment_sticky(word: str) -> bool:
    """A word that must not begin a re-flowed comment line (a bullet, a banner, a pragma ...)."""
    return bool(
        BULLET_RE.match(word + " x")
        or UNDERLINE_RE.match(word)
        or PRAGMA_RE.match("# " + word + " ")
        or word.startswith(("#", "!"))
    )


def glue(text: str, sticky: Callable[[str], bool]) -> str:
    """Join each sticky word to the word before it (``GLUE`` is no whitespace to textwrap)."""
    return re.sub(
        r" +(?=(\S+))", lambda m: GLUE * len(m.group(0)) if sticky(m.group(1)) else m.group(0), text
    )


def text_width(s: str) -> int:
    """Display width as ruff counts it (East Asian wide and fullwidth characters count 2, combining marks
    0)."""
    if s.isascii():
        return len(s)
    w = 0
    for ch in s:
        if unicodedata.combining(ch):
            continue
        w += 2 if unicodedata.east_asian_width(ch) in "WF" else 1
    return w


def wrap(text: str, width: int, initial: str, subsequent: str) -> list[str]:
    """Fill ``text`` into lines of at most ``width`` columns (words never broken); ``GLUE`` becomes a
    space."""
    lines: list[str] = []
    for _ in range(6):
        w = textwrap.TextWrapper(
            width=width,
            initial_indent=initial,
            subsequent_indent=subsequent,
            break_long_words=False,
            break_on_hyphens=False,
            expand_tabs=False,
            replace_whitespace=False,
        )
        lines = [ln.replace(GLUE, " ").rstrip(" ") for ln in w.wrap(text)]
        extra = max((text_width(ln) - len(ln) for ln in lines), default=0)
        if extra <= 0 or all(text_width(ln) <= width for ln in lines):
            break
        width -= extra
    return lines


@dataclass
class Tok:
    """A token; an f-string (Python 3.12+: FSTRING_START ... FSTRING_END) is folded into one STRING token."""

    type: int
    string: str
    start: tuple[int, int]
    end: tuple[int, int]
    depth: int = 0  # brackets open before the token
    bracket: str = ""  # the innermost open bracket ('(', '[', '{') and its row
    bracket_row: int = 0


def tokens_of(src: str) -> list[Tok]:
    fs_start = {getattr(tokenize, n) for n in ("FSTRING_START", "TSTRING_START") if hasattr(tokenize, n)}
    fs_end = {getattr(tokenize, n) for n in ("FSTRING_END", "TSTRING_END") if hasattr(tokenize, n)}
    lines = src.splitlines(keepends=True)
    out: list[Tok] = []
    stack: list[tuple[str, int]] = []
    nest = 0
    start = (0, 0)
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        if t.type in fs_start:
            if nest == 0:
                start = t.start
            nest += 1
            continue
        if nest:
            if t.type in fs_end:
                nest -= 1
                if nest == 0:
                    text = _slice(lines, start, t.end)
                    if start[0] != t.end[0]:
                        text = "\x01" + text  # a multi-line f-string: never split (nor its columns trusted)
                    if t.type != getattr(tokenize, "FSTRING_END", None):
                        text = "\x01" + text  # a t-string: never split
                    out.append(_tok(tokenize.STRING, text, start, t.end, stack))
            continue
        end = t.end
        if "\n" in t.string and t.type == tokenize.STRING:
            # the end column of a multi-line token counts bytes on some Pythons (3.12.1): recompute it
            end = (t.end[0], len(t.string) - t.string.rfind("\n") - 1)
        if t.type == tokenize.STRING and _slice(lines, t.start, end) != t.string:
            raise ValueError(f"tokenize positions do not match the source at line {t.start[0]}")
        tok = _tok(t.type, t.string, t.start, end, stack)
        out.append(tok)
        if t.type == tokenize.OP and t.string in "([{":
            stack.append((t.string, t.start[0]))
        elif t.type == tokenize.OP and t.string in ")]}" and stack:
            stack.pop()
    return out


def _tok(typ: int, s: str, start: tuple[int, int], end: tuple[int, int], stack: list[tuple[str, int]]) -> Tok:
    br, row = stack[-1] if stack else ("", 0)
    return Tok(typ, s, start, end, len(stack), br, row)


def _slice(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    if start[0] == end[0]:
        return lines[start[0] - 1][start[1] : end[1]]
    parts = [lines[start[0] - 1][start[1] :]] + lines[start[0] : end[0] - 1] + [lines[end[0] - 1][: end[1]]]
    return "".join(parts)


SKIP_TYPES = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT}


def significant(tokens: list[Tok], i: int, step: int) -> Tok | None:
    """The nearest token before (step -1) or after (step 1) ``tokens[i]`` that is not layout or a comment."""
    i += step
    while 0 <= i < len(tokens):
        if tokens[i].type not in SKIP_TYPES and tokens[i].type != tokenize.ENDMARKER:
            return tokens[i]
        i += step
    return None


@dataclass
class Report:
    """What the tool did to one file (or to all of them)."""

    docstrings: int = 0  # docstring paragraphs re-flowed
    comments: int = 0  # comment paragraphs re-flowed, banners shortened, trailing comments moved
    strings: int = 0  # string literals (or runs of them) split
    left: list[tuple[int, str]] = field(default_factory=list)  # (line, why) still too long
    refused: str = ""  # why the file was left unchanged


# line-range replacement: rows [start, end) (0-based) become ``new``
Edit = tuple[int, int, list[str]]


def apply_edits(lines: list[str], edits: list[Edit]) -> list[str]:
    out = list(lines)
    last = len(lines) + 1
    for start, end, new in sorted(edits, key=lambda e: e[0], reverse=True):
        if end > last:  # overlapping: keep the later one only
            continue
        out[start:end] = new
        last = start
    return out


# ------------------------------------------------------------------------------------------- docstrings


@dataclass
class Row:
    indent: int  # column of the text (structure indent; the docstring's own indent for its first row)
    text: str  # without the indent (and without the quotes on the first / last row)
    long: bool  # the physical line is too long
    kind: str = "para"  # para | para-cont | keep:<why>
    bullet: int = 0  # width of the bullet marker, when the row starts a bullet
    item: bool = False  # the row starts a ``name: text`` item of an Args: / Raises: / ... section


def docstring_pass(src: str, lines: list[str], toks: list[Tok], width: int, rep: Report) -> list[Edit]:
    tree = ast.parse(src)
    at = {t.start: i for i, t in enumerate(toks) if t.type == tokenize.STRING}
    edits: list[Edit] = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            continue
        row = node.value.lineno
        col = len(lines[row - 1].encode()[: node.value.col_offset].decode(errors="replace"))
        i = at.get((row, col))
        if i is None:
            continue
        nxt = significant(toks, i, 1)
        if nxt is not None and nxt.type == tokenize.STRING:  # an implicitly concatenated docstring
            continue
        tok = toks[i]
        r0, r1 = tok.start[0] - 1, tok.end[0] - 1
        if not any(text_width(lines[r]) > width for r in range(r0, r1 + 1)):
            continue
        new = rewrap_docstring(lines, tok, width, rep)
        if new is not None:
            edits.append((r0, r1 + 1, new))
    return edits


def rewrap_docstring(lines: list[str], tok: Tok, width: int, rep: Report) -> list[str] | None:
    m = STRING_PREFIX_RE.match(tok.string)
    if m is None or set(m.group(1).lower()) - {"r", "u"}:
        return None
    raw = "r" in m.group(1).lower()
    quote = m.group(2)
    r0, c0 = tok.start[0] - 1, tok.start[1]
    r1, c1 = tok.end[0] - 1, tok.end[1]
    head = lines[r0][:c0]
    if head.strip() or "\t" in tok.string:
        return None
    if len(quote) == 1:
        if r0 != r1 or quote * 3 in tok.string or "\\" in tok.string:
            return None
        quote = quote * 3  # a long one-line "..." docstring becomes a """...""" one
    opener = head + m.group(1) + quote
    body_start = c0 + len(m.group(0))
    closer = quote + lines[r1][c1:]
    base = c0
    rows: list[Row] = []
    for r in range(r0, r1 + 1):
        line = lines[r]
        text = line[body_start if r == r0 else 0 : c1 - len(m.group(2)) if r == r1 else len(line)]
        if r == r0:
            indent = base
            if text[:1].isspace():
                rows.append(Row(indent, text, text_width(line) > width, "keep:leading space"))
                continue
        else:
            indent = len(text) - len(text.lstrip(" "))
        rows.append(Row(indent, text.strip(" "), text_width(line) > width))
    classify(rows, raw)
    orig = lines[r0 : r1 + 1]
    out: list[str] = []
    i, n = 0, len(rows)
    changed = False
    while i < n:
        if rows[i].kind != "para":
            out.append(orig[i])
            i += 1
            continue
        j = i + 1
        while j < n and rows[j].kind == "para-cont":
            j += 1
        new = None
        if any(rows[k].long for k in range(i, j)):
            new = reflow(rows, i, j, width, raw, opener if i == 0 else None, closer if j == n else None, base)
        if new is not None and new != orig[i:j]:
            out.extend(new)
            changed = True
            rep.docstrings += 1
        else:
            out.extend(orig[i:j])
        i = j
    return out if changed else None


def classify(rows: list[Row], raw: bool) -> None:
    """Mark each row ``para`` (starts a paragraph), ``para-cont`` (continues one) or ``keep:<why>``."""
    n = len(rows)
    doctest = fence = False
    literal: int | None = None  # rows indented deeper than this are a literal block / directive body
    literal_why = ""
    section: list | None = None  # [name, indent, whether its first entry is a ``name: text`` item]
    para_start: int | None = None  # the open paragraph: its first row and continuation indent
    cont: int | None = None
    kind = ""
    for k, row in enumerate(rows):
        t = row.text
        if row.kind.startswith("keep:"):  # decided by the caller (text right after the opening quotes ...)
            para_start = None
            continue
        last_closer_only = k == n - 1 and not t
        if not raw and k > 0 and rows[k - 1].text.endswith("\\") and not rows[k - 1].text.endswith("\\\\"):
            row.kind = "keep:backslash continuation"
            rows[k - 1].kind = "keep:backslash continuation"
            para_start = None
            continue
        if not t or last_closer_only:
            row.kind = "keep:blank"
            doctest = False
            para_start = None
            continue
        if literal is not None:
            if row.indent > literal:
                row.kind = "keep:" + literal_why
                continue
            literal = None
        if fence:
            row.kind = "keep:``` fence"
            if t.startswith("```"):
                fence = False
            continue
        if section is not None and row.indent <= section[1] and not SECTION_RE.match(t):
            section = None
        special = ""
        if t.startswith("```"):
            fence = True
            special = "``` fence"
        elif doctest:
            special = "doctest" if t.startswith((">>>", "...")) else "doctest output"
        elif t.startswith(">>>"):
            doctest = True
            special = "doctest"
        elif TABLE_RE.match(t):
            special = "table"
        elif UNDERLINE_RE.match(t):
            special = "section underline"
        elif t.startswith(".. "):
            literal, literal_why = row.indent, "directive"
            special = "directive"
        elif SECTION_RE.match(t):
            name = SECTION_RE.match(t).group(1)  # type: ignore[union-attr]
            section = [name, row.indent, None]
            special = "section header"
            if name in CODE_SECTIONS:
                literal, literal_why = row.indent, f"{name} section"
        if special:
            row.kind = "keep:" + special
            para_start = None
            continue
        bm = BULLET_RE.match(t)
        if section is not None and section[2] is None:  # a section of items, or of prose (``Returns:`` ...)
            section[2] = section[0] in ITEM_SECTIONS and ITEM_RE.match(t) is not None
        is_item = bool(section and section[2] and row.indent > section[1] and ITEM_RE.match(t))
        continues = False
        if para_start is not None and not bm:
            first = rows[para_start]
            if kind in ("bullet", "item"):
                ok = row.indent > first.indent
            else:
                ok = row.indent == first.indent and not is_item
            if ok and (cont is None or row.indent == cont):
                continues = True
        if continues:
            row.kind = "para-cont"
            cont = row.indent
        else:
            row.kind = "para"
            para_start, cont = k, None
            kind = "bullet" if bm else "item" if is_item else "prose"
            if bm:
                row.bullet = len(bm.group(0))
            row.item = is_item
        if t.endswith("::"):
            literal, literal_why = rows[para_start].indent, "literal block"
            para_start = None


def reflow(
    rows: list[Row], i: int, j: int, width: int, raw: bool, opener: str | None, closer: str | None, base: int
) -> list[str] | None:
    first = rows[i]
    if j - i > 1:
        cont = rows[i + 1].indent
    elif first.bullet:
        cont = first.indent + first.bullet
    elif i == 0:
        cont = base
    elif first.item:
        cont = first.indent + 4
    else:
        cont = first.indent
    text = glue(" ".join(rows[k].text for k in range(i, j)), doc_sticky)
    if closer is not None:
        text += closer.replace(" ", GLUE)
    initial = opener if opener is not None else " " * first.indent
    # an inline code span (``...``) of a few words is kept on one line when that fits
    spans = re.sub(r"``[^`]{1,40}?``", lambda m: m.group(0).replace(" ", GLUE), text)
    new = wrap(spans, width, initial, " " * cont)
    if any(text_width(ln) > width for ln in new):
        new = wrap(text, width, initial, " " * cont)
    if not raw and any(ln.endswith("\\") for ln in new):
        return None
    return new


# --------------------------------------------------------------------------------------------- comments


def line_starts(toks: list[Tok], nlines: int, lines: list[str]) -> list[bool]:
    """``fresh[r]``: row r (0-based) begins a new token (not inside a multi-line token, no backslash
    above)."""
    fresh = [True] * (nlines + 1)
    last_end = [0] * (nlines + 1)  # end column of the last token on each row
    for t in toks:
        for r in range(t.start[0], t.end[0]):  # rows a multi-line token continues onto
            fresh[r] = False
        if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.DEDENT):
            last_end[t.end[0] - 1] = max(last_end[t.end[0] - 1], t.end[1])
    for r in range(1, nlines):
        prev = lines[r - 1].rstrip()
        if prev.endswith("\\") and len(prev) > last_end[r - 1]:
            fresh[r] = False
    return fresh


def comment_pass(src: str, lines: list[str], toks: list[Tok], width: int, rep: Report) -> list[Edit]:
    edits: list[Edit] = []
    fresh = line_starts(toks, len(lines), lines)
    comments = [t for t in toks if t.type == tokenize.COMMENT]
    full: dict[int, Tok] = {}
    for t in comments:
        r = t.start[0] - 1
        if lines[r][: t.start[1]].strip() == "":
            full[r] = t
        elif text_width(lines[r]) > width:
            e = move_trailing(lines, r, t, width, fresh[r])
            if e is not None:
                edits.append(e)
                rep.comments += 1
    # paragraphs of full-line comments
    rows = sorted(full)
    k = 0
    while k < len(rows):
        r = rows[k]
        t = full[r]
        parsed = _comment_parts(t.string)
        if parsed is None or r == 0 and t.string.startswith("#!"):
            k += 1
            continue
        marker, sp, body = parsed
        if BANNER_RE.match(t.string) or PRAGMA_RE.match(t.string) or "coding" in t.string[:30] and r < 2:
            if text_width(lines[r]) > width and BANNER_RE.match(t.string):
                e = shorten_banner(lines, r, width)
                if e is not None:
                    edits.append(e)
                    rep.comments += 1
            k += 1
            continue
        bm = BULLET_RE.match(body)
        cont_sp = len(sp) + (len(bm.group(0)) if bm else 0)
        group = [r]
        while k + len(group) < len(rows):
            r2 = rows[k + len(group)]
            if r2 != group[-1] + 1:
                break
            t2 = full[r2]
            p2 = _comment_parts(t2.string)
            if p2 is None or t2.start[1] != t.start[1] or p2[0] != marker or not p2[2]:
                break
            if BANNER_RE.match(t2.string) or PRAGMA_RE.match(t2.string) or BULLET_RE.match(p2[2]):
                break
            if len(group) == 1 and bm and len(p2[1]) > len(sp):
                cont_sp = len(p2[1])
            if len(p2[1]) != cont_sp:
                break
            group.append(r2)
        k += len(group)
        if not any(text_width(lines[g]) > width for g in group):
            continue
        col = t.start[1]
        first_parts = _comment_parts(full[group[0]].string)
        text = " ".join(_comment_parts(full[g].string)[2].strip() for g in group)  # type: ignore[index]
        text = glue(text, comment_sticky)
        initial = lines[r][:col] + marker + (first_parts[1] if first_parts and first_parts[1] else " ")
        subsequent = " " * col + marker + " " * max(cont_sp, 1)
        new = wrap(text, width, initial, subsequent)
        if new != [lines[g] for g in group]:
            edits.append((group[0], group[-1] + 1, new))
            rep.comments += 1
    return edits


def _comment_parts(s: str) -> tuple[str, str, str] | None:
    m = re.match(r"(#+:?)( *)(.*)$", s)
    if m is None:
        return None
    return m.group(1), m.group(2), m.group(3).rstrip()


def shorten_banner(lines: list[str], r: int, width: int) -> Edit | None:
    line = lines[r]
    m = re.match(r"^(\s*#+\s*)(([-=#*~_+])\3{3,})(.*)$", line)
    if m is None:
        return None
    over = text_width(line) - width
    run = m.group(2)
    if len(run) - over < 4:
        return None
    return (r, r + 1, [m.group(1) + run[: len(run) - over] + m.group(4)])


def move_trailing(lines: list[str], r: int, t: Tok, width: int, fresh: bool) -> Edit | None:
    if PRAGMA_RE.search(t.string) or not fresh:
        return None
    code = lines[r][: t.start[1]].rstrip()
    indent = code[: len(code) - len(code.lstrip(" "))]
    parsed = _comment_parts(t.string)
    if parsed is None or not parsed[2]:
        return None
    marker, _sp, body = parsed
    text = glue(body.strip(), comment_sticky)
    new = wrap(text, width, indent + marker + " ", indent + marker + " ")
    return (r, r + 1, [*new, code])


# ---------------------------------------------------------------------------------------------- strings


def split_points(body: str, is_f: bool, raw: bool, is_bytes: bool) -> list[int] | None:
    """Indices just after each run of spaces where ``body`` may be cut (outside ``{...}`` and escapes)."""
    pts: list[int] = []
    i, n, depth = 0, len(body), 0
    while i < n:
        c = body[i]
        if c == "\\":
            if not raw and not is_bytes and body.startswith("N{", i + 1):
                close = body.find("}", i)
                if close < 0:
                    return None
                i = close + 1
                continue
            if not raw and body.startswith("n", i + 1) and depth == 0 and i + 2 < n:
                pts.append(i + 2)  # after a newline escape
            i += 2
            continue
        if is_f:
            if depth == 0 and body.startswith("{{", i) or depth == 0 and body.startswith("}}", i):
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth < 0:
                    return None
            elif depth and c in "'\"":  # a string inside a replacement field
                close = body.find(c, i + 1)
                if close < 0:
                    return None
                i = close + 1
                continue
        if c == " " and depth == 0:
            while i < n and body[i] == " ":
                i += 1
            if i < n:
                pts.append(i)
            continue
        i += 1
    if depth:
        return None
    return sorted(set(pts))


def has_field(body: str) -> bool:
    return "{" in body.replace("{{", "").replace("}}", "") or "}" in body.replace("{{", "").replace("}}", "")


def make_part(prefix: str, quote: str, body: str, is_f: bool) -> str:
    if is_f and not has_field(body):  # no replacement field left: a plain literal (ruff F541)
        prefix = prefix.replace("f", "").replace("F", "")
        body = body.replace("{{", "{").replace("}}", "}")
    return prefix + quote + body + quote


def pack(
    body: str, pts: list[int], room: int, room_last: int, room_first: int | None = None
) -> list[str] | None:
    """Split ``body`` at ``pts`` into chunks of at most ``room`` columns (``room_first`` for the first), the
    last one at most ``room_last`` (it shares its line with the code after the literal); None when ``body``
    has no split point."""
    if room_first is None:
        room_first = room
    bounds = [0, *pts, len(body)]
    words = [body[bounds[k] : bounds[k + 1]] for k in range(len(bounds) - 1)]
    if len(words) < 2:
        return None
    chunks: list[list[str]] = [[]]
    for w in words:
        if chunks[-1] and text_width("".join(chunks[-1]) + w) > (room if len(chunks) > 1 else room_first):
            chunks.append([])
        chunks[-1].append(w)
    # the last chunk also carries the code after the literal: split it again while it overflows
    while text_width("".join(chunks[-1])) > room_last and len(chunks[-1]) > 1:
        last = chunks[-1]
        k = len(last) - 1
        while k > 0 and text_width("".join(last[:k])) > (room if len(chunks) > 1 else room_first):
            k -= 1
        if k == 0:
            break
        chunks[-1:] = [last[:k], last[k:]]
    return ["".join(c) for c in chunks]


@dataclass
class Lit:
    """One string literal taken apart: ``prefix quote body quote``."""

    prefix: str
    quote: str
    body: str
    is_f: bool
    raw: bool
    is_bytes: bool


def parse_lit(s: str) -> Lit | None:
    if s.startswith("\x01"):
        return None
    m = STRING_PREFIX_RE.match(s)
    if m is None:
        return None
    prefix, quote = m.group(1), m.group(2)
    low = prefix.lower()
    if set(low) - set("rbfu") or len(s) < len(m.group(0)) + len(quote) or not s.endswith(quote):
        return None
    return Lit(prefix, quote, s[len(m.group(0)) : len(s) - len(quote)], "f" in low, "r" in low, "b" in low)


def string_pass(src: str, lines: list[str], toks: list[Tok], width: int, rep: Report) -> list[Edit]:
    tree = ast.parse(src)
    bare: set[int] = set()  # rows of bare string statements (docstrings): not ours
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Constant, ast.JoinedStr)):
            bare.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    long_rows = {r for r, ln in enumerate(lines, 1) if text_width(ln) > width and r not in bare}
    if not long_rows:
        return []
    edits: list[Edit] = []
    used: set[int] = set()
    idx = {id(t): i for i, t in enumerate(toks)}
    for t in toks:  # a trailing pragma must stay on its line; ruff measures such a line without it
        if t.type == tokenize.COMMENT and PRAGMA_RE.search(t.string):
            long_rows.discard(t.start[0])
    by_row: dict[int, list[Tok]] = {}
    for t in toks:
        if t.type == tokenize.STRING and t.start[0] == t.end[0] and t.start[0] in long_rows:
            by_row.setdefault(t.start[0], []).append(t)
    for row in sorted(by_row):
        if row in used:
            continue
        cands = sorted(by_row[row], key=lambda t: (not (t.start[1] < width < t.end[1]), -len(t.string)))
        for t in cands:
            e = split_string(lines, toks, idx[id(t)], width)
            if e is None:
                continue
            start, end, new = e
            if any(r + 1 in used for r in range(start, end)):
                continue
            old_over = sum(max(0, text_width(ln) - width) for ln in lines[start:end])
            new_over = sum(max(0, text_width(ln) - width) for ln in new)
            if new_over >= old_over:
                continue
            edits.append(e)
            used.update(r + 1 for r in range(start, end))
            rep.strings += 1
            break
    return edits


def _chain(lines: list[str], toks: list[Tok], i: int) -> tuple[int, int]:
    """The run of implicitly concatenated literals around ``toks[i]`` laid out one per line: (first, last).

    Every literal but the first begins its line, all of them at one column; every literal but the last ends
    its line (no comment); the first may follow code (``description="..."``) at any column.
    """

    def begins_line(t: Tok) -> bool:
        return lines[t.start[0] - 1][: t.start[1]].strip() == ""

    def one_line(t: Tok) -> bool:
        return t.type == tokenize.STRING and t.start[0] == t.end[0]

    def next_row(j: int) -> int | None:  # index of the literal on the row after toks[j], if they chain
        if j + 2 < len(toks) and toks[j + 1].type == tokenize.NL and one_line(toks[j + 2]):
            if toks[j + 2].start[0] == toks[j].end[0] + 1 and begins_line(toks[j + 2]):
                return j + 2
        return None

    a = i
    while begins_line(toks[a]) and a >= 2 and one_line(toks[a - 2]) and next_row(a - 2) == a:
        if begins_line(toks[a - 2]) and toks[a - 2].start[1] != toks[a].start[1]:
            break
        a -= 2
    b = i
    while True:
        nb = next_row(b)
        if nb is None or (b != a and toks[nb].start[1] != toks[b].start[1]):
            break
        b = nb
    return a, b


def split_string(lines: list[str], toks: list[Tok], i: int, width: int) -> Edit | None:
    """Split the literal ``toks[i]`` (with the run of literals it belongs to) into parts that fit."""
    t = toks[i]
    if t.type != tokenize.STRING:
        return None
    a, b = _chain(lines, toks, i)
    lits = [parse_lit(toks[k].string) for k in range(a, b + 1, 2)]
    kinds = {None if p is None else (p.quote, p.raw, p.is_bytes) for p in lits}
    if a != b and (len(kinds) > 1 or None in kinds):  # a run mixing quotes, raw or bytes: the literal alone
        a = b = i
        lits = [parse_lit(t.string)]
    if any(p is None for p in lits):
        return None
    nxt, prv = significant(toks, b, 1), significant(toks, a, -1)
    if toks[b].bracket == "{" and nxt is not None and nxt.string == ":":  # a dict key
        return None
    if prv is not None and prv.string == "->":  # a forward-reference annotation
        return None
    lit0: Lit = lits[0]  # type: ignore[assignment]
    is_f = any(p.is_f for p in lits)  # type: ignore[union-attr]
    body = ""
    for p in lits:
        assert p is not None
        if is_f and not p.is_f:  # merged into an f-string: its braces must be doubled
            if not p.raw and "\\N{" in p.body:
                return None
            body += p.body.replace("{", "{{").replace("}", "}}")
        else:
            body += p.body
    prefix = lit0.prefix
    if is_f and not lit0.is_f:
        prefix = "f" + prefix.replace("u", "").replace("U", "")
    pts = split_points(body, is_f, lit0.raw, lit0.is_bytes)
    if pts is None:
        return None
    first, last = toks[a], toks[b]
    r0, r1 = first.start[0] - 1, last.end[0] - 1
    head = lines[r0][: first.start[1]]
    tail = lines[r1][last.end[1] :]
    indent = len(head) - len(head.lstrip(" "))
    col = first.start[1]
    quote = lit0.quote
    q = len(prefix) + 2 * len(quote)

    def parts(chunks: list[str]) -> list[str]:
        return [make_part(prefix, quote, ch, is_f) for ch in chunks]

    layouts: list[list[str]] = []
    if t.depth > 0:
        # 1. the first part where the literal was, the others under it (under the run's other literals, or at
        # the line's indent after code on a line that continues an open bracket, as ruff format lays them out)
        if b > a:
            rest = toks[a + 2].start[1]
        elif head.strip() and t.bracket_row != r0 + 1:
            rest = indent
        else:
            rest = col
        chunks = pack(body, pts, width - rest - q, width - rest - q - text_width(tail), width - col - q)
        if chunks is not None and len(chunks) > 1:
            out = parts(chunks)
            out = [head + out[0]] + [" " * rest + p for p in out[1:]]
            out[-1] += tail
            layouts.append(out)
        # 2. after code on the line that opens the bracket: all parts on the lines below, one indent deeper
        if head.strip() and t.bracket_row == r0 + 1 and indent + 4 < col:
            c2 = indent + 4
            chunks = pack(body, pts, width - c2 - q, width - c2 - q - text_width(tail)) or [body]
            out = [head.rstrip()] + [" " * c2 + p for p in parts(chunks)]
            out[-1] += tail
            layouts.append(out)
    elif head.strip():
        # 3. outside brackets: in new parentheses, one part per line one indent deeper (ruff format's layout)
        c2 = indent + 4
        chunks = pack(body, pts, width - c2 - q, width - c2 - q) or [body]
        out = [head.rstrip() + (" (" if head.endswith(" ") else "(")]
        out += [" " * c2 + p for p in parts(chunks)]
        out.append(" " * indent + ")" + tail)
        layouts.append(out)
    if not layouts:
        return None

    def cost(out: list[str]) -> tuple[int, int]:
        return (sum(max(0, text_width(ln) - width) for ln in out), len(out))

    return (r0, r1 + 1, min(layouts, key=cost))


# ---------------------------------------------------------------------------------------------- checking


def normalized_dump(tree: ast.AST) -> str:
    """``ast.dump`` with the whitespace inside bare string statements collapsed (re-flowed docstrings)."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            node.value.value = re.sub(r"[ \n]+", " ", node.value.value).strip()
    return ast.dump(tree)


def same_program(old: str, new: str, path: str) -> str:
    """'' when ``new`` compiles and is ``old`` up to docstring whitespace; else why not."""
    try:
        new_tree = ast.parse(new)
        compile(new, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"does not parse after rewrapping: {exc}"
    if normalized_dump(ast.parse(old)) != normalized_dump(new_tree):
        return "AST differs after rewrapping"
    return ""


# ------------------------------------------------------------------------------------------------ driver

PASSES = (("docstrings", docstring_pass), ("comments", comment_pass), ("strings", string_pass))


def rewrap_source(src: str, width: int, path: str = "<src>") -> tuple[str, Report]:
    """The re-wrapped text of one file (``src`` itself when nothing changes or a check fails) and its
    report."""
    rep = Report()
    if "\r" in src:
        rep.refused = "CR line endings"
        return src, rep
    try:
        ast.parse(src)
    except SyntaxError as exc:
        rep.refused = f"does not parse: {exc}"
        return src, rep
    cur = _run_passes(src, width, rep, None)
    if rep.refused:
        return src, Report(refused=rep.refused, left=leftovers(src, width))
    if cur != src:
        why = same_program(src, cur, path)
        if why:  # find the pass that broke it, for the report; the file stays as it was
            probe = Report()
            _run_passes(src, width, probe, path)
            rep = Report(refused=probe.refused or why)
            cur = src
    rep.left = leftovers(cur, width)
    return cur, rep


def _run_passes(src: str, width: int, rep: Report, check: str | None) -> str:
    """Run the passes until nothing changes; with ``check`` (a path), verify after every pass and stop at the
    first one that breaks the program (its name goes to ``rep.refused``)."""
    trail = src.endswith("\n")
    cur = src
    for _round in range(8):  # until nothing changes (a pass can make work for another: a moved comment ...)
        before = cur
        for name, fn in PASSES:
            lines = cur.split("\n")
            if trail:
                lines = lines[:-1]
            if not any(text_width(ln) > width for ln in lines):
                break
            try:
                edits = fn(cur, lines, tokens_of(cur), width, rep)
            except (SyntaxError, ValueError, tokenize.TokenError) as exc:  # leave such a file alone
                rep.refused = f"{name} pass: {type(exc).__name__}: {exc}"
                return src if check is None else cur
            if not edits:
                continue
            new = "\n".join(apply_edits(lines, edits)) + ("\n" if trail else "")
            if check is not None:
                why = same_program(cur, new, check)
                if why:
                    rep.refused = f"{name} pass: {why}"
                    return cur
            cur = new
        if cur == before:
            break
    return cur


def leftovers(src: str, width: int) -> list[tuple[int, str]]:
    """The rows still too long, each with the likely reason."""
    lines = src.split("\n")
    long_rows = [r for r, ln in enumerate(lines, 1) if text_width(ln) > width]
    if not long_rows:
        return []
    toks = tokens_of(src)
    tree = ast.parse(src)
    bare: dict[int, Tok] = {}
    at = {t.start: t for t in toks if t.type == tokenize.STRING}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            row = node.value.lineno
            col = len(lines[row - 1].encode()[: node.value.col_offset].decode(errors="replace"))
            t = at.get((row, col))
            if t is not None:
                for r in range(t.start[0], t.end[0] + 1):
                    bare[r] = t
    out: list[tuple[int, str]] = []
    for r in long_rows:
        line = lines[r - 1]
        why = ""
        if r in bare:
            t = bare[r]
            rows_kind = _docstring_kinds(lines, t, width)
            why = "docstring: " + rows_kind.get(r, "unbreakable word")
        else:
            on = [
                t
                for t in toks
                if t.start[0] <= r <= t.end[0] and t.type not in (tokenize.NL, tokenize.NEWLINE)
            ]
            com = [t for t in on if t.type == tokenize.COMMENT]
            strs = [t for t in on if t.type == tokenize.STRING]
            if com and PRAGMA_RE.search(com[0].string):
                why = "pragma comment"
            elif com and line.lstrip().startswith("#"):
                why = "comment: unbreakable word"
            elif any(t.start[0] != t.end[0] for t in strs):
                why = "inside a multi-line string"
            elif strs:
                why = "string literal that cannot be split (one long word, dict key, or no room)"
            elif com:
                why = "trailing comment that cannot move (continuation line)"
            else:
                why = "code"
        out.append((r, why))
    return out


def _docstring_kinds(lines: list[str], tok: Tok, width: int) -> dict[int, str]:
    m = STRING_PREFIX_RE.match(tok.string)
    if m is None:
        return {}
    rows: list[Row] = []
    r0, r1 = tok.start[0] - 1, tok.end[0] - 1
    for r in range(r0, r1 + 1):
        line = lines[r]
        if r == r0:
            text = line[tok.start[1] + len(m.group(0)) :]
            indent = tok.start[1]
        else:
            text = line
            indent = len(text) - len(text.lstrip(" "))
        rows.append(Row(indent, text.strip(" "), text_width(line) > width))
    classify(rows, "r" in m.group(1).lower())
    return {r0 + 1 + k: row.kind[5:] for k, row in enumerate(rows) if row.kind.startswith("keep:")}


def iter_files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*.py") if not any(part.startswith(".") for part in f.parts))
        else:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("paths", nargs="+", metavar="PATH")
    ap.add_argument("--width", type=int, default=110)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    ap.add_argument("--list", action="store_true", help="print every line still too long, with the reason")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    files = iter_files(args.paths)
    total = Report()
    n_changed = 0
    refused: list[tuple[Path, str]] = []
    for f in files:
        src = f.read_text(encoding="utf-8")
        new, rep = rewrap_source(src, args.width, str(f))
        if rep.refused:
            refused.append((f, rep.refused))
        if new != src:
            n_changed += 1
            if not args.check:
                f.write_text(new, encoding="utf-8")
            print(
                f"{f}: {rep.docstrings} docstring paragraphs, {rep.comments} comments, {rep.strings} strings"
                + (f"; {len(rep.left)} lines still too long" if rep.left else "")
            )
        for r, why in rep.left:
            total.left.append((r, why))
            if args.list:
                print(f"  {f}:{r}: {why}")
        total.docstrings += rep.docstrings
        total.comments += rep.comments
        total.strings += rep.strings
    for f, why in refused:
        print(f"REFUSED {f}: {why}")
    print(
        f"{len(files)} files, {n_changed} {'would change' if args.check else 'changed'}: {total.docstrings} "
        f"docstring paragraphs, {total.comments} comments, {total.strings} strings re-wrapped; "
        f"{len(total.left)} lines still longer than {args.width}; {len(refused)} refused; "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 1 if args.check and n_changed else 0


if __name__ == "__main__":
    sys.exit(main())
