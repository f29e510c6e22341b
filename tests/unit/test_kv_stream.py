"""The per-rank KV event stream machine, row by row, and against a lossy publisher."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.kv.stream import (
    STREAM,
    Apply,
    KVStreams,
    RequestReplay,
    ResetIndex,
    StreamInput,
    StreamState,
    StreamStep,
)

R = 3


def streams(*, replay: bool = True, **options: Any) -> KVStreams[str]:
    machine: KVStreams[str] = KVStreams(**options)
    machine.subscribe(R, replay=replay)
    return machine


def applied(effects: list[Any]) -> list[int]:
    return [effect.seq for effect in effects if isinstance(effect, Apply)]


def live(machine: KVStreams[str], *seqs: int, now: float = 0.0) -> list[Any]:
    out: list[Any] = []
    for seq in seqs:
        out.extend(machine.live(R, seq, f"b{seq}", now))
    return out


def replay(machine: KVStreams[str], *seqs: int, end: bool = True, now: float = 0.0) -> list[Any]:
    out: list[Any] = []
    for seq in seqs:
        out.extend(machine.replayed(R, seq, f"b{seq}", now))
    if end:
        out.extend(machine.replay_ended(R, now))
    return out


def test_every_state_and_input_has_a_row() -> None:
    assert set(STREAM) == {(state, kind) for state in StreamState for kind in StreamInput}


def test_resync_and_restart_rows_always_leave_for_sync() -> None:
    for (state, kind), (after, step) in STREAM.items():
        if step in (StreamStep.RESYNC, StreamStep.RESTART):
            assert after is StreamState.SYNC, (state, kind)
        if kind is StreamInput.RESET:
            assert step is StreamStep.RESYNC


# ---- SYNC: the first batch --------------------------------------------------------------


def test_a_stream_that_starts_at_zero_is_applied_in_order() -> None:
    machine = streams()
    assert live(machine, 0, 1, 2) == [Apply(0, "b0"), Apply(1, "b1"), Apply(2, "b2")]
    assert machine.state(R) is StreamState.LIVE
    assert machine.counters.replays_requested == 0


def test_joining_late_asks_for_everything_from_zero_and_holds_live_batches() -> None:
    machine = streams()
    assert live(machine, 5, now=1.0) == [RequestReplay(0)]
    assert machine.state(R) is StreamState.REPLAYING
    assert machine.next_deadline() == 2.0
    assert live(machine, 6) == []  # held
    # The buffer started at 3: from an empty index, that is as good as it gets.
    effects = replay(machine, 3, 4, 5)
    assert effects == [Apply(3, "b3"), Apply(4, "b4"), Apply(5, "b5"), Apply(6, "b6")]
    assert not any(isinstance(effect, ResetIndex) for effect in effects)
    assert machine.state(R) is StreamState.LIVE and machine.next_deadline() is None
    assert machine.counters.replays_filled == 1 and machine.counters.gaps == 0
    assert applied(live(machine, 7)) == [7]


def test_joining_late_without_a_replay_endpoint_starts_where_it_joined() -> None:
    machine = streams(replay=False)
    assert live(machine, 5, 6) == [Apply(5, "b5"), Apply(6, "b6")]


# ---- LIVE: gaps and restarts -------------------------------------------------------------


def test_a_gap_is_filled_by_a_replay_from_the_first_missing_batch() -> None:
    machine = streams()
    live(machine, 0, 1)
    assert live(machine, 4, now=10.0) == [RequestReplay(2)]
    assert machine.counters.gaps == 1
    assert live(machine, 5) == []
    effects = replay(machine, 2, 3, 4)  # the replay repeats 4, which was held too
    assert applied(effects) == [2, 3, 4, 5]
    assert not any(isinstance(effect, ResetIndex) for effect in effects)
    assert machine.view(R) == ("live", 6, 0)


def test_a_gap_without_a_replay_endpoint_resets_the_index() -> None:
    machine = streams(replay=False)
    live(machine, 0, 1)
    assert live(machine, 4) == [ResetIndex("gap"), Apply(4, "b4")]
    assert machine.counters.lost_batches == 2
    assert applied(live(machine, 5)) == [5]


@pytest.mark.parametrize(("first", "expected"), [
    (0, [ResetIndex("publisher_restart"), Apply(0, "b0")]),
    (2, [ResetIndex("publisher_restart"), RequestReplay(0)]),
])
def test_a_sequence_going_back_is_a_new_publisher(first: int, expected: list[Any]) -> None:
    machine = streams()
    live(machine, 0, 1, 2, 3)
    assert live(machine, first) == expected
    assert machine.counters.publisher_restarts == 1


def test_a_restart_while_replaying_drops_the_held_batches() -> None:
    machine = streams()
    live(machine, 0)
    live(machine, 3, 4)
    assert live(machine, 0) == [ResetIndex("publisher_restart"), Apply(0, "b0")]
    assert machine.next_deadline() is None
    assert replay(machine, 1, 2) == []  # the old replay's answer is stale now
    assert machine.counters.stale_replay_messages == 3


# ---- REPLAYING: what the answer says -------------------------------------------------------


def test_a_replay_that_misses_the_first_asked_batch_resets_and_goes_on() -> None:
    machine = streams()
    live(machine, 0, 1)
    live(machine, 5)
    effects = replay(machine, 3, 4, 5)  # 2 fell out of the publisher's buffer
    assert effects == [ResetIndex("replay_incomplete"), Apply(3, "b3"), Apply(4, "b4"),
                       Apply(5, "b5")]
    assert machine.counters.replays_incomplete == 1 and machine.counters.lost_batches == 1


def test_old_replayed_batches_are_skipped() -> None:
    machine = streams()
    live(machine, 0, 1, 2)
    live(machine, 4)
    assert applied(replay(machine, 1, 2, 3, 4)) == [3, 4]


def test_a_hole_left_among_held_batches_asks_again_then_gives_up() -> None:
    machine = streams(max_replay_rounds=2)
    live(machine, 0)
    live(machine, 2)
    live(machine, 4, 5)  # 3 lost on the live stream as well
    # The replay stops at 2 (its answer was cut short): 3 is still missing.
    assert replay(machine, 1, 2, now=1.0) == [Apply(1, "b1"), Apply(2, "b2"), RequestReplay(3)]
    assert machine.state(R) is StreamState.REPLAYING
    # The second answer is short again: the rounds are used up.
    assert replay(machine, now=2.0) == [ResetIndex("gap"), Apply(4, "b4"), Apply(5, "b5")]
    assert machine.view(R) == ("live", 6, 0)


def test_live_batches_beyond_max_held_are_dropped_and_asked_for_again() -> None:
    machine = streams(max_held=2)
    live(machine, 0)
    live(machine, 2, 3, 4, 5)  # 2 and 3 held, 4 and 5 dropped
    assert machine.counters.dropped_held == 2
    assert replay(machine, 1, 2) == [Apply(1, "b1"), Apply(2, "b2"), Apply(3, "b3"),
                                     RequestReplay(4)]
    assert applied(replay(machine, 4, 5)) == [4, 5]
    assert machine.state(R) is StreamState.LIVE


def test_a_replay_without_an_answer_is_given_up_at_its_deadline() -> None:
    machine = streams(replay_timeout_s=1.0)
    live(machine, 0)
    live(machine, 3, 4, now=5.0)
    assert machine.on_timer(5.9) == []
    assert machine.on_timer(6.0) == [(R, [ResetIndex("replay_timeout"), Apply(3, "b3"),
                                          Apply(4, "b4")])]
    assert machine.view(R) == ("live", 5, 0)
    assert machine.counters.replays_timed_out == 1
    assert replay(machine, 1, 2) == []  # a late answer is stale


def test_a_replay_that_could_not_be_asked_is_given_up_at_once() -> None:
    machine = streams(replay_timeout_s=1.0)
    live(machine, 0)
    live(machine, 3, 4, now=5.0)  # a replay from 1 is out, 3 and 4 are held
    assert machine.replay_unsent(R, 5.0) == [ResetIndex("replay_unavailable"),
                                              Apply(3, "b3"), Apply(4, "b4")]
    assert machine.view(R) == ("live", 5, 0)
    assert machine.next_deadline() is None  # nothing is waited out
    assert machine.counters.replays_unsent == 1 and machine.counters.replays_timed_out == 0
    # Only a replay that is out can be given up: in LIVE or SYNC the report changes nothing.
    assert machine.replay_unsent(R, 5.0) == []
    assert machine.counters.replays_unsent == 1
    assert streams().replay_unsent(R, 0.0) == []


def test_a_given_up_replay_applies_only_the_last_unbroken_run_of_held_batches() -> None:
    machine = streams(replay_timeout_s=1.0)
    live(machine, 0)
    live(machine, 2, 3, 5, 6)
    assert machine.on_timer(1.0) == [(R, [ResetIndex("replay_timeout"), Apply(5, "b5"),
                                          Apply(6, "b6")])]
    assert machine.counters.lost_batches == 4


def test_a_sync_replay_without_an_answer_costs_no_reset() -> None:
    machine = streams(replay_timeout_s=1.0)
    live(machine, 7)
    assert machine.on_timer(1.0) == [(R, [Apply(7, "b7")])]


def test_a_timed_out_replay_with_nothing_held_goes_back_to_sync() -> None:
    machine = streams(replay_timeout_s=1.0, max_held=1)
    live(machine, 0)
    live(machine, 2, 3)  # 2 held, 3 dropped
    assert replay(machine, 1) == [Apply(1, "b1"), Apply(2, "b2"), RequestReplay(3)]
    assert machine.view(R) == ("replaying", 3, 0)
    assert machine.on_timer(1.0) == [(R, [ResetIndex("replay_timeout")])]
    assert machine.view(R) == ("sync", 0, 0)
    assert live(machine, 9) == [RequestReplay(0)]


def test_a_reset_drops_held_batches_and_forgets_the_replay() -> None:
    machine = streams()
    live(machine, 0)
    live(machine, 2)
    machine.reset(R)
    assert machine.state(R) is StreamState.SYNC and machine.next_deadline() is None
    assert replay(machine, 1) == []


# ---- connections -----------------------------------------------------------------------------


def test_a_new_connection_catches_up_at_once() -> None:
    machine = streams()
    assert machine.connected(R, 0.0) == [RequestReplay(0)]
    assert applied(replay(machine, 4, 5)) == [4, 5]
    assert machine.view(R) == ("live", 6, 0)
    # Connected again later: whatever went by meanwhile is asked for.
    assert machine.connected(R, 1.0) == [RequestReplay(6)]
    assert machine.connected(R, 1.0) == []  # a replay is out already
    assert applied(live(machine, 8)) == []
    assert applied(replay(machine, 6, 7, 8)) == [6, 7, 8]


def test_a_catch_up_that_finds_nothing_keeps_waiting_for_a_first_batch() -> None:
    machine = streams()
    machine.connected(R, 0.0)
    assert replay(machine) == []
    assert machine.view(R) == ("sync", 0, 0)
    assert live(machine, 0) == [Apply(0, "b0")]


def test_without_a_replay_endpoint_a_connection_changes_nothing() -> None:
    machine = streams(replay=False)
    assert machine.connected(R, 0.0) == []
    live(machine, 0)
    assert machine.connected(R, 0.0) == [] and machine.view(R) == ("live", 1, 0)
    assert KVStreams().connected(R, 0.0) == []


# ---- bad batches and resets ------------------------------------------------------------------


def test_a_bad_batch_resets_the_index_and_the_stream_goes_on_after_it() -> None:
    machine = streams()
    live(machine, 0, 1)
    assert machine.bad(R, 2, 0.0) == [ResetIndex("bad_batch")]
    assert applied(live(machine, 3)) == [3]
    assert machine.counters.bad_batches == 1


def test_a_bad_first_batch_needs_no_reset() -> None:
    machine = streams()
    assert machine.bad(R, 5, 0.0) == []
    assert applied(live(machine, 6)) == [6]


def test_a_bad_live_batch_while_replaying_is_left_to_the_replay() -> None:
    machine = streams()
    live(machine, 0)
    live(machine, 3)
    assert machine.bad(R, 4, 0.0) == []  # held back: the replay will bring it
    live(machine, 5)
    effects = replay(machine, 1, 2, 3, end=False)
    assert applied(effects) == [1, 2, 3]
    # Its copy in the answer is bad too: the index is reset, and the answer goes on.
    assert machine.bad(R, 4, 0.0, replayed=True) == [ResetIndex("bad_batch")]
    assert applied(replay(machine)) == [5]
    assert machine.view(R) == ("live", 6, 0)


def test_a_bad_batch_published_after_the_replay_is_fetched_by_the_next_round() -> None:
    machine = streams()
    live(machine, 0)
    live(machine, 2)
    machine.bad(R, 3, 0.0)
    live(machine, 4)
    assert replay(machine, 1, 2) == [Apply(1, "b1"), Apply(2, "b2"), RequestReplay(3)]
    assert machine.bad(R, 3, 0.0, replayed=True) == [ResetIndex("bad_batch")]
    assert applied(replay(machine, 4)) == [4]
    assert machine.view(R) == ("live", 5, 0)


def test_bad_replayed_copies_that_are_stale_or_old_are_skipped() -> None:
    machine = streams()
    live(machine, 0, 1)
    assert machine.bad(R, 1, 0.0, replayed=True) == []  # no replay out
    live(machine, 3)
    assert machine.bad(R, 0, 0.0, replayed=True) == []  # before expected
    assert machine.view(R) == ("replaying", 2, 1)


def test_reset_and_unsubscribed_ranks() -> None:
    machine = streams()
    live(machine, 0, 1)
    machine.reset(R)
    assert machine.view(R) == ("sync", 0, 0)
    assert live(machine, 0) == [Apply(0, "b0")]
    machine.unsubscribe(R)
    assert R not in machine
    assert live(machine, 1) == [] and replay(machine, 1) == [] and machine.bad(R, 2, 0) == []
    machine.reset(R)
    assert machine.view(R) is None and machine.state(R) is None


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        KVStreams(replay_timeout_s=0)
    with pytest.raises(ValueError):
        KVStreams(max_held=0)


# ---- against a lossy publisher -----------------------------------------------------------------


class LossyPublisher(RuleBasedStateMachine):
    """A publisher with a bounded replay buffer, a channel that loses batches, replays
    that are answered in full, cut short or never, and restarts. Whatever happens, the
    index is fed only contiguous runs of one publisher's batches, each run starting
    right after a reset (or at the start)."""

    BUFFER = 6

    def __init__(self) -> None:
        super().__init__()
        self.machine: KVStreams[tuple[int, int]] = KVStreams(replay_timeout_s=1.0, max_held=4,
                                                             max_replay_rounds=2)
        self.machine.subscribe(R, replay=True)
        self.now = 0.0
        self.epoch = 0
        self.next_seq = 0
        self.buffer: list[int] = []
        self.bad: set[int] = set()
        self.asked: int | None = None
        self.last: tuple[int, int] | None = None  # last applied since the last reset

    def feed(self, effects: list[Any]) -> None:
        for effect in effects:
            if isinstance(effect, ResetIndex):
                self.last = None
            elif isinstance(effect, RequestReplay):
                self.asked = effect.start
            else:
                epoch, seq = effect.batch
                assert seq == effect.seq
                if self.last is not None:
                    assert (epoch, seq) == (self.last[0], self.last[1] + 1), (self.last, epoch, seq)
                self.last = (epoch, seq)

    def _publish(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        self.buffer = [*self.buffer, seq][-self.BUFFER:]
        return seq

    @rule(delivered=st.booleans())
    def publish(self, delivered: bool) -> None:
        seq = self._publish()
        if delivered:
            self.feed(self.machine.live(R, seq, (self.epoch, seq), self.now))

    @rule(delivered=st.booleans())
    def publish_bad(self, delivered: bool) -> None:
        seq = self._publish()
        self.bad.add(seq)
        if delivered:
            self.feed(self.machine.bad(R, seq, self.now))

    @precondition(lambda self: self.asked is not None)
    @rule(cut=st.integers(0, 8), end=st.booleans())
    def answer_replay(self, cut: int, end: bool) -> None:
        start, self.asked = self.asked, None
        assert start is not None
        for seq in [s for s in self.buffer if s >= start][:cut]:
            if seq in self.bad:
                self.feed(self.machine.bad(R, seq, self.now, replayed=True))
            else:
                self.feed(self.machine.replayed(R, seq, (self.epoch, seq), self.now))
        if end:
            self.feed(self.machine.replay_ended(R, self.now))

    @rule(seconds=st.sampled_from([0.2, 1.5]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        for rank, effects in self.machine.on_timer(self.now):
            assert rank == R
            self.feed(effects)

    @rule()
    def restart_publisher(self) -> None:
        # A restarted engine loads its model before it publishes again, so its
        # subscriber has long reconnected: its first batch arrives (see the module
        # docstring for what happens otherwise).
        self.epoch += 1
        self.next_seq = 0
        self.buffer = []
        self.bad = set()
        self.asked = None
        seq = self._publish()
        self.feed(self.machine.live(R, seq, (self.epoch, seq), self.now))

    @rule()
    def reconnected(self) -> None:
        self.feed(self.machine.connected(R, self.now))

    @rule()
    def rank_replaced(self) -> None:
        self.machine.reset(R)
        self.last = None
        self.asked = None

    @invariant()
    def replay_deadline_only_while_replaying(self) -> None:
        replaying = self.machine.state(R) is StreamState.REPLAYING
        assert (self.machine.next_deadline() is not None) == replaying
        view = self.machine.view(R)
        assert view is not None and view.held <= 4


LossyPublisher.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                            deadline=None)
TestLossyPublisher = LossyPublisher.TestCase


def test_a_lossless_stream_with_full_replays_never_resets() -> None:
    machine: KVStreams[str] = KVStreams()
    machine.subscribe(R, replay=True)
    effects = live(machine, 2, 3)  # joined late
    effects += replay(machine, 0, 1, 2, 3)
    effects += live(machine, 4, 6)  # 5 lost
    effects += replay(machine, 5, 6)
    effects += live(machine, 7)
    assert not any(isinstance(effect, ResetIndex) for effect in effects)
    assert applied(effects) == list(range(8))
