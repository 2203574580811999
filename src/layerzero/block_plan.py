"""Multi-op planner: pick kernels for a block of op calls jointly, minimising layout transforms between them.

``lz.plan_block([...])`` takes op calls (``(op, args, kwargs)`` as ``lz.explain`` / ``lz.tune`` cases take
them, or :class:`BlockOp`) and the data flow between them (default: a chain, op ``i`` feeds op ``i + 1``),
runs the ordinary selection for each call (``Runtime.select_context``: filter -> score, policy and health
included), then chooses one eligible kernel per op by dynamic programming over each chain (Viterbi, O(n * s^2)
for s states per op), maximising ``sum(node scores) - sum(transition costs)``. See docs/block_planning.md for
the cost model.

Cost model (the same units as ``Score.transform_cost``):

- a kernel consumes and produces its native layout (``KernelSpec.layouts``: the incoming layout when it
  supports it, else BHSD when supported, else its first); a kernel without ``layouts`` passes the incoming
  layout through;
- an op fed by another op of the block scores ``score.total + score.transform_cost`` (its score without the
  caller-layout transform, which the block replaces) minus :data:`TRANSFORM_COST` when the producer's output
  layout differs from the layout the kernel consumes (one transpose + copy between them);
- an op fed by nothing in the block scores its standalone ``score.total``: dispatch's own charge for
  converting the caller's declared layout is already in it.

:meth:`BlockPlan.apply` makes the block's calls run the chosen kernels: a scoped policy layer
(``contextvars``, like ``lz.prefer``) with one lock per step whose ``when:`` matches that call's context
fields.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from layerzero.api import _prepared
from layerzero.core import config as _config
from layerzero.core.context import SelectionContext
from layerzero.core.errors import (
    ConfigurationError,
    InvalidInputError,
    NoKernelFoundError,
    PolicyValidationError,
    expected_got,
)
from layerzero.core.policy import Policy
from layerzero.core.policy_fields import KNOWN_FIELDS
from layerzero.core.policy_schema import LockRule, When, parse_condition
from layerzero.core.report import CandidateStatus, SelectionReport
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import KernelSpec, Layout

#: The cost of one layout conversion between two ops: the value the attention adapter charges as
#: ``transform_cost`` when it transposes a call to a kernel's native layout (``ops/attention.py: adapter``).
TRANSFORM_COST = 1.0
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class BlockOp:
    """One op call of a block: ``lz.<op>(*args, **kwargs)`` (real tensors or small stand-ins of the same
    shapes, dtypes and devices; no kernel runs while planning)."""

    op: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BlockStep:
    """The plan of one op of the block.

    ``chosen``: the jointly chosen kernel; ``standalone``: what ``lz.which`` picks for the call alone;
    ``producer``: the index of the op feeding it (None: fed from outside the block); ``layout_in`` /
    ``layout_out``: the layout the chosen kernel consumes / produces (None: the op has none);
    ``transition_cost``: charged on its input edge; ``score``: its node score in the block (see the module
    docstring); ``why``: one line of explanation.
    """

    index: int
    op: str
    chosen: str
    standalone: str
    producer: int | None
    layout_in: str | None
    layout_out: str | None
    transition_cost: float
    score: float
    why: str
    report: SelectionReport = field(repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the selection report as its own ``to_dict()``)."""
        return {
            "index": self.index,
            "op": self.op,
            "chosen": self.chosen,
            "standalone": self.standalone,
            "producer": self.producer,
            "layout_in": self.layout_in,
            "layout_out": self.layout_out,
            "transition_cost": self.transition_cost,
            "score": self.score,
            "why": self.why,
            "report": self.report.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """The joint kernel choice for a block of op calls (returned by :func:`plan_block`).

    ``steps``: one :class:`BlockStep` per op, in call order. ``total``: the block's score (sum of node scores
    minus transition costs) of the joint choice; ``greedy_total``: the same for the standalone picks;
    ``transforms`` / ``greedy_transforms``: layout conversions each choice needs; ``transforms_saved``: their
    difference. ``print(plan)`` explains the choice as a table; ``to_dict()`` is JSON-ready;
    ``with plan.apply():`` runs it.
    """

    steps: tuple[BlockStep, ...]
    total: float
    greedy_total: float
    transforms: int
    greedy_transforms: int

    @property
    def transforms_saved(self) -> int:
        """Layout conversions the joint choice avoids compared with the standalone picks."""
        return self.greedy_transforms - self.transforms

    @property
    def kernels(self) -> tuple[str, ...]:
        """The chosen kernel of each step."""
        return tuple(s.chosen for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: totals, transforms and every step."""
        return {
            "total": self.total,
            "greedy_total": self.greedy_total,
            "transforms": self.transforms,
            "greedy_transforms": self.greedy_transforms,
            "transforms_saved": self.transforms_saved,
            "steps": [s.to_dict() for s in self.steps],
        }

    def __str__(self) -> str:
        differs = any(s.chosen != s.standalone for s in self.steps)
        head = [
            f"LayerZero block plan: {len(self.steps)} ops, score {self.total:.1f} "
            f"(standalone picks: {self.greedy_total:.1f}), layout transforms {self.transforms} "
            f"(standalone picks: {self.greedy_transforms}, saved {self.transforms_saved})",
            "joint choice differs from the standalone picks"
            if differs
            else "joint choice equals the standalone picks",
        ]
        rows = [("#", "op", "chosen", "standalone pick", "layouts", "transition cost", "why")]
        for s in self.steps:
            lay = "-" if s.layout_in is None and s.layout_out is None else f"{s.layout_in}->{s.layout_out}"
            src = "in" if s.producer is None else f"<-{s.producer}"
            rows.append(
                (
                    str(s.index),
                    s.op,
                    s.chosen,
                    s.standalone,
                    f"{lay} ({src})",
                    f"{s.transition_cost:.1f}",
                    s.why,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = ["  ".join(f"{r[i]:<{widths[i]}}" for i in range(6)) + "  " + r[6] for r in rows]
        lines.insert(1, "-" * len(lines[0].rstrip()))
        return "\n".join(head + [line.rstrip() for line in lines])

    def policy(self) -> Policy:
        """The policy layer :meth:`apply` pushes: one lock per step, ``when:`` = that call's context fields.

        Raises ``ConfigurationError`` when two steps with the same op and context were given different kernels
        (one lock cannot tell those calls apart: run them in separate ``apply()`` blocks or lock them
        yourself)."""
        seen: dict[tuple[str, When], BlockStep] = {}
        locks = []
        for s in self.steps:
            when = _when_of(s.report.context)
            other = seen.get((s.op, when))
            if other is not None:
                if other.chosen != s.chosen:
                    raise ConfigurationError(
                        f"BlockPlan.apply: steps {other.index} and {s.index} are the same {s.op!r} call "
                        f"(same context) but were given different kernels ({other.chosen} vs {s.chosen}); a "
                        "scoped lock cannot tell them apart. Apply the plan around each call separately "
                        "with lz.lock, or give the calls distinct inputs."
                    )
                continue
            seen[(s.op, when)] = s
            locks.append(LockRule(s.op, s.chosen, when, origin=f"lz.plan_block step {s.index}"))
        return Policy(locks=tuple(locks), source="lz.plan_block")

    @contextlib.contextmanager
    def apply(self) -> Iterator[BlockPlan]:
        """Inside the ``with`` block, calls whose context matches a step run that step's chosen kernel (scoped
        locks, this thread/asyncio task only; force, not prefer: a locked kernel that fails raises
        ``KernelExecutionError``). Other calls select as usual. Raises what :meth:`policy` raises."""
        with _config.scoped_policy(self.policy()):
            yield self


def _when_of(ctx: SelectionContext) -> When:
    """A ``when:`` clause matching exactly ``ctx``'s primitive fields (None-valued and unparsable ones left
    out, as is ``device_name``: the plan is for this process's device)."""
    items = []
    for name, value in sorted(ctx.fields().items()):
        if value is None or name not in KNOWN_FIELDS or name == "device_name":
            continue
        try:
            cond = parse_condition(value, f"when.{name}")
        except PolicyValidationError:
            continue
        if cond.matches(value):
            items.append((name, cond))
    return When(tuple(items))


def _consumes(spec: KernelSpec, incoming: Layout | None) -> Layout | None:
    """The layout ``spec`` is called with when ``incoming`` arrives (None: the kernel has no layout)."""
    if spec.layouts is None:
        return incoming
    if incoming is not None and incoming in spec.layouts:
        return incoming
    return Layout.BHSD if Layout.BHSD in spec.layouts else sorted(spec.layouts)[0]


def _transition(src: Layout | None, dst: Layout | None) -> float:
    return 0.0 if src is None or dst is None or src is dst else TRANSFORM_COST


def _calls(ops: Any) -> list[BlockOp]:
    if isinstance(ops, (str, Mapping)) or not isinstance(ops, Sequence):
        raise InvalidInputError(
            expected_got(
                "lz.plan_block(ops)", "a list of (op, args, kwargs) calls or BlockOps", type(ops).__name__
            )
        )
    if not ops:
        raise InvalidInputError(
            expected_got(
                "lz.plan_block(ops)",
                "at least one op call",
                "an empty list",
                "Pass e.g. [('rms_norm', (x, w), {}), ('attention', (q, k, v), {})].",
            )
        )
    out = []
    for i, item in enumerate(ops):
        if isinstance(item, BlockOp):
            call = item
        elif (
            isinstance(item, tuple)
            and len(item) in (2, 3)
            and isinstance(item[1], (tuple, list))
            and (len(item) == 2 or isinstance(item[2], Mapping))
        ):
            call = BlockOp(item[0], tuple(item[1]), dict(item[2]) if len(item) == 3 else {})
        else:
            raise InvalidInputError(
                expected_got(
                    f"lz.plan_block(ops)[{i}]",
                    "(op, args, kwargs), (op, args) or a BlockOp",
                    f"{type(item).__name__} {item!r:.80}",
                )
            )
        out.append(call)
    return out


def _feeds(feeds: Any, n: int) -> dict[int, int]:
    """``{consumer: producer}``; default the chain ``{i: i - 1}``. Each producer feeds at most one consumer
    and comes before it, so the block is a set of chains."""
    if feeds is None:
        return {i: i - 1 for i in range(1, n)}
    where = "lz.plan_block(feeds)"
    if not isinstance(feeds, Mapping):
        raise InvalidInputError(
            expected_got(
                where, "a mapping {consumer index: producer index} or None (a chain)", type(feeds).__name__
            )
        )
    out: dict[int, int] = {}
    fed_by: dict[int, int] = {}
    for c, p in feeds.items():
        for what, idx in (("consumer", c), ("producer", p)):
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
                raise InvalidInputError(
                    expected_got(f"{where}[{c!r}]", f"{what} index in 0..{n - 1}", repr(idx))
                )
        if p >= c:
            raise InvalidInputError(
                expected_got(
                    f"{where}[{c}]",
                    f"a producer before op {c} (index < {c})",
                    p,
                    "List the ops in execution order.",
                )
            )
        if p in fed_by:
            raise InvalidInputError(
                expected_got(
                    f"{where}[{c}]",
                    f"op {p} feeding one consumer (a chain)",
                    f"op {p} also feeds op {fed_by[p]}",
                    "Plan the branches as separate blocks.",
                )
            )
        fed_by[p] = c
        out[c] = p
    return out


@dataclass(slots=True)
class _Op:
    call: BlockOp
    ctx: SelectionContext
    report: SelectionReport
    eligible: list[tuple[KernelSpec, float, float]]  # (spec, score.total, score.transform_cost), best first


def _select(i: int, call: BlockOp) -> _Op:
    key, context = _prepared(f"lz.plan_block(ops)[{i}]", call.op, call.args, dict(call.kwargs))
    ctx = context(key)
    try:
        _, report = RUNTIME.select_context(ctx, quiet=True)
    except NoKernelFoundError as exc:
        raise NoKernelFoundError(
            f"lz.plan_block: op {i} ({call.op!r}) has no eligible kernel: {exc}", exc.report
        ) from None
    ranked = sorted(
        (c for c in report.candidates if c.status is not CandidateStatus.REJECTED and c.score),
        key=lambda c: (c.status is not CandidateStatus.SELECTED, -c.score.total),
    )
    reg = RUNTIME.registry
    eligible = [(reg.kernel(c.kernel_id, call.op), c.score.total, c.score.transform_cost) for c in ranked]
    return _Op(call, ctx, report, eligible)


# a DP state: (kernel index in _Op.eligible, output layout); its value: (score, previous state, layout_in,
# node score, transition cost)
_State = tuple[int, Layout | None]


def _step_states(
    o: _Op, fed: bool, prev: dict[_State, tuple[Any, ...]] | None
) -> dict[_State, tuple[Any, ...]]:
    out: dict[_State, tuple[Any, ...]] = {}
    sources = (
        [(None, 0.0, o.ctx.layout)]
        if not fed or not prev
        else [(state, v[0], state[1]) for state, v in prev.items()]
    )
    for k, (spec, total, tcost) in enumerate(o.eligible):
        for state, base, incoming in sources:
            lay = _consumes(spec, incoming)
            node = total + tcost if fed else total
            trans = _transition(incoming, lay) if fed else 0.0
            value = base + node - trans
            cur = out.get((k, lay))
            if cur is None or value > cur[0] + _EPS:
                out[(k, lay)] = (value, state, incoming, node, trans)
    return out


def _solve(
    ops: list[_Op], feeds: dict[int, int], pick: list[int] | None
) -> tuple[float, list[tuple[Any, ...]]]:
    """Best assignment (``pick`` given: the assignment of those kernel indices). Returns the block's total and
    per op ``(kernel index, layout_in, layout_out, node score, transition cost, fed)``."""
    consumer = {p: c for c, p in feeds.items()}
    result: list[tuple[Any, ...]] = [()] * len(ops)
    grand = 0.0
    for head in (i for i in range(len(ops)) if i not in feeds):
        chain = [head]
        while chain[-1] in consumer:
            chain.append(consumer[chain[-1]])
        tables: list[dict[_State, tuple[Any, ...]]] = []
        for pos, i in enumerate(chain):
            table = _step_states(ops[i], pos > 0, tables[-1] if tables else None)
            if pick is not None:
                table = {s: v for s, v in table.items() if s[0] == pick[i]}
            tables.append(table)
        state = max(tables[-1], key=lambda s: tables[-1][s][0])  # first maximum: best-ranked kernel on ties
        grand += tables[-1][state][0]
        for pos in range(len(chain) - 1, -1, -1):
            value, prev, incoming, node, trans = tables[pos][state]
            k, lay = state
            result[chain[pos]] = (
                k,
                _consumes(ops[chain[pos]].eligible[k][0], incoming),
                lay,
                node,
                trans,
                pos > 0,
            )
            state = prev
    return grand, result


def plan_block(ops: Sequence[Any], *, feeds: Mapping[int, int] | None = None) -> BlockPlan:
    """Pick kernels for a block of op calls jointly (e.g. norm -> attention -> norm), minimising the layout
    transforms between them, and explain the choice.

    Args:
        ops: the calls in execution order: ``(op, args, kwargs)``, ``(op, args)`` or :class:`BlockOp`, with
            the arguments ``lz.<op>`` takes (real tensors, or small tensors of the same shapes, dtypes and
            devices; nothing runs).
        feeds: ``{consumer index: producer index}``: which op's output feeds which op. Default ``None``: a
            chain, op ``i`` feeds op ``i + 1``; ``{}``: independent ops. Each producer feeds at most one
            consumer.

    Returns:
        A :class:`BlockPlan`: per op the chosen kernel, its standalone pick, layouts and transition cost; the
        block's score and the transforms saved. ``print()`` it; ``with plan.apply():`` runs the block's calls
        on the chosen kernels.

    Score: ``sum(node scores) - sum(transition costs)``, maximised by dynamic programming over each chain; a
    node score is the kernel's selection score (``lz.explain``), without its caller-layout transform when
    another op of the block feeds it; a transition costs :data:`TRANSFORM_COST` when the producer's output
    layout differs from the layout the kernel consumes. On a tie the standalone picks win.

    Raises:
        InvalidInputError: ``ops`` empty or not a list of calls, an op's arguments invalid, a bad ``feeds``
            index
        (out of range, not before its consumer, a producer feeding two ops). UnknownOperationError: an unknown
        op.
        NoKernelFoundError: an op with no eligible kernel (``.report`` lists every candidate's reasons).

    >>> ops = [("rms_norm", (x, w), {}), ("attention", (q, k, v), {"layout": "BSHD"})]  # doctest: +SKIP
    >>> plan = lz.plan_block(ops)  # doctest: +SKIP
    >>> print(plan)  # doctest: +SKIP
    """
    calls = _calls(ops)
    links = _feeds(feeds, len(calls))
    RUNTIME.ensure_ready()
    selected = [_select(i, c) for i, c in enumerate(calls)]
    greedy_total, greedy = _solve(selected, links, [0] * len(selected))
    total, joint = _solve(selected, links, None)
    if total <= greedy_total + _EPS:
        total, joint = greedy_total, greedy
    steps = []
    for i, (o, (k, lay_in, lay_out, node, trans, _)) in enumerate(zip(selected, joint, strict=True)):
        spec = o.eligible[k][0]
        steps.append(
            BlockStep(
                i,
                o.call.op,
                spec.kernel_id,
                o.report.chosen or spec.kernel_id,
                links.get(i),
                None if lay_in is None else lay_in.value,
                None if lay_out is None else lay_out.value,
                trans,
                node,
                _why(i, o, k, greedy[i], trans, links),
                o.report,
            )
        )
    return BlockPlan(
        tuple(steps), total, greedy_total, _conversions(joint, selected), _conversions(greedy, selected)
    )


def _conversions(assignment: list[tuple[Any, ...]], ops: list[_Op]) -> int:
    """Layout conversions: block edges with a transition cost, plus caller-layout transforms of unfed ops."""
    return sum(
        1
        for (k, _, _, _, trans, fed), o in zip(assignment, ops, strict=True)
        if trans > 0 or (not fed and o.eligible[k][2] > 0)
    )


def _why(i: int, o: _Op, k: int, greedy: tuple[Any, ...], trans: float, links: dict[int, int]) -> str:
    spec, total, tcost = o.eligible[k]
    if k == 0:
        base = "standalone best"
    else:
        best, btotal, _ = o.eligible[0]
        base = (
            f"score {total:.1f} < {best.kernel_id}'s {btotal:.1f} standalone, but its layout avoids "
            "transforms"
        )
    parts = [base]
    if trans:
        parts.append(f"transition {trans:.1f} from op {links[i]}'s output layout")
    elif i in links and greedy[4] and k != greedy[0]:
        parts.append(f"saves the {greedy[4]:.1f} transition the standalone pick pays")
    if tcost and i not in links:
        parts.append(f"caller-layout transform {tcost:.1f} (in its score)")
    return "; ".join(parts)


__all__ = ["TRANSFORM_COST", "BlockOp", "BlockPlan", "BlockStep", "plan_block"]
