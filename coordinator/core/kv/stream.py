"""Each rank's stream of KV cache events: in order, gaps filled by replay, losses reset.

Theory of operation
-------------------
Every rank's engine publishes its KV cache events as numbered batches
(``coordinator.protocol.kv_events``): ``seq`` counts from 0 per publisher
process, and a publisher with a replay endpoint answers "everything from
``seq`` on" from a bounded buffer of its last batches, then an end marker.
The prefix index (``core.prefix_index``) is right only if a rank's batches
are applied in order with none missing. ``KVStreams`` keeps one small machine
per rank that says, for each batch, whether to apply it now, hold it, ask
for a replay, or give up on what the index holds for that rank and start
again from what is known. Nothing here touches the index: the caller does
what the returned effects say (``Apply``, ``ResetIndex``, ``RequestReplay``).

Positions. ``expected`` is the next ``seq`` to apply. A rank in ``SYNC`` has
no position: it is what a rank starts in, and returns to after anything that
emptied its index. The first batch it sees decides: ``seq`` 0 means nothing
came before, so it is applied; a later ``seq`` means the subscriber joined
late, so the batches before it are asked for (a replay from 0; with no
replay endpoint, the batch is applied and what came before is lost).

Loss. A live batch beyond ``expected`` means the batches in between were
lost (a slow subscriber past the publisher's high-water mark, a reconnect).
With a replay endpoint they are asked for, and live batches are held
(at most ``max_held``; later ones are dropped and asked for again) until
the replay ends; without one, the rank's index is reset, since it may hold
blocks whose removal was lost, and the batch is applied. A replayed batch
beyond ``expected`` means the publisher's buffer no longer had the lost
ones: the index is reset and the replay goes on from there. A batch that
does not decode is a loss too, which a replay cannot mend (the publisher
would send the same bytes): the index is reset and the stream goes on after
it. While a replay is out, a bad live batch is left to the replay, which
brings its copy (or the next round does); a bad batch in the answer resets
the index and the answer goes on after it.

Restarts. A live ``seq`` at or before one already seen means a new
publisher process (an engine restart: ``seq`` starts again at 0): the index
is reset and the batch is taken as the first one of a new stream. ``seq``
is all the wire says, so a new publisher whose batches up to the old
position were all lost would pass for the old one: the caller also resets a
rank whose publisher's connection ended (a new process has a new
connection), and where engines register with the coordinator, a restarted
engine is a new incarnation, which resets the rank too.

Connections. When the subscriber's connection to a publisher comes up (at
start, or again after it dropped), batches may have gone by unseen, and a
publisher may have nothing more to publish for a while: with a replay
endpoint, everything from ``expected`` (0 in ``SYNC``) is asked for at once,
instead of waiting for the next live batch to show the hole.

Replies. A replay that does not end within ``replay_timeout_s`` is given up:
the index is reset and the last unbroken run of held batches is applied. A replay that ends
with a hole left among the held batches (or with batches dropped while
holding) is asked again from ``expected``, up to ``max_replay_rounds`` times in
a row, then given up the same way. A replay request that could not even be sent
is given up at once, the same way. Replay messages that come when no replay
is out are stale (the answer to one given up) and skipped.

Resets from outside. A rank that dies or is replaced, or whose publisher
moved to another address, is put back in ``SYNC`` (``reset``); the caller
empties its index.

``STREAM`` is the whole machine: ``(state, input) -> (next state, step)``.
The caller's view of a step is its effects, in order:

=============  =============================================================
step           effects
=============  =============================================================
APPLY          ``Apply`` the batch
HOLD           none yet (the batch is held, or dropped when ``max_held`` are)
REPLAY         ``RequestReplay`` from ``expected`` (0 in ``SYNC``); hold the batch
RESET_APPLY    ``ResetIndex``, then ``Apply`` the batch
RESTART        ``ResetIndex``, then the batch as the first one in ``SYNC``
SKIP           none
FINISH         ``Apply`` the held batches in order; with a hole left,
               ``RequestReplay`` again, or (rounds used up) as GIVE_UP
GIVE_UP        ``ResetIndex`` (unless nothing was applied since the index was
               empty), then ``Apply`` the last unbroken run of held batches
RESET_SKIP     ``ResetIndex`` (unless the index is empty); go on after the batch
CATCH_UP       ``RequestReplay`` from ``expected`` (0 in ``SYNC``); nothing held yet
RESYNC         none: the caller emptied the index; held batches are dropped
=============  =============================================================

No IO, no clock: time comes in as ``now``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

__all__ = [
    "STREAM",
    "Apply",
    "Effect",
    "KVStreams",
    "RequestReplay",
    "ResetIndex",
    "StreamCounters",
    "StreamInput",
    "StreamState",
    "StreamStep",
    "StreamView",
]

Batch = TypeVar("Batch")

DEFAULT_REPLAY_TIMEOUT_S = 1.0
DEFAULT_MAX_HELD = 1024
DEFAULT_MAX_REPLAY_ROUNDS = 3

# ResetIndex causes (metric labels).
CAUSE_GAP = "gap"
CAUSE_REPLAY_INCOMPLETE = "replay_incomplete"
CAUSE_REPLAY_TIMEOUT = "replay_timeout"
CAUSE_REPLAY_UNAVAILABLE = "replay_unavailable"
CAUSE_PUBLISHER_RESTART = "publisher_restart"
CAUSE_BAD_BATCH = "bad_batch"


class StreamState(enum.Enum):
    SYNC = "sync"  # no position; the rank's index is empty
    LIVE = "live"  # applying in order from ``expected``
    REPLAYING = "replaying"  # a replay is out; live batches are held


class StreamInput(enum.Enum):
    LIVE_NEXT = "live_next"  # the next live batch (SYNC: seq 0; REPLAYING: after the last seen)
    LIVE_AHEAD = "live_ahead"  # a live batch past the next one, with a replay endpoint
    LIVE_AHEAD_NO_REPLAY = "live_ahead_no_replay"  # the same, without one
    LIVE_BEHIND = "live_behind"  # a live seq at or before one already seen: a new publisher
    REPLAYED_OLD = "replayed_old"  # a replayed batch already applied
    REPLAYED_NEXT = "replayed_next"  # the replayed batch at ``expected``
    REPLAYED_AHEAD = "replayed_ahead"  # a replayed batch past ``expected``: the buffer lost some
    REPLAY_END = "replay_end"  # the replay's end marker
    REPLAY_TIMEOUT = "replay_timeout"  # no end marker within ``replay_timeout_s``
    REPLAY_UNSENT = "replay_unsent"  # the replay request could not be sent at all
    BAD_LIVE = "bad_live"  # a live batch whose seq reads but whose payload does not
    BAD_REPLAYED = "bad_replayed"  # the same, in a replay answer
    CONNECTED = "connected"  # the connection to the publisher came up, with a replay endpoint
    CONNECTED_NO_REPLAY = "connected_no_replay"  # the same, without one
    RESET = "reset"  # the caller emptied the rank's index (death, replacement, new address)


class StreamStep(enum.Enum):
    APPLY = "apply"
    HOLD = "hold"
    REPLAY = "replay"
    RESET_APPLY = "reset_apply"
    RESTART = "restart"
    SKIP = "skip"
    FINISH = "finish"
    GIVE_UP = "give_up"
    RESET_SKIP = "reset_skip"
    CATCH_UP = "catch_up"
    RESYNC = "resync"


_S = StreamState
_I = StreamInput
_P = StreamStep

STREAM: Mapping[tuple[StreamState, StreamInput], tuple[StreamState, StreamStep]] = {
    (_S.SYNC, _I.LIVE_NEXT): (_S.LIVE, _P.APPLY),
    (_S.SYNC, _I.LIVE_AHEAD): (_S.REPLAYING, _P.REPLAY),
    # Nothing before it can be had, and the index is empty: start here.
    (_S.SYNC, _I.LIVE_AHEAD_NO_REPLAY): (_S.LIVE, _P.APPLY),
    # Cannot happen (no position to be behind); taken as a first batch.
    (_S.SYNC, _I.LIVE_BEHIND): (_S.LIVE, _P.APPLY),
    (_S.SYNC, _I.REPLAYED_OLD): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.REPLAYED_NEXT): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.REPLAYED_AHEAD): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.REPLAY_END): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.REPLAY_TIMEOUT): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.REPLAY_UNSENT): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.BAD_LIVE): (_S.LIVE, _P.RESET_SKIP),
    (_S.SYNC, _I.BAD_REPLAYED): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.CONNECTED): (_S.REPLAYING, _P.CATCH_UP),
    (_S.SYNC, _I.CONNECTED_NO_REPLAY): (_S.SYNC, _P.SKIP),
    (_S.SYNC, _I.RESET): (_S.SYNC, _P.RESYNC),
    (_S.LIVE, _I.LIVE_NEXT): (_S.LIVE, _P.APPLY),
    (_S.LIVE, _I.LIVE_AHEAD): (_S.REPLAYING, _P.REPLAY),
    (_S.LIVE, _I.LIVE_AHEAD_NO_REPLAY): (_S.LIVE, _P.RESET_APPLY),
    (_S.LIVE, _I.LIVE_BEHIND): (_S.SYNC, _P.RESTART),
    (_S.LIVE, _I.REPLAYED_OLD): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.REPLAYED_NEXT): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.REPLAYED_AHEAD): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.REPLAY_END): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.REPLAY_TIMEOUT): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.REPLAY_UNSENT): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.BAD_LIVE): (_S.LIVE, _P.RESET_SKIP),
    (_S.LIVE, _I.BAD_REPLAYED): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.CONNECTED): (_S.REPLAYING, _P.CATCH_UP),
    (_S.LIVE, _I.CONNECTED_NO_REPLAY): (_S.LIVE, _P.SKIP),
    (_S.LIVE, _I.RESET): (_S.SYNC, _P.RESYNC),
    (_S.REPLAYING, _I.LIVE_NEXT): (_S.REPLAYING, _P.HOLD),
    (_S.REPLAYING, _I.LIVE_AHEAD): (_S.REPLAYING, _P.HOLD),
    (_S.REPLAYING, _I.LIVE_AHEAD_NO_REPLAY): (_S.REPLAYING, _P.HOLD),
    (_S.REPLAYING, _I.LIVE_BEHIND): (_S.SYNC, _P.RESTART),
    (_S.REPLAYING, _I.REPLAYED_OLD): (_S.REPLAYING, _P.SKIP),
    (_S.REPLAYING, _I.REPLAYED_NEXT): (_S.REPLAYING, _P.APPLY),
    (_S.REPLAYING, _I.REPLAYED_AHEAD): (_S.REPLAYING, _P.RESET_APPLY),
    (_S.REPLAYING, _I.REPLAY_END): (_S.LIVE, _P.FINISH),
    (_S.REPLAYING, _I.REPLAY_TIMEOUT): (_S.LIVE, _P.GIVE_UP),
    (_S.REPLAYING, _I.REPLAY_UNSENT): (_S.LIVE, _P.GIVE_UP),
    # The replay (or the next round, if it was published after) brings that
    # batch again, and its bad copy from the replay decides.
    (_S.REPLAYING, _I.BAD_LIVE): (_S.REPLAYING, _P.SKIP),
    (_S.REPLAYING, _I.BAD_REPLAYED): (_S.REPLAYING, _P.RESET_SKIP),
    # A replay is out already; what it misses, its end shows.
    (_S.REPLAYING, _I.CONNECTED): (_S.REPLAYING, _P.SKIP),
    (_S.REPLAYING, _I.CONNECTED_NO_REPLAY): (_S.REPLAYING, _P.SKIP),
    (_S.REPLAYING, _I.RESET): (_S.SYNC, _P.RESYNC),
}


@dataclass(frozen=True)
class Apply(Generic[Batch]):
    """Apply this batch to the rank's index now."""

    seq: int
    batch: Batch


class ResetIndex(NamedTuple):
    """Empty the rank's index: what it holds may be wrong (``cause`` says why)."""

    cause: str


class RequestReplay(NamedTuple):
    """Ask the rank's publisher for every batch it still has from ``start`` on."""

    start: int


Effect = Apply[Batch] | ResetIndex | RequestReplay


@dataclass
class StreamCounters:
    """What the streams saw, for metrics; every field only grows."""

    live_batches: int = 0
    replayed_batches: int = 0
    gaps: int = 0  # live batches that came after a hole
    lost_batches: int = 0  # sequence numbers never applied (the index was reset instead)
    replays_requested: int = 0
    replays_filled: int = 0  # replays that ended with nothing missing
    replays_incomplete: int = 0  # the publisher's buffer no longer had what was asked
    replays_timed_out: int = 0
    replays_unsent: int = 0  # replay requests the subscriber could not send
    publisher_restarts: int = 0
    bad_batches: int = 0
    dropped_held: int = 0  # live batches dropped while ``max_held`` were held
    stale_replay_messages: int = 0


@dataclass
class _Rank(Generic[Batch]):
    state: StreamState = StreamState.SYNC
    expected: int = 0
    # Nothing applied since the index was emptied: a loss then costs no reset.
    fresh: bool = True
    last_live: int = -1
    held: list[tuple[int, Batch]] = field(default_factory=list)
    dropped: bool = False
    rounds: int = 0
    deadline: float = 0.0
    replay: bool = False


class StreamView(NamedTuple):
    """One rank's stream, for operators."""

    state: str
    expected: int
    held: int


class KVStreams(Generic[Batch]):
    """One stream machine per subscribed rank; see the module docstring."""

    def __init__(self, *, replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
                 max_held: int = DEFAULT_MAX_HELD,
                 max_replay_rounds: int = DEFAULT_MAX_REPLAY_ROUNDS) -> None:
        if replay_timeout_s <= 0 or max_held < 1 or max_replay_rounds < 1:
            raise ValueError("replay_timeout_s must be > 0, max_held and max_replay_rounds >= 1")
        self.replay_timeout_s = replay_timeout_s
        self.max_held = max_held
        self.max_replay_rounds = max_replay_rounds
        self.counters = StreamCounters()
        self._ranks: dict[int, _Rank[Batch]] = {}
        self._replaying: set[int] = set()

    # ---- membership of the streams ----------------------------------------------------------

    def subscribe(self, rank: int, *, replay: bool) -> None:
        """Start (or start again) following ``rank``, in ``SYNC``; its index must be empty."""
        self._ranks[rank] = _Rank(replay=replay)
        self._replaying.discard(rank)

    def unsubscribe(self, rank: int) -> None:
        self._ranks.pop(rank, None)
        self._replaying.discard(rank)

    def __contains__(self, rank: int) -> bool:
        return rank in self._ranks

    def ranks(self) -> Iterator[int]:
        return iter(self._ranks)

    def view(self, rank: int) -> StreamView | None:
        entry = self._ranks.get(rank)
        if entry is None:
            return None
        return StreamView(entry.state.value, entry.expected, len(entry.held))

    def state(self, rank: int) -> StreamState | None:
        entry = self._ranks.get(rank)
        return None if entry is None else entry.state

    # ---- inputs ---------------------------------------------------------------------------

    def live(self, rank: int, seq: int, batch: Batch, now: float) -> list[Effect[Batch]]:
        """A live batch from ``rank``'s publisher."""
        entry = self._ranks.get(rank)
        if entry is None:
            return []
        self.counters.live_batches += 1
        return self._live(rank, entry, seq, batch, now)

    def replayed(self, rank: int, seq: int, batch: Batch, now: float) -> list[Effect[Batch]]:
        """A batch of the replay answer."""
        entry = self._ranks.get(rank)
        if entry is None:
            return []
        self.counters.replayed_batches += 1
        if entry.state is not StreamState.REPLAYING or seq < entry.expected:
            kind = StreamInput.REPLAYED_OLD
        elif seq == entry.expected or entry.fresh:
            # From an empty index any starting point is as good as it gets.
            kind = StreamInput.REPLAYED_NEXT
        else:
            kind = StreamInput.REPLAYED_AHEAD
        entry.state, step = STREAM[entry.state, kind]
        if step is StreamStep.SKIP:
            self.counters.stale_replay_messages += entry.state is not StreamState.REPLAYING
            return []
        out: list[Effect[Batch]] = []
        if step is StreamStep.RESET_APPLY:
            self.counters.replays_incomplete += 1
            self.counters.lost_batches += seq - entry.expected
            out.append(ResetIndex(CAUSE_REPLAY_INCOMPLETE))
        entry.expected = seq + 1
        entry.fresh = False
        out.append(Apply(seq, batch))
        return out

    def replay_ended(self, rank: int, now: float) -> list[Effect[Batch]]:
        """The replay's end marker."""
        entry = self._ranks.get(rank)
        if entry is None:
            return []
        entry.state, step = STREAM[entry.state, StreamInput.REPLAY_END]
        if step is StreamStep.SKIP:
            self.counters.stale_replay_messages += 1
            return []
        self._replaying.discard(rank)
        return self._finish(rank, entry, now)

    def bad(self, rank: int, seq: int, now: float, *,
            replayed: bool = False) -> list[Effect[Batch]]:
        """A batch numbered ``seq`` (live, or in a replay answer) whose payload does not
        decode."""
        entry = self._ranks.get(rank)
        if entry is None:
            return []
        self.counters.bad_batches += 1
        kind = StreamInput.BAD_REPLAYED if replayed else StreamInput.BAD_LIVE
        entry.state, step = STREAM[entry.state, kind]
        if step is StreamStep.SKIP:
            if replayed:
                self.counters.stale_replay_messages += entry.state is not StreamState.REPLAYING
            else:
                entry.last_live = max(entry.last_live, seq)
            return []
        if step is not StreamStep.RESET_SKIP:
            raise RuntimeError('stream table: expected RESET_SKIP')
        if replayed and seq < entry.expected:
            return []  # a copy of a batch already applied
        out: list[Effect[Batch]] = [] if entry.fresh else [ResetIndex(CAUSE_BAD_BATCH)]
        if not replayed:
            # Live: whatever was held for an earlier loss can no longer follow it.
            self.counters.lost_batches += len(entry.held)
            entry.held = []
            entry.dropped = False
            entry.rounds = 0
            entry.last_live = max(entry.last_live, seq)
        entry.expected = seq + 1
        entry.fresh = True
        return out

    def connected(self, rank: int, now: float) -> list[Effect[Batch]]:
        """The subscriber's connection to ``rank``'s publisher came up."""
        entry = self._ranks.get(rank)
        if entry is None:
            return []
        kind = StreamInput.CONNECTED if entry.replay else StreamInput.CONNECTED_NO_REPLAY
        entry.state, step = STREAM[entry.state, kind]
        if step is StreamStep.SKIP:
            return []
        if step is not StreamStep.CATCH_UP:
            raise RuntimeError('stream table: expected CATCH_UP')
        entry.rounds = 0
        return [self._request(rank, entry, now)]

    def reset(self, rank: int) -> None:
        """The caller emptied ``rank``'s index (death, replacement): start again in ``SYNC``."""
        entry = self._ranks.get(rank)
        if entry is None:
            return
        entry.state, step = STREAM[entry.state, StreamInput.RESET]
        if step is not StreamStep.RESYNC:
            raise RuntimeError('stream table: expected RESYNC')
        self._replaying.discard(rank)
        self._ranks[rank] = _Rank(replay=entry.replay)

    def next_deadline(self) -> float | None:
        """When the earliest outstanding replay times out (None: no replay is out)."""
        if not self._replaying:
            return None
        return min(self._ranks[rank].deadline for rank in self._replaying)

    def on_timer(self, now: float) -> list[tuple[int, list[Effect[Batch]]]]:
        """Give up the replays whose time is up; the effects per rank."""
        out: list[tuple[int, list[Effect[Batch]]]] = []
        for rank in sorted(self._replaying):
            entry = self._ranks[rank]
            if now < entry.deadline:
                continue
            entry.state, step = STREAM[entry.state, StreamInput.REPLAY_TIMEOUT]
            if step is not StreamStep.GIVE_UP:
                raise RuntimeError('stream table: expected GIVE_UP')
            self.counters.replays_timed_out += 1
            self._replaying.discard(rank)
            out.append((rank, self._give_up(entry, CAUSE_REPLAY_TIMEOUT)))
        return out

    def replay_unsent(self, rank: int, now: float) -> list[Effect[Batch]]:
        """The replay just asked of ``rank`` could not be requested (its endpoint refused
        the connection, say): no answer will come, so it is given up now rather than
        waited out, exactly as a timeout gives it up."""
        entry = self._ranks.get(rank)
        if entry is None:
            return []
        entry.state, step = STREAM[entry.state, StreamInput.REPLAY_UNSENT]
        if step is StreamStep.SKIP:
            return []
        self.counters.replays_unsent += 1
        self._replaying.discard(rank)
        return self._give_up(entry, CAUSE_REPLAY_UNAVAILABLE)

    # ---- the rows ------------------------------------------------------------------------------

    def _classify_live(self, entry: _Rank[Batch], seq: int) -> StreamInput:
        if entry.state is StreamState.REPLAYING:
            if seq <= entry.last_live:
                return StreamInput.LIVE_BEHIND
            return StreamInput.LIVE_NEXT if seq == entry.last_live + 1 else StreamInput.LIVE_AHEAD
        if entry.state is StreamState.LIVE and seq < entry.expected:
            return StreamInput.LIVE_BEHIND
        if seq == entry.expected:
            return StreamInput.LIVE_NEXT
        return StreamInput.LIVE_AHEAD if entry.replay else StreamInput.LIVE_AHEAD_NO_REPLAY

    def _live(self, rank: int, entry: _Rank[Batch], seq: int, batch: Batch,
              now: float) -> list[Effect[Batch]]:
        kind = self._classify_live(entry, seq)
        entry.state, step = STREAM[entry.state, kind]
        if step is StreamStep.APPLY:
            entry.expected = seq + 1
            entry.last_live = seq
            entry.fresh = False
            return [Apply(seq, batch)]
        if step is StreamStep.HOLD:
            entry.last_live = seq
            self._hold(entry, seq, batch)
            return []
        if step is StreamStep.REPLAY:
            if entry.expected:
                self.counters.gaps += 1
            entry.last_live = seq
            entry.rounds = 0
            self._hold(entry, seq, batch)
            return [self._request(rank, entry, now)]
        if step is StreamStep.RESET_APPLY:
            self.counters.gaps += 1
            self.counters.lost_batches += seq - entry.expected
            entry.expected = seq + 1
            entry.last_live = seq
            return [ResetIndex(CAUSE_GAP), Apply(seq, batch)]
        if step is not StreamStep.RESTART:
            raise RuntimeError('stream table: expected RESTART')
        self.counters.publisher_restarts += 1
        self.counters.lost_batches += len(entry.held)
        self._replaying.discard(rank)
        self._ranks[rank] = fresh = _Rank[Batch](replay=entry.replay)
        return [ResetIndex(CAUSE_PUBLISHER_RESTART), *self._live(rank, fresh, seq, batch, now)]

    def _hold(self, entry: _Rank[Batch], seq: int, batch: Batch) -> None:
        if len(entry.held) < self.max_held:
            entry.held.append((seq, batch))
        else:
            entry.dropped = True
            self.counters.dropped_held += 1

    def _request(self, rank: int, entry: _Rank[Batch], now: float) -> RequestReplay:
        self.counters.replays_requested += 1
        entry.deadline = now + self.replay_timeout_s
        self._replaying.add(rank)
        return RequestReplay(entry.expected)

    def _finish(self, rank: int, entry: _Rank[Batch], now: float) -> list[Effect[Batch]]:
        out: list[Effect[Batch]] = []
        held = [(seq, batch) for seq, batch in entry.held if seq >= entry.expected]
        index = 0
        while index < len(held) and (held[index][0] == entry.expected or entry.fresh):
            seq, batch = held[index]
            out.append(Apply(seq, batch))
            entry.expected = seq + 1
            entry.fresh = False
            index += 1
        entry.held = held[index:]
        if not entry.held and not entry.dropped:
            self.counters.replays_filled += 1
            entry.rounds = 0
            if entry.fresh:
                entry.state = StreamState.SYNC  # nothing came at all: still no position
            return out
        # A hole before the next held batch, or batches dropped while holding.
        entry.rounds += 1
        if entry.rounds < self.max_replay_rounds:
            entry.state = StreamState.REPLAYING
            entry.dropped = False
            out.append(self._request(rank, entry, now))
            return out
        out.extend(self._give_up(entry, CAUSE_GAP))
        return out

    def _give_up(self, entry: _Rank[Batch], cause: str) -> list[Effect[Batch]]:
        out: list[Effect[Batch]] = [] if entry.fresh else [ResetIndex(cause)]
        held = entry.held
        if held:
            # Only the last unbroken run of held batches can follow the reset.
            start = len(held) - 1
            while start > 0 and held[start - 1][0] == held[start][0] - 1:
                start -= 1
            if not entry.fresh:
                self.counters.lost_batches += max(0, held[start][0] - entry.expected)
            out.extend(Apply(seq, batch) for seq, batch in held[start:])
            entry.expected = held[-1][0] + 1
            entry.fresh = False
        else:
            entry.fresh = True
            entry.state = StreamState.SYNC
            entry.expected = 0
        entry.held = []
        entry.dropped = False
        entry.rounds = 0
        return out
