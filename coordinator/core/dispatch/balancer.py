"""Per-rank load table and the policies that pick an engine for a request.

Theory of operation
-------------------
Every engine reports `(waiting, running, kv_cache_usage)` together with the
`(wave, step)` it had reached. `LoadTable` keeps one row per global DP rank in
`[0, size)` and is the only place those reports land:

* A report for a rank outside the table is dropped (`applied=False`); this
  happens around elastic resizes and must never touch another row.
* Each row remembers the last `(wave, step)` its own engine reported. A report
  that goes backwards for the same engine is flagged stale (for logs and
  counters) but still applied: one engine's PUSH stream is FIFO, so a step
  mark can only move backwards when that engine's counters restarted, and its
  newest numbers are then the truth. Reports from different engines are never
  compared with each other for staleness, so a slightly slower rank is not
  mistaken for an out-of-order one.
* In lockstep mode all ranks step together, so a report for a newer step than
  any seen before means the previous step is complete. If the table changed
  since the last publish, the rows as they were *before* that report are kept
  as a pending snapshot, and the next publish sends that whole-step view
  first; the current rows follow one interval later. Dense mode has no common
  steps and takes no snapshots. The snapshot is copy-on-write: taking one
  costs nothing, and each row keeps its old value the first time it changes
  afterwards, so no report ever pays for the whole table.
* Between reports the coordinator counts what it dispatched to each rank
  (`dispatched_since_report`); the next report from that rank already
  includes those requests, so the counter is reset when it arrives.

Policies only ever see the ranks the caller says are dispatchable (dead,
draining and cordoned ranks are filtered out before), score them with
`load_score`, and return one rank or None.

Costs: a report or a dispatch changes one row and its score, O(1). The rows
a publish sends are kept as tuples, ready to encode. A pick reads the
candidates' scores in one C-level pass (`LoadTable.scores_of`, a list slice
when the candidates are a run of consecutive ranks, as they usually are).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import Protocol

from coordinator.core.dispatch.prefix_rule import RecentDispatches

# Extra weight for waiting requests on an engine whose KV cache is past this
# fraction: a queue there drains slowly because new sequences cannot be admitted.
KV_PRESSURE_THRESHOLD = 0.5
KV_PRESSURE_WEIGHT = 6.0
# Picks the tie rule looks back on: enough to spread an idle group's new work
# evenly, short enough to forget a burst within a few seconds of traffic.
RECENT_WINDOW = 256

Row = tuple[int, int, float]


@dataclass
class RankLoad:
    """What is known about one rank's load."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    dispatched_since_report: int = 0
    last_step: tuple[int, int] | None = None
    reports: int = 0


@dataclass(frozen=True)
class StatsOutcome:
    """Result of one stats report: whether it landed, was stale, or froze a snapshot."""

    applied: bool
    stale: bool
    snapshot_taken: bool


_EMPTY_ROW: Row = (0, 0, 0.0)
_DROPPED = StatsOutcome(applied=False, stale=False, snapshot_taken=False)
# Reports are the hot path: share the four possible outcomes instead of building one each.
_APPLIED = {
    (stale, snapshot): StatsOutcome(applied=True, stale=stale, snapshot_taken=snapshot)
    for stale in (False, True)
    for snapshot in (False, True)
}


def is_stale_report(last: tuple[int, int] | None, wave: int, step: int) -> bool:
    """True if `(wave, step)` goes backwards from the same engine's previous mark.

    A first report, a repeat of the same mark and any report from a later wave
    (whatever its step, since steps restart per wave) are not stale.
    """
    if last is None:
        return False
    last_wave, last_step = last
    if wave != last_wave:
        return wave < last_wave
    return step < last_step


StepMark = tuple[int, int]


def step_snapshot(step_mark: StepMark | None, changed: bool,
                  mark: StepMark) -> tuple[StepMark, bool]:
    """The lockstep step rule: the step mark after a report marked ``mark`` (its
    ``(wave, step)``), and whether that report takes a snapshot (it raises the mark
    while the rows hold unpublished changes). ``LoadTable.apply_stats`` applies it,
    and a batched reader replays it to know which reports it may skip."""
    if step_mark is None or mark > step_mark:
        return mark, changed
    return step_mark, False


def step_state_unchanged(step_mark: StepMark | None, changed: bool, mark: StepMark) -> bool:
    """Whether a report marked ``mark`` leaves the step mark, the changed flag and so
    every later snapshot decision exactly as they are (see ``step_snapshot``)."""
    return changed and step_mark is not None and mark <= step_mark


class LoadTable:
    """Rows of load for global DP ranks `[0, size)`, plus the step snapshot."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"load table size must be >= 0, got {size}")
        self._rows: list[RankLoad] = [RankLoad() for _ in range(size)]
        # What a publish sends for each row, kept current: `rows()` is a list copy.
        self._published: list[Row] = [_EMPTY_ROW] * size
        # load_score of every row, kept current, so a pick is a scan over floats.
        self._scores: list[float] = [0.0] * size
        self._changed = False
        # Highest (wave, step) reported by any engine; lockstep only.
        self._step_mark: tuple[int, int] | None = None
        # The pending snapshot: the rows that changed since it was taken, with the
        # values they had then (None: no snapshot pending).
        self._snapshot: dict[int, Row] | None = None
        # `scores_of`'s reader for the last candidates list it was given.
        self._view: tuple[Sequence[int], int, Callable[[list[float]], Sequence[float]]] | None
        self._view = None

    @property
    def size(self) -> int:
        return len(self._rows)

    @property
    def changed(self) -> bool:
        """True while the table holds counts that have not been published."""
        return self._changed

    @property
    def step_mark(self) -> tuple[int, int] | None:
        """Highest `(wave, step)` seen in lockstep reports, or None before any."""
        return self._step_mark

    @property
    def snapshot_pending(self) -> bool:
        return self._snapshot is not None

    def _has_rank(self, rank: int) -> bool:
        return 0 <= rank < len(self._rows)

    def apply_stats(
        self,
        rank: int,
        *,
        waiting: int,
        running: int,
        kv_cache_usage: float,
        wave: int,
        step: int,
        lockstep: bool,
    ) -> StatsOutcome:
        """Record one engine report; see the module docstring for the rules."""
        if not 0 <= rank < len(self._rows):
            return _DROPPED
        row = self._rows[rank]
        mark = (wave, step)
        stale = is_stale_report(row.last_step, wave, step)
        snapshot_taken = False
        if lockstep:
            self._step_mark, snapshot_taken = step_snapshot(self._step_mark, self._changed, mark)
            if snapshot_taken:
                self._snapshot = {}
        snapshot = self._snapshot
        if snapshot is not None and rank not in snapshot:
            snapshot[rank] = self._published[rank]
        row.waiting = waiting
        row.running = running
        row.kv_cache_usage = kv_cache_usage
        row.dispatched_since_report = 0
        row.last_step = mark
        row.reports += 1
        self._published[rank] = (waiting, running, float(kv_cache_usage))
        self._scores[rank] = load_score(row)
        self._changed = True
        return _APPLIED[stale, snapshot_taken]

    def note_dispatched(self, rank: int, n: int = 1) -> None:
        """Count `n` requests the coordinator sent to `rank` since its last report."""
        if 0 <= rank < len(self._rows):
            row = self._rows[rank]
            row.dispatched_since_report += n
            self._scores[rank] = load_score(row)

    def resize(self, size: int) -> None:
        """Grow with empty rows or truncate to `size` ranks.

        A pending snapshot has the old row count and is dropped, and the table
        is marked changed so front-ends soon see rows for every rank; a
        front-end that manages a new rank cannot route to it without one.
        """
        if size < 0:
            raise ValueError(f"load table size must be >= 0, got {size}")
        if size == len(self._rows):
            return
        if size < len(self._rows):
            del self._rows[size:]
            del self._scores[size:]
            del self._published[size:]
        else:
            grow = size - len(self._rows)
            self._scores.extend([0.0] * grow)
            self._published.extend([_EMPTY_ROW] * grow)
            self._rows.extend(RankLoad() for _ in range(grow))
        self._snapshot = None
        self._view = None
        self._changed = True

    def rows(self) -> list[Row]:
        """Current `(waiting, running, kv_cache_usage)` per rank, in rank order."""
        return list(self._published)

    def score(self, rank: int) -> float:
        """`load_score` of `rank`'s row (kept current as the row changes)."""
        return self._scores[rank]

    def scores_of(self, candidates: Sequence[int]) -> Sequence[float]:
        """`load_score` of each candidate, aligned with `candidates` (inf outside the table).

        The way to read them is worked out once per candidates list (by identity:
        pass a list that is not modified afterwards, as `Membership.dispatchable`
        returns) and is then one C-level pass.
        """
        view = self._view
        if view is None or view[0] is not candidates or view[1] != len(candidates):
            view = self._view = (candidates, len(candidates), self._reader(candidates))
        return view[2](self._scores)

    def _reader(self, candidates: Sequence[int]) -> Callable[[list[float]], Sequence[float]]:
        count, size = len(candidates), len(self._rows)
        if count == 0:
            return lambda scores: ()
        first = candidates[0]
        if first >= 0 and first + count <= size and list(candidates) == list(
                range(first, first + count)):
            end = first + count
            return lambda scores: scores[first:end]
        if all(0 <= rank < size for rank in candidates):
            if count == 1:
                return lambda scores: (scores[first],)
            return itemgetter(*candidates)
        ranks = list(candidates)
        return lambda scores: [scores[r] if 0 <= r < size else math.inf for r in ranks]

    def load(self, rank: int) -> RankLoad:
        """The live row for `rank` (read it, do not modify it)."""
        if not self._has_rank(rank):
            raise IndexError(f"rank {rank} is outside the load table [0, {len(self._rows)})")
        return self._rows[rank]

    def take_publish_rows(self) -> list[Row]:
        """Rows for the next full publish.

        A pending step snapshot goes first and leaves `changed` set, so the
        current rows follow at the next interval; otherwise the current rows
        are returned and `changed` is cleared.
        """
        rows = list(self._published)
        snapshot = self._snapshot
        if snapshot is not None:
            self._snapshot = None
            for rank, row in snapshot.items():
                rows[rank] = row
            return rows
        self._changed = False
        return rows


def load_score(load: RankLoad) -> float:
    """Lower is better: vLLM 0.33's engine score with in-flight work counted.

    vLLM's front-end counts its own in-flight requests and bumps the waiting
    count of the engine it just chose until the next publish arrives. Here the
    coordinator is the single dispatcher, so the requests it sent since the
    engine's last report are exactly the work that report does not show yet;
    they are added to `waiting`. Waiting work is then penalised in proportion
    to KV cache pressure above half full, since such a queue drains slowly.
    """
    waiting = load.waiting + load.dispatched_since_report
    score = float(waiting + load.running)
    if waiting > 0:
        pressure = max(0.0, load.kv_cache_usage - KV_PRESSURE_THRESHOLD)
        score += waiting * KV_PRESSURE_WEIGHT * pressure
    return score


class BalancePolicy(Protocol):
    """Chooses one rank among `candidates` (all dispatchable) or None if there are none.

    `session_rank`, when the caller knows it, is the rank that served the
    request's session last; policies prefer it among equally good ranks.
    """

    name: str

    def pick(self, table: LoadTable, candidates: Sequence[int],
             session_rank: int | None = None) -> int | None: ...


class LeastLoaded:
    """Full scan for the lowest score; ties by the sticky rule, never by rotation.

    Equal scores go to the session's last rank when the caller knows it, then
    to the rank that got the fewest of the last ``RECENT_WINDOW`` picks, then
    to the lowest rank id (``routing.pick_least_loaded_sticky``). A rotating
    tie-break would send consecutive turns of one conversation to different
    ranks whenever the group is idle, each turn missing the prefix cache the
    previous one built (vLLM issue 52463); this rule is deterministic and
    still spreads new work over the ranks that recently got least. `rng` is
    accepted so every entry of `POLICIES` is built the same way; this policy
    needs no randomness.
    """

    name = "least-loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.recent = RecentDispatches(RECENT_WINDOW)

    def pick(self, table: LoadTable, candidates: Sequence[int],
             session_rank: int | None = None) -> int | None:
        count = len(candidates)
        if count == 0:
            return None
        # Unscorable candidates get +inf so they only "win" when nothing else exists.
        candidate_scores = table.scores_of(candidates)
        low = min(candidate_scores)
        if low == math.inf:
            return None
        lowest = candidate_scores.count(low)
        if lowest == 1:
            chosen = candidates[candidate_scores.index(low)]
        else:
            # pick_least_loaded_sticky's order, without its general bookkeeping: an idle
            # group ties every rank on every submit.
            tied = candidates if lowest == count else list(
                compress(candidates, map(low.__eq__, candidate_scores)))
            if session_rank is not None and session_rank in tied:
                chosen = session_rank
            else:
                chosen = self.recent.least_recent(tied)
        self.recent.note(chosen)
        return chosen


class PowerOfTwoChoices:
    """Sample two distinct candidates and take the less loaded one.

    Load reports lag behind the engines by up to one stats interval; on such
    information a full scan can send a burst to the same apparently idle
    engine (herding), while the best of two random choices stays close to
    balanced, especially for large groups. Equal samples are decided by the
    same sticky rule as `LeastLoaded`. Randomness comes only from the
    injected `rng`, so runs are reproducible.
    """

    name = "p2c"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._scan = LeastLoaded()
        self.recent = self._scan.recent

    def pick(self, table: LoadTable, candidates: Sequence[int],
             session_rank: int | None = None) -> int | None:
        count = len(candidates)
        if count < 2:
            return self._scan.pick(table, candidates, session_rank)
        first = self._rng.randrange(count)
        second = self._rng.randrange(count - 1)
        if second >= first:
            second += 1
        pair = [candidates[first], candidates[second]]
        if not (table._has_rank(pair[0]) and table._has_rank(pair[1])):
            # Only reachable if the caller passed ranks the table does not
            # cover; a scan skips them reliably.
            return self._scan.pick(table, candidates, session_rank)
        return self._scan.pick(table, pair, session_rank)


POLICIES: dict[str, Callable[..., BalancePolicy]] = {
    LeastLoaded.name: LeastLoaded,
    PowerOfTwoChoices.name: PowerOfTwoChoices,
}


def make_policy(name: str, rng: random.Random) -> BalancePolicy:
    """Build the policy registered under `name`; ValueError lists the known names."""
    factory = POLICIES.get(name)
    if factory is None:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown balance policy {name!r}; choose one of: {known}")
    return factory(rng)


def balance_ratio(loads: Sequence[int]) -> float:
    """Mean over max of per-rank load: 1.0 is perfectly even (or all idle), 1/N is one rank."""
    peak = max(loads, default=0)
    if peak <= 0:
        return 1.0
    return sum(loads) / len(loads) / peak
