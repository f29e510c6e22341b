"""Choosing the rank for a request from its load and what each rank has cached.

Theory of operation
-------------------
Work is counted in tokens. A request costs a rank the prompt tokens that rank
must still compute (its cached prefix is free) plus ``decode_weight`` for
the decode steps that follow::

    cost(r)  = max(prompt_tokens - cached_tokens(r), 0) + decode_weight
    after(r) = load(r) + cost(r)

``load(r)`` is what the rank already has to do, from its latest stats
report and what the coordinator sent it since (``TokenLoad``)::

    load(r) = waiting * queued_request_tokens + running * decode_weight
              + cost of every request dispatched to r since its report

The coordinator is the one dispatcher, so the last term is exactly the work
the report cannot show yet. ``queued_request_tokens`` follows the average
cost of recent dispatches.

Lockstep groups step together: the busiest rank sets every rank's step
time, so the first objective is the group's maximum load after the request,
``M' = max(after(r), max of the other ranks' loads)``. Where some rank can
take the request without raising the current maximum ``M``, every such
rank leaves ``M' = M`` and no other rank may be chosen: work placed on a
rank below the maximum runs in steps the group takes anyway, while a rank
at the maximum (the busiest) would make every rank wait longer, however
much of the prompt it has cached. Where every rank raises the maximum,
``M'`` is ``after(r)``. In dense mode ranks do not wait for each other and
the objective is ``after(r)`` itself: the rank's queue ahead of the request
plus its uncached prompt.

Within the ranks the load rule allows (the *pool*), the request's own wait
still matters: a rank with a long queue serves it later even where the
group's step time does not change. So every situation keeps the pool's
ranks whose ``after`` is within ``slack_tokens`` of the pool's lowest
(*near-equal*), and the preference order decides among them. The slack is
the load/cache trade-off: the extra load accepted to keep a request on the
rank with its longest cached prefix or its session (0: lowest cost wins,
ties still broken below; larger: locality wins over balance more often).

==============  ================================  ============================
situation       when                              pool
==============  ================================  ============================
FITS_UNDER_MAX  lockstep; some ``after(r) <= M``  ranks with ``after(r) <= M``
RAISES_MAX      lockstep; every ``after(r) > M``  every candidate
DENSE           dense mode                        every candidate
==============  ================================  ============================

Then, among the near-equal ranks of the pool, in this order (``PREFERENCES``):

=======  ==================================================================
reason   the rank preferred
=======  ==================================================================
prefix   the longest cached prefix
session  the rank that served this request's session last
load     the lowest ``after(r)``
spread   the fewest dispatches among the recent ones (``RecentDispatches``)
rank     the lowest rank id
=======  ==================================================================

A decision's reason is the first preference that separated the chosen
rank from the runner-up, or ``cost`` when only one rank was near-equal.
Nothing rotates and nothing is random: the same inputs give the same rank,
in whatever order the candidates come. Among near-equal ranks with equal
prefixes the session's last rank goes first, so a multi-turn conversation
stays where its cache is at low load instead of being spread by a rotating
tie-break (vLLM issue 52463), and new sessions spread over the ranks that
recently got least.

Guarantees, for the load rule alone: in lockstep, the group's maximum after
the request is at most the lowest maximum any candidate could give plus
``slack_tokens``, and exactly that lowest maximum when some candidate
fits under the current one (then the busiest rank is never chosen); in
dense mode, ``after`` of the chosen rank is within ``slack_tokens`` of the
lowest.

``pick_least_loaded_sticky`` is the same tie rule for the plain least-loaded
policy, which has scores but no cache information.

This module does no IO and reads no clock.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import Protocol

__all__ = [
    "PREFERENCES",
    "RecentDispatches",
    "RouteDecision",
    "RouteReason",
    "RoutingConfig",
    "SessionAffinity",
    "Situation",
    "TokenLoad",
    "choose_rank",
    "pick_least_loaded_sticky",
]


class CountTable(Protocol):
    """Where the counts come from (``balancer.LoadTable``, which imports this module)."""

    def rows(self) -> list[tuple[int, int, float]]:
        """``(waiting, running, kv_cache_usage)`` of every rank, by rank."""
        ...


@dataclass(frozen=True)
class RoutingConfig:
    """The knobs of the rule, in tokens.

    ``slack_tokens`` is the load/cache trade-off (see the module docstring).
    ``decode_weight`` is what one request's decode phase is worth in prompt
    tokens; it also prices a running request. ``queued_request_tokens`` is
    the starting estimate for a waiting request, before any dispatch was seen.
    """

    lockstep: bool = True
    decode_weight: float = 128.0
    slack_tokens: float = 256.0
    queued_request_tokens: float = 512.0

    def __post_init__(self) -> None:
        for name in ("decode_weight", "slack_tokens", "queued_request_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class Situation(enum.Enum):
    """How the request relates to the current loads; it picks the pool (see the table)."""

    FITS_UNDER_MAX = "fits_under_max"
    RAISES_MAX = "raises_max"
    DENSE = "dense"


class RouteReason(enum.Enum):
    """What decided among the near-equal ranks (a metric label)."""

    COST = "cost"  # only one rank was near-equal
    PREFIX = "prefix"
    SESSION = "session"
    LOAD = "load"
    SPREAD = "spread"
    RANK = "rank"


PREFERENCES: tuple[RouteReason, ...] = (
    RouteReason.PREFIX,
    RouteReason.SESSION,
    RouteReason.LOAD,
    RouteReason.SPREAD,
    RouteReason.RANK,
)


@dataclass(frozen=True)
class RouteDecision:
    """The chosen rank and why, with the numbers the rule used for it."""

    rank: int
    reason: RouteReason
    situation: Situation
    cached_tokens: int
    cost: float  # tokens of work the request adds to the rank
    load_after: float  # the rank's load after the request
    group_max_after: float  # the largest load in the group after the request


def _reason(winner: tuple[float, ...], runner_up: tuple[float, ...]) -> RouteReason:
    for preference, mine, theirs in zip(PREFERENCES, winner, runner_up, strict=True):
        if mine != theirs:
            return preference
    raise AssertionError("two candidates with the same rank id")  # pragma: no cover


def choose_rank(
    candidates: Sequence[int],
    loads: Sequence[float],
    cached_tokens: Sequence[int] | None,
    prompt_tokens: int,
    config: RoutingConfig,
    *,
    session_rank: int | None = None,
    recent: Sequence[int] | None = None,
    others_max: float = 0.0,
) -> RouteDecision | None:
    """Apply the rule; None if there are no candidates.

    ``loads``, ``cached_tokens`` (None: nothing known to be cached) and
    ``recent`` are aligned with ``candidates``, which must be distinct.
    ``others_max`` is the largest load among ranks that step with the group
    but may not be chosen (draining, cordoned).
    """
    count = len(candidates)
    if count == 0:
        return None
    if len(loads) != count:
        raise ValueError(f"{len(loads)} loads for {count} candidates")
    if cached_tokens is not None and len(cached_tokens) != count:
        raise ValueError(f"{len(cached_tokens)} cached counts for {count} candidates")
    if recent is not None and len(recent) != count:
        raise ValueError(f"{len(recent)} recent counts for {count} candidates")
    decode_weight = config.decode_weight
    hits = cached_tokens if cached_tokens is not None else [0] * count
    costs = [max(prompt_tokens - hit, 0) + decode_weight for hit in hits]
    after = [load + cost for load, cost in zip(loads, costs, strict=True)]
    current_max = max(max(loads), others_max)

    pool: Sequence[int]
    if not config.lockstep:
        situation = Situation.DENSE
        pool = range(count)
    else:
        pool = [i for i in range(count) if after[i] <= current_max]
        if pool:
            situation = Situation.FITS_UNDER_MAX
        else:
            situation = Situation.RAISES_MAX
            pool = range(count)
    limit = min(after[i] for i in pool) + config.slack_tokens
    near = [i for i in pool if after[i] <= limit]

    if len(near) == 1:
        chosen = near[0]
        reason = RouteReason.COST
    else:
        keys = [
            (
                -hits[i],
                0 if candidates[i] == session_rank else 1,
                after[i],
                recent[i] if recent is not None else 0,
                candidates[i],
            )
            for i in near
        ]
        best = min(range(len(near)), key=keys.__getitem__)
        runner_up = min((j for j in range(len(near)) if j != best), key=keys.__getitem__)
        chosen = near[best]
        reason = _reason(keys[best], keys[runner_up])
    return RouteDecision(
        rank=candidates[chosen],
        reason=reason,
        situation=situation,
        cached_tokens=hits[chosen],
        cost=costs[chosen],
        load_after=after[chosen],
        group_max_after=max(current_max, after[chosen]),
    )


def pick_least_loaded_sticky(
    scores: Sequence[float],
    candidates: Sequence[int],
    *,
    session_rank: int | None = None,
    recent: Sequence[int] | None = None,
) -> tuple[int, RouteReason] | None:
    """The lowest score; ties go to the session's last rank, then the least recent, then rank id.

    The deterministic tie rule for ``LeastLoaded`` (DESIGN rule 5: no blind
    rotation). ``scores`` and ``recent`` are aligned with ``candidates``.
    Returns the rank and the reason (``COST`` when its score was the only
    lowest), or None without candidates.
    """
    count = len(candidates)
    if count == 0:
        return None
    if len(scores) != count or (recent is not None and len(recent) != count):
        raise ValueError("scores and recent must be aligned with candidates")
    low = min(scores)
    tied = [i for i in range(count) if scores[i] == low]
    if len(tied) == 1:
        return candidates[tied[0]], RouteReason.COST
    keys = {
        i: (
            0.0,
            0 if candidates[i] == session_rank else 1,
            0.0,
            recent[i] if recent is not None else 0,
            candidates[i],
        )
        for i in tied
    }
    ordered = sorted(tied, key=keys.__getitem__)
    return candidates[ordered[0]], _reason(keys[ordered[0]], keys[ordered[1]])


class TokenLoad:
    """Per-rank work in tokens: what stats reports show, plus what was sent since.

    The composed core calls ``note_dispatched`` with a decision's ``cost``
    when it sends a request and ``on_report`` when the rank's stats arrive
    (they include everything sent before), as ``LoadTable`` does with counts.
    """

    # How fast the estimate for a waiting request follows recent dispatch costs.
    SMOOTHING = 1.0 / 16.0

    def __init__(self, size: int, config: RoutingConfig) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self._config = config
        self._pending: list[float] = [0.0] * size
        self.queued_request_tokens = config.queued_request_tokens

    @property
    def size(self) -> int:
        return len(self._pending)

    def resize(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        del self._pending[size:]
        self._pending.extend([0.0] * (size - len(self._pending)))

    def note_dispatched(self, rank: int, cost: float) -> None:
        if 0 <= rank < len(self._pending):
            self._pending[rank] += cost
        self.queued_request_tokens += self.SMOOTHING * (cost - self.queued_request_tokens)

    def forget(self, rank: int, cost: float) -> None:
        """Take back a ``note_dispatched`` whose request never left (its send failed)."""
        if 0 <= rank < len(self._pending):
            self._pending[rank] = max(0.0, self._pending[rank] - cost)

    def on_report(self, rank: int) -> None:
        """A stats report from ``rank`` arrived: it covers everything sent before."""
        if 0 <= rank < len(self._pending):
            self._pending[rank] = 0.0

    def pending(self, rank: int) -> float:
        return self._pending[rank] if 0 <= rank < len(self._pending) else 0.0

    def load(self, rank: int, waiting: int, running: int) -> float:
        """``load(r)`` of the module docstring from a report's counts."""
        return (
            waiting * self.queued_request_tokens
            + running * self._config.decode_weight
            + self.pending(rank)
        )

    def loads(self, table: CountTable, ranks: Sequence[int]) -> list[float]:
        """``load(r)`` for each of ``ranks``, from the counts in ``table``'s rows."""
        rows = table.rows()
        pending = self._pending
        waiting_weight = self.queued_request_tokens
        running_weight = self._config.decode_weight
        size = len(pending)
        return [rows[rank][0] * waiting_weight + rows[rank][1] * running_weight
                + (pending[rank] if rank < size else 0.0) for rank in ranks]


class RecentDispatches:
    """How many of the last ``window`` dispatches went to each rank (rank ids, >= 0)."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._ranks: deque[int] = deque(maxlen=window)
        # Counts by rank id, in a list so that ``least_recent`` reads them in C.
        self._by_rank: list[int] = []

    def note(self, rank: int) -> None:
        if rank < 0:
            return
        ranks, by_rank = self._ranks, self._by_rank
        if len(ranks) == ranks.maxlen:
            by_rank[ranks[0]] -= 1
        ranks.append(rank)
        if rank >= len(by_rank):
            by_rank.extend([0] * (rank + 1 - len(by_rank)))
        by_rank[rank] += 1

    def count(self, rank: int) -> int:
        by_rank = self._by_rank
        return by_rank[rank] if 0 <= rank < len(by_rank) else 0

    def counts(self, ranks: Sequence[int]) -> list[int]:
        by_rank, size = self._by_rank, len(self._by_rank)
        return [by_rank[rank] if 0 <= rank < size else 0 for rank in ranks]

    def least_recent(self, ranks: Sequence[int]) -> int:
        """Of ``ranks`` (rank ids, not empty), the one with the fewest recent picks, then
        the lowest.

        An idle group ties every rank on every submit, so this reads the counts in C
        (``itemgetter`` over the counts by rank) rather than rank by rank.
        """
        if len(ranks) == 1:
            return ranks[0]
        by_rank = self._by_rank
        try:
            counts: Sequence[int] = itemgetter(*ranks)(by_rank)
        except IndexError:  # a rank never picked yet, past the end of the list
            by_rank.extend([0] * (max(ranks) + 1 - len(by_rank)))
            counts = itemgetter(*ranks)(by_rank)
        low = min(counts)
        if counts.count(low) == 1:
            return ranks[counts.index(low)]
        return min(compress(ranks, map(low.__eq__, counts)))


class SessionAffinity:
    """The rank that last served each session, for the most recent ``max_sessions`` sessions."""

    def __init__(self, max_sessions: int = 65_536) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def note(self, session: str, rank: int) -> None:
        last = self._last
        last.pop(session, None)
        if len(last) >= self.max_sessions:
            last.popitem(last=False)
        last[session] = rank

    def rank_for(self, session: str | None) -> int | None:
        if session is None:
            return None
        return self._last.get(session)
