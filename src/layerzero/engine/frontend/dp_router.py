"""``DPRouter``: which data-parallel replica serves a new request. The least-loaded replica (requests in
flight), unless another replica already holds a prefix of the prompt in its prefix cache and is not much
busier (SGLang's cache-aware router; vLLM's DP load balancing counts load only). Plain data, no I/O: the front
end (:class:`~layerzero.engine.AsyncLLM`) calls :meth:`DPRouter.pick` before sending a request and
:meth:`DPRouter.finished` when it ends.

A replica's cache is not observed: the router remembers which replica it last sent each full prompt block to
(a hash chain over ``block_size``-token blocks, as the engine's hash prefix cache keys them), at most
``max_blocks`` of them (least recently used forgotten first). A remembered block may have been evicted from
that replica since; the cost of such a guess is one ordinary prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..errors import bad_config

__all__ = ["DPRouter"]


class DPRouter:
    """Routes requests over ``num_replicas`` replicas.

    Args:
        num_replicas: replicas (``data_parallel_size``), >= 1.
        block_size: tokens per KV block (the engine's ``block_size``): prefixes match in whole blocks.
        balance_slack: a replica holding a prefix is chosen while its load (requests in flight) is at most the
            least-loaded replica's plus this; beyond, load wins.
        max_blocks: prompt blocks remembered (LRU).

    Raises:
        ConfigurationError: an argument out of range.
    """

    def __init__(
        self, num_replicas: int, block_size: int, *, balance_slack: int = 4, max_blocks: int = 1 << 16
    ) -> None:
        for name, v, least in (
            ("num_replicas", num_replicas, 1),
            ("block_size", block_size, 1),
            ("balance_slack", balance_slack, 0),
            ("max_blocks", max_blocks, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise bad_config(f"DPRouter {name}", f"an int >= {least}", repr(v))
        self.block_size, self.balance_slack, self.max_blocks = block_size, balance_slack, max_blocks
        self.load = [0] * num_replicas
        self._owner: OrderedDict[int, int] = OrderedDict()  # block chain hash -> replica it was sent to
        self._inflight: dict[str, int] = {}  # request id -> replica
        #: requests routed by a prefix match (the rest by load); for metrics and tests
        self.prefix_routed = 0

    def _chain(self, prompt: Sequence[int]) -> list[int]:
        """The hash of each full block of ``prompt`` chained with the blocks before it."""
        out, h, bs = [], 0, self.block_size
        for start in range(0, len(prompt) - bs + 1, bs):
            h = hash((h, tuple(prompt[start : start + bs])))
            out.append(h)
        return out

    def pick(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        """The replica for a new request (and count it as in flight there until :meth:`finished`)."""
        chain = self._chain(prompt_token_ids)
        least = min(range(len(self.load)), key=self.load.__getitem__)
        choice, matched = least, 0
        for depth, h in enumerate(chain, 1):  # the deepest remembered block names the replica
            owner = self._owner.get(h)
            if owner is None:
                break
            matched, candidate = depth, owner
        if matched and self.load[candidate] <= self.load[least] + self.balance_slack:
            choice = candidate
            self.prefix_routed += 1
        for h in chain:
            self._owner[h] = choice
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)
        self.load[choice] += 1
        self._inflight[request_id] = choice
        return choice

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving ``request_id`` while it is in flight, else None."""
        return self._inflight.get(request_id)

    def finished(self, request_id: str) -> None:
        """``request_id`` ended (finished, aborted or failed); unknown ids are ignored."""
        replica = self._inflight.pop(request_id, None)
        if replica is not None:
            self.load[replica] -= 1
