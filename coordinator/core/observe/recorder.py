"""Flight recorder of wave and membership transitions, and wave time accounting.

Theory of operation
-------------------
When a data-parallel group hangs, the log of the coordinator is usually the only
place that saw every rank, and the question is always the same: what were the
last few things that happened, in which order, and who caused them? The
``FlightRecorder`` answers it. The server records one ``RecordedEvent`` for each
transition it makes (a wave starting or pausing, a rank changing state, an
engine refused, a watchdog alert) with its cause: which message, which rank.

The recorder is a ring: it keeps the last ``capacity`` events, oldest first, and
forgets older ones. Each event gets a sequence number one higher than the one
before, so a reader can tell how many were forgotten (``dropped``) and can ask
"what is new since seq N" by comparing numbers. Events are immutable and their
``detail`` holds only JSON-safe values (``json_safe`` converts at record time),
so a snapshot of the ring can be handed to another thread or serialized as is.

``WaveTimeline`` turns the group's ``(wave, running)`` observations into the
numbers operators graph: waves started, seconds running and paused, and the
latency from the coordinator's wake (``START_DP_WAVE`` for the first request of
a paused wave) to the first engine's report that the wave runs.

Neither class does IO or reads a clock: the caller passes ``at``/``now``, in
monotonic seconds.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

DEFAULT_CAPACITY: Final = 1000
# Wake latencies kept for readers of the histogram (a reader polls every 0.25 s).
LATENCY_WINDOW: Final = 4096

# Event kinds the server records. Any short string is accepted; these are the
# ones tools and tests look for.
KIND_WAVE: Final = "wave"
KIND_WAKE: Final = "wake"
KIND_MEMBERSHIP: Final = "membership"
KIND_REFUSAL: Final = "refusal"
KIND_WATCHDOG: Final = "watchdog"


def json_safe(value: object) -> object:
    """``value`` as something ``json.dumps`` accepts without a ``default`` hook.

    Scalars pass through (non-finite floats become strings, which JSON lacks),
    enums become their value, bytes their repr, mappings get string keys,
    sequences and sets become lists, anything else its ``str``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return json_safe(value.value)
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value))
    if isinstance(value, Mapping):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [json_safe(item) for item in items]
    return str(value)


@dataclass(frozen=True)
class RecordedEvent:
    """One transition, with what caused it and the group's wave state right after it."""

    seq: int
    at: float
    kind: str
    rank: int | None
    cause: str
    wave: int
    running: bool
    detail: dict[str, object]

    def as_dict(self, now: float | None = None) -> dict[str, object]:
        """A JSON-ready map; with ``now``, also ``age_s`` (seconds since the event)."""
        out: dict[str, object] = {
            "seq": self.seq,
            "at": self.at,
            "kind": self.kind,
            "rank": self.rank,
            "cause": self.cause,
            "wave": self.wave,
            "running": self.running,
            "detail": dict(self.detail),
        }
        if now is not None:
            out["age_s"] = round(now - self.at, 6)
        return out

    def format_line(self, now: float) -> str:
        """One human-readable line, e.g. for the log when the watchdog fires."""
        state = "running" if self.running else "paused"
        who = "" if self.rank is None else f" rank={self.rank}"
        extra = "".join(f" {key}={value}" for key, value in self.detail.items())
        return (
            f"#{self.seq} t-{now - self.at:.3f}s [wave {self.wave} {state}] "
            f"{self.kind}{who}: {self.cause}{extra}"
        )


def tail_window(size: int, n: int | None) -> int:
    """How many of the newest ``size`` items a request for ``n`` returns (None: all)."""
    if n is None:
        return size
    return max(0, min(size, n))


class FlightRecorder:
    """The last ``capacity`` transitions, oldest first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity must be at least 1, got {capacity}")
        self._events: deque[RecordedEvent] = deque(maxlen=capacity)
        self._recorded = 0

    @property
    def capacity(self) -> int:
        maxlen = self._events.maxlen
        return maxlen if maxlen is not None else 0

    @property
    def recorded(self) -> int:
        """Events recorded since creation; also the ``seq`` of the newest one."""
        return self._recorded

    @property
    def dropped(self) -> int:
        """Events recorded but no longer kept."""
        return self._recorded - len(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def record(
        self,
        *,
        at: float,
        kind: str,
        cause: str,
        wave: int,
        running: bool,
        rank: int | None = None,
        **detail: object,
    ) -> RecordedEvent:
        """Keep one event (forgetting the oldest when full) and return it."""
        self._recorded += 1
        event = RecordedEvent(
            seq=self._recorded,
            at=at,
            kind=kind,
            rank=rank,
            cause=cause,
            wave=wave,
            running=running,
            detail={key: json_safe(value) for key, value in detail.items()},
        )
        self._events.append(event)
        return event

    def tail(self, n: int | None = None) -> list[RecordedEvent]:
        """The newest ``n`` events (all kept events when None), oldest first."""
        keep = tail_window(len(self._events), n)
        if keep == 0:
            return []
        return list(self._events)[-keep:]

    def as_json(self, n: int | None = None, *, now: float | None = None) -> list[dict[str, object]]:
        """``tail(n)`` as JSON-ready maps; with ``now`` each carries ``age_s``."""
        return [event.as_dict(now) for event in self.tail(n)]

    def format_lines(self, n: int | None = None, *, now: float) -> list[str]:
        """``tail(n)`` as log lines, preceded by a header saying what was forgotten."""
        events = self.tail(n)
        older = self._recorded - len(events)
        header = (
            f"flight recorder: last {len(events)} of {self._recorded} events"
            + (f" ({older} older not shown)" if older else "")
        )
        return [header, *(event.format_line(now) for event in events)]


# ---- wave time accounting ----------------------------------------------------------------------


@dataclass(frozen=True)
class WaveTotals:
    """Cumulative wave numbers for metrics."""

    waves_started: int
    seconds_running: float
    seconds_paused: float


class WaveTimeline:
    """Accumulates time spent running and paused, waves started, and wake latencies.

    Call ``observe`` with the group's ``(wave, running)`` after every wave action
    (or every time it may have changed: repeated observations are harmless), and
    ``wake_sent`` when the coordinator itself broadcasts ``START_DP_WAVE`` for a
    request that arrived while the group was paused.
    """

    def __init__(self, *, now: float, wave: int = 0, running: bool = False) -> None:
        self._since = now
        self._wave = wave
        self._running = running
        self._waves_started = 0
        self._seconds_running = 0.0
        self._seconds_paused = 0.0
        self._wake_sent_at: dict[int, float] = {}
        # The newest latencies, numbered: readers keep a cursor, so reading changes nothing.
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._latencies_seen = 0

    def wake_sent(self, wave: int, now: float) -> None:
        """The coordinator woke the group for ``wave``; the first such wake times it."""
        if not self._running or wave != self._wave:
            self._wake_sent_at.setdefault(wave, now)

    def observe(self, wave: int, running: bool, now: float) -> float | None:
        """Account for time up to ``now``; return a wake latency if this start answers one."""
        self._accumulate(now)
        starts = running and (not self._running or wave != self._wave)
        self._wave = wave
        self._running = running
        latency: float | None = None
        if starts:
            self._waves_started += 1
            sent_at = self._wake_sent_at.pop(wave, None)
            if sent_at is not None:
                latency = max(0.0, now - sent_at)
                self._latencies.append(latency)
                self._latencies_seen += 1
        # A wake for a wave the group has already passed can never be answered.
        for pending in [w for w in self._wake_sent_at if w < wave]:
            del self._wake_sent_at[pending]
        return latency

    def totals(self, now: float) -> WaveTotals:
        """Totals including the time since the last observation."""
        elapsed = max(0.0, now - self._since)
        running = self._seconds_running + (elapsed if self._running else 0.0)
        paused = self._seconds_paused + (0.0 if self._running else elapsed)
        return WaveTotals(self._waves_started, running, paused)

    def wake_latencies_since(self, cursor: int) -> tuple[list[float], int]:
        """Latencies measured after ``cursor`` (0 at first) and the cursor to pass next.

        A query: nothing changes. Only the newest ``LATENCY_WINDOW`` are kept, so a
        reader that falls further behind gets those (its histogram misses the rest).
        """
        seen = self._latencies_seen
        fresh = min(seen - cursor, len(self._latencies))
        if fresh <= 0:
            return [], seen
        latencies = self._latencies
        return [latencies[i] for i in range(len(latencies) - fresh, len(latencies))], seen

    def _accumulate(self, now: float) -> None:
        elapsed = max(0.0, now - self._since)
        if self._running:
            self._seconds_running += elapsed
        else:
            self._seconds_paused += elapsed
        self._since = max(self._since, now)
