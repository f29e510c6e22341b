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
from coordinator.protocol.frontend import group_state_to_builtins

# Snapshots not forced by the timer are at least this far apart.
MIN_INTERVAL_S = 0.05


@dataclass(frozen=True)
class RankView:
    """One rank as the loop saw it when the snapshot was taken."""

    rank: int
    state: str
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    dispatched: int = 0
    """Requests dispatched to this rank since the coordinator started."""
    report_age_s: float | None = None
    """Seconds since this rank's last stats report (None: never reported)."""
    in_flight: int = 0
    vllm_version: str | None = None
    """The vLLM version the rank's engine named in its greeting (None: none named)."""


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
class PrefixView:
    """The KV event plane and the prefix index when the snapshot was taken."""

    block_size: int | None
    blocks: dict[int, int]
    """Blocks the index holds, by rank."""
    streams: dict[int, str]
    """Each followed rank's stream state: sync, live or replaying."""
    batches: dict[int, int]
    """KV event batches received, by rank."""
    subscriptions: dict[int, str]
    """Where each followed rank's publisher is reached."""
    total_blocks: int = 0
    distinct_blocks: int = 0
    memory_bytes: int = 0
    pending_blocks: int = 0


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


def prefix_view(core: CoordinatorCore) -> PrefixView | None:
    """What the KV event plane and the index hold now."""
    kv = core.kv
    if kv is None:
        return None
    index = kv.index
    streams = {}
    for rank in kv.streams.ranks():
        view = kv.streams.view(rank)
        if view is not None:
            streams[rank] = view.state
    return PrefixView(
        block_size=index.block_size if index is not None else None,
        blocks=index.blocks_per_rank() if index is not None else {},
        streams=streams,
        batches=dict(kv.counters.batches_by_rank),
        subscriptions={rank: sub.live.address for rank, sub in kv.subscriptions.items()},
        total_blocks=index.total_blocks if index is not None else 0,
        distinct_blocks=index.distinct_blocks if index is not None else 0,
        memory_bytes=index.memory_estimate_bytes() if index is not None else 0,
        pending_blocks=kv.pending_blocks,
    )


def observed_state(core: CoordinatorCore, now: float, recorder_tail: list[dict[str, object]],
                   decisions: DecisionTimes | None = None) -> ObservedState:
    """Everything the HTTP endpoints show, from the core's queries."""
    wave, running = core.waves.snapshot()
    ranks = []
    for rank in core.rank_range:
        lease = core.membership.lease(rank)
        load = core.loads.load(rank)
        ranks.append(RankView(
            rank=rank, state=lease.state.value if lease else "absent",
            waiting=load.waiting, running=load.running, kv_cache_usage=load.kv_cache_usage,
            dispatched=core.dispatched_by_rank[rank],
            report_age_s=core.watchdog.report_age(rank, now),
            in_flight=core.requests.count(rank),
            vllm_version=core.vllm_versions.get(rank) if lease else None,
        ))
    totals = core.timeline.totals(now)
    return ObservedState(
        taken_at=now, wave=wave, running=running, lockstep=core.config.lockstep, ranks=ranks,
        counters=core.counter_values(), waves_total=totals.waves_started,
        seconds_running=totals.seconds_running, seconds_paused=totals.seconds_paused,
        wake_latencies_s=core.timeline.take_wake_latencies(),
        watchdog=[alert.as_dict(now) for alert in core.watchdog.active],
        recorder_tail=recorder_tail, all_ready=core.membership.all_ready(now=now),
        state_json=group_state_to_builtins(core.group_state(now)),
        policy=core.config.policy, prefix=prefix_view(core),
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
        self._update(observed_state(self._core, now, list(self._recorder_json[1]),
                                    self._decisions))

    def _deferred(self) -> None:
        self._scheduled = False
        self.push(force=True)
