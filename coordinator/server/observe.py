"""What operators see: a snapshot of the core, handed to the HTTP thread.

The coordinator's event loop never serves HTTP itself. About every 250 ms, and
soon after every wave or membership change (the core's ``RefreshObserved``),
it builds an immutable ``ObservedState`` from the core's queries and hands it
to ``HttpEndpoints.update``, which swaps one reference. Snapshots go out at
most every 50 ms unless forced: a burst of changes then costs one snapshot at
the end of that interval, and no change waits for the next tick.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.core.coordinator import CoordinatorCore
from coordinator.core.observe.views import PrefixView, RankView
from coordinator.core.ranks.readiness import NOT_JUDGED, Readiness
from coordinator.protocol.frontend import group_state_to_builtins

# Snapshots not forced by the timer are at least this far apart.
MIN_INTERVAL_S = 0.05


# From 10 µs to 10 ms: a decision over 32 ranks and a few thousand prompt tokens
# takes tens to hundreds of microseconds.
DECISION_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class DecisionTimes:
    """How long the core took over each submit or route call (the rank's choice and
    the dispatch built on it), measured by the server around the core's call.

    The time is the event loop thread's CPU time: what the decision costs, apart
    from the time the host had the process wait for a CPU (on a busy host that
    dominates any wall-clock measure of a few hundred microseconds). Under a flood
    calls are sampled (``feeders.DECISION_SAMPLE_SPACING_S``): the histogram's
    count is of the calls timed, not of every call."""

    def __init__(self) -> None:
        self.counts = [0] * (len(DECISION_BUCKETS) + 1)
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(DECISION_BUCKETS, seconds)] += 1
        self.total_s += seconds

    def snapshot(self) -> tuple[tuple[int, ...], float]:
        """Counts per bucket (not cumulative; the last is +Inf) and their sum."""
        return tuple(self.counts), self.total_s


@dataclass(frozen=True)
class ObservedState:
    """Everything the HTTP thread may show, taken at one moment by the loop.

    Build a new one each time, with new lists and dicts: the HTTP thread reads it
    without a lock, so nothing in it may change after `update` is called.
    """

    taken_at: float
    """`time.monotonic()` when the loop took the snapshot."""
    wave: int
    running: bool
    lockstep: bool
    ranks: list[RankView]
    counters: dict[str, int] = field(default_factory=dict)
    waves_total: int = 0
    seconds_running: float = 0.0
    seconds_paused: float = 0.0
    wake_latencies_s: list[float] = field(default_factory=list)
    """Wake latencies measured since the previous snapshot (each is counted once)."""
    watchdog: list[dict[str, object]] = field(default_factory=list)
    """Active watchdog alerts (`WatchdogAlert.as_dict()`)."""
    recorder_tail: list[dict[str, object]] = field(default_factory=list)
    """Flight recorder tail (`FlightRecorder.as_json()`), oldest first."""
    all_ready: bool = False
    state_json: dict[str, object] = field(default_factory=dict)
    """Extra JSON for /state (membership, leases, frontends...), merged under ours."""
    policy: str = "least-loaded"
    prefix: PrefixView | None = None
    """The KV event plane (None when the coordinator follows no KV events)."""
    decision_times: tuple[tuple[int, ...], float] = ((), 0.0)
    """``DecisionTimes.snapshot()``: submits and route calls, by time taken."""
    readiness: Readiness = NOT_JUDGED
    """Whether the group serves (``core.ranks.readiness``)."""


def observed_state(core: CoordinatorCore, now: float, recorder_tail: list[dict[str, object]],
                   decisions: DecisionTimes | None = None,
                   wake_latencies_s: list[float] | None = None) -> ObservedState:
    """Everything the HTTP endpoints show: the core's view, and what the server measured."""
    view = core.operator_view(now)
    totals = view.totals
    return ObservedState(
        taken_at=now, wave=view.wave, running=view.running, lockstep=view.lockstep,
        ranks=view.ranks, counters=view.counters, waves_total=totals.waves_started,
        seconds_running=totals.seconds_running, seconds_paused=totals.seconds_paused,
        wake_latencies_s=wake_latencies_s or [], watchdog=view.watchdog,
        recorder_tail=recorder_tail, all_ready=view.all_ready,
        state_json=group_state_to_builtins(view.group) | (
            {} if view.kv_bootstrap is None else {"kv_bootstrap": view.kv_bootstrap}),
        policy=view.policy, prefix=view.prefix, readiness=view.readiness,
        decision_times=decisions.snapshot() if decisions is not None else ((), 0.0),
    )


class ObservedPusher:
    """Builds snapshots of ``core`` and hands them to ``update`` (the HTTP endpoints)."""

    def __init__(self, core: CoordinatorCore, update: Callable[[ObservedState], None],
                 clock: Callable[[], float], decisions: DecisionTimes | None = None) -> None:
        self._core = core
        self._decisions = decisions
        self._update = update
        self._clock = clock
        self._last = float("-inf")
        self._scheduled = False
        self._recorder_json: tuple[int, list[dict[str, object]]] = (0, [])
        self._latency_cursor = 0

    def push(self, *, force: bool = False) -> None:
        """A snapshot now, or (if one went out less than ``MIN_INTERVAL_S`` ago and this is
        not forced) at the end of that interval."""
        now = self._clock()
        wait = MIN_INTERVAL_S - (now - self._last)
        if not force and wait > 0:
            if not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_later(wait, self._deferred)
            return
        self._last = now
        recorder = self._core.recorder
        if self._recorder_json[0] != recorder.recorded:
            self._recorder_json = (recorder.recorded, recorder.as_json())
        # Each wake latency is handed on once: the cursor moves, the core does not change.
        latencies, self._latency_cursor = self._core.wake_latencies_since(self._latency_cursor)
        self._update(observed_state(self._core, now, list(self._recorder_json[1]),
                                    self._decisions, latencies))

    def _deferred(self) -> None:
        self._scheduled = False
        self.push(force=True)
