"""Row-by-row tests of the wave table, driving WaveState one event at a time."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from coordinator.core.waves.table import (
    TRANSITIONS,
    BroadcastStartWave,
    Exclude,
    PublishWave,
    WaveAction,
    WaveCondition,
    WaveEvent,
    WaveState,
    classify_first_request,
    classify_reported_wave,
    classify_start_wave,
    classify_timer,
    classify_wake_released,
    classify_wave_complete,
    live_wake,
)

REWAKE = 1.0  # WaveState's default rewake_after_s
JUST_BEFORE = REWAKE - 1e-6


def paused_at(wave: int) -> WaveState:
    return WaveState(wave=wave, running=False)


def running_at(wave: int) -> WaveState:
    return WaveState(wave=wave, running=True)


def woken_at(wave: int, chosen: int = 1, now: float | None = 10.0) -> WaveState:
    """Paused at `wave` with the coordinator's own wake for it sent at `now`."""
    state = paused_at(wave)
    assert state.on_first_request(chosen, wave, now=now) == [BroadcastStartWave(wave, None)]
    return state


# --- the table itself ---------------------------------------------------------------------------


def test_table_has_one_row_per_reachable_condition() -> None:
    expected = {
        (WaveEvent.WAVE_COMPLETE, WaveCondition.STALE),
        (WaveEvent.WAVE_COMPLETE, WaveCondition.CURRENT_OR_NEWER),
        (WaveEvent.START_WAVE, WaveCondition.STALE),
        (WaveEvent.START_WAVE, WaveCondition.NEWER),
        (WaveEvent.START_WAVE, WaveCondition.CURRENT_RUNNING),
        (WaveEvent.START_WAVE, WaveCondition.CURRENT_PAUSED),
        (WaveEvent.START_WAVE, WaveCondition.CURRENT_PAUSED_WOKEN),
        (WaveEvent.FIRST_REQUEST, WaveCondition.RUNNING),
        (WaveEvent.FIRST_REQUEST, WaveCondition.WAKE_SENT),
        (WaveEvent.FIRST_REQUEST, WaveCondition.PAUSED),
        (WaveEvent.FIRST_REQUEST, WaveCondition.PAUSED_NEWER_STAMP),
        (WaveEvent.REPORTED_WAVE, WaveCondition.STALE),
        (WaveEvent.REPORTED_WAVE, WaveCondition.CURRENT),
        (WaveEvent.REPORTED_WAVE, WaveCondition.NEWER),
        (WaveEvent.TIMER, WaveCondition.NOTHING_DUE),
        (WaveEvent.GROUP_CHANGED, WaveCondition.GROUP_RUNNING),
        (WaveEvent.GROUP_CHANGED, WaveCondition.GROUP_PAUSED),
        (WaveEvent.TIMER, WaveCondition.WAKE_UNANSWERED),
        (WaveEvent.WAKE_RELEASED, WaveCondition.OUR_WAKE_RELEASED),
        (WaveEvent.WAKE_RELEASED, WaveCondition.NO_WAKE_PENDING),
    }
    assert set(TRANSITIONS) == expected


def test_no_row_excludes_anyone_but_a_reporting_engine() -> None:
    # Coordinator-originated wakes (first requests) wake every engine.
    for (event, _), row in TRANSITIONS.items():
        if event is WaveEvent.FIRST_REQUEST and row.broadcast is not None:
            assert row.broadcast is Exclude.NOBODY


def test_classifiers_cover_every_case() -> None:
    assert classify_wave_complete(5, 4) is WaveCondition.STALE
    assert classify_wave_complete(5, 5) is WaveCondition.CURRENT_OR_NEWER
    assert classify_wave_complete(5, 9) is WaveCondition.CURRENT_OR_NEWER

    assert classify_start_wave(5, False, None, 4) is WaveCondition.STALE
    assert classify_start_wave(5, True, None, 6) is WaveCondition.NEWER
    assert classify_start_wave(5, False, 5, 6) is WaveCondition.NEWER
    assert classify_start_wave(5, True, None, 5) is WaveCondition.CURRENT_RUNNING
    assert classify_start_wave(5, False, 5, 5) is WaveCondition.CURRENT_PAUSED_WOKEN
    assert classify_start_wave(5, False, None, 5) is WaveCondition.CURRENT_PAUSED

    assert classify_first_request(5, True, None, 5) is WaveCondition.RUNNING
    assert classify_first_request(5, True, None, 9) is WaveCondition.RUNNING
    assert classify_first_request(5, False, 5, 5) is WaveCondition.WAKE_SENT
    assert classify_first_request(5, False, 5, 4) is WaveCondition.WAKE_SENT
    assert classify_first_request(5, False, None, 4) is WaveCondition.PAUSED
    assert classify_first_request(5, False, None, 5) is WaveCondition.PAUSED
    assert classify_first_request(5, False, None, 7) is WaveCondition.PAUSED_NEWER_STAMP
    assert classify_first_request(5, False, 5, 7) is WaveCondition.PAUSED_NEWER_STAMP

    assert classify_reported_wave(5, 4) is WaveCondition.STALE
    assert classify_reported_wave(5, 5) is WaveCondition.CURRENT
    assert classify_reported_wave(5, 6) is WaveCondition.NEWER


def test_live_wake_expires_only_with_both_times_known() -> None:
    assert live_wake(None, 0.0, 5.0, REWAKE) is None
    assert live_wake(3, None, 5.0, REWAKE) == 3
    assert live_wake(3, 0.0, None, REWAKE) == 3
    assert live_wake(3, 0.0, JUST_BEFORE, REWAKE) == 3
    assert live_wake(3, 0.0, REWAKE, REWAKE) is None
    assert live_wake(3, 0.0, 50.0, math.inf) == 3
    assert live_wake(3, 0.0, 0.0, 0.0) is None


def test_initial_state() -> None:
    state = WaveState()
    assert state.lockstep is True
    assert state.rewake_after_s == REWAKE
    assert state.snapshot() == (0, False)
    assert (state.current_wave, state.running, state.wake_pending_for) == (0, False, None)
    assert state.wake_pending(None) is None


@pytest.mark.parametrize("bad", [-0.5, math.nan])
def test_rewake_after_must_be_a_non_negative_number(bad: float) -> None:
    with pytest.raises(ValueError, match="rewake_after_s"):
        WaveState(rewake_after_s=bad)


# --- wave_complete ------------------------------------------------------------------------------


@pytest.mark.parametrize("running", [True, False])
def test_wave_complete_for_current_wave_pauses_and_publishes(running: bool) -> None:
    state = WaveState(wave=3, running=running)
    assert state.on_wave_complete(0, 3) == [PublishWave(4, False)]
    assert state.snapshot() == (4, False)


def test_wave_complete_for_a_newer_wave_jumps_past_it() -> None:
    state = running_at(3)
    assert state.on_wave_complete(0, 7) == [PublishWave(8, False)]
    assert state.snapshot() == (8, False)


def test_wave_complete_clears_the_pending_wake() -> None:
    state = woken_at(3)
    assert state.on_wave_complete(0, 3) == [PublishWave(4, False)]
    assert state.wake_pending_for is None
    # The next wave needs its own wake, at once.
    assert state.on_first_request(2, 4, now=10.0) == [BroadcastStartWave(4, None)]


@pytest.mark.parametrize("running", [True, False])
def test_stale_wave_complete_is_ignored(running: bool) -> None:
    state = WaveState(wave=5, running=running)
    assert state.on_wave_complete(0, 4) == []
    assert state.snapshot() == (5, running)


def test_stale_wave_complete_keeps_the_pending_wake() -> None:
    state = woken_at(5)
    assert state.on_wave_complete(0, 4) == []
    assert state.wake_pending_for == 5
    assert state.wake_pending(10.0) == 5


# --- start_wave ---------------------------------------------------------------------------------


def test_start_wave_for_current_wave_while_paused_broadcasts_and_runs() -> None:
    state = paused_at(2)
    assert state.on_start_wave(3, 2) == [BroadcastStartWave(2, 3), PublishWave(2, True)]
    assert state.snapshot() == (2, True)


def test_start_wave_while_running_is_ignored() -> None:
    state = running_at(2)
    assert state.on_start_wave(1, 2) == []
    assert state.snapshot() == (2, True)


@pytest.mark.parametrize("running", [True, False])
def test_start_wave_for_a_newer_wave_always_broadcasts(running: bool) -> None:
    state = WaveState(wave=2, running=running)
    assert state.on_start_wave(1, 4) == [BroadcastStartWave(4, 1), PublishWave(4, True)]
    assert state.snapshot() == (4, True)


def test_start_wave_for_a_newer_wave_broadcasts_even_after_our_own_wake() -> None:
    state = woken_at(2)
    assert state.on_start_wave(1, 3, now=10.0) == [BroadcastStartWave(3, 1), PublishWave(3, True)]
    assert state.snapshot() == (3, True)
    assert state.wake_pending_for is None


@pytest.mark.parametrize("running", [True, False])
def test_stale_start_wave_is_ignored(running: bool) -> None:
    state = WaveState(wave=6, running=running)
    assert state.on_start_wave(2, 5) == []
    assert state.snapshot() == (6, running)


@pytest.mark.parametrize("now", [None, 10.0, 10.0 + JUST_BEFORE])
def test_start_wave_soon_after_our_own_wake_runs_and_publishes_without_a_relay(
    now: float | None,
) -> None:
    state = woken_at(4, chosen=2, now=10.0)
    assert state.running is False  # a wake sent is not a wave started
    assert state.on_start_wave(2, 4, now=now) == [PublishWave(4, True)]
    assert state.snapshot() == (4, True)
    assert state.wake_pending_for is None


@pytest.mark.parametrize("later", [REWAKE, 5 * REWAKE])
def test_start_wave_after_our_wake_expired_is_relayed(later: float) -> None:
    state = woken_at(4, chosen=2, now=10.0)
    assert state.wake_pending(10.0 + later) is None
    assert state.wake_pending_for == 4  # the raw record stays until a report
    assert state.on_start_wave(0, 4, now=10.0 + later) == [
        BroadcastStartWave(4, 0),
        PublishWave(4, True),
    ]
    assert state.snapshot() == (4, True)
    assert state.wake_pending_for is None


def test_a_wake_sent_without_a_time_never_expires() -> None:
    state = woken_at(4, chosen=2, now=None)
    assert state.wake_pending(1e9) == 4
    assert state.on_start_wave(0, 4, now=1e9) == [PublishWave(4, True)]


def test_a_start_wave_without_a_time_treats_the_wake_as_live() -> None:
    state = woken_at(4, chosen=2, now=10.0)
    assert state.on_start_wave(0, 4) == [PublishWave(4, True)]


def test_start_wave_from_another_engine_after_our_own_wake_does_not_broadcast() -> None:
    state = woken_at(4, chosen=2)
    assert state.on_start_wave(0, 4, now=10.0) == [PublishWave(4, True)]
    assert state.on_start_wave(2, 4, now=10.0) == []
    assert state.snapshot() == (4, True)


# --- both arrival orders of wave_complete(W) and start_wave(W + 1) -------------------------------


def test_wave_complete_then_start_wave_of_next() -> None:
    state = running_at(3)
    assert state.on_wave_complete(0, 3) == [PublishWave(4, False)]
    assert state.on_start_wave(1, 4) == [BroadcastStartWave(4, 1), PublishWave(4, True)]
    assert state.snapshot() == (4, True)


def test_start_wave_of_next_then_wave_complete() -> None:
    state = running_at(3)
    assert state.on_start_wave(1, 4) == [BroadcastStartWave(4, 1), PublishWave(4, True)]
    assert state.on_wave_complete(0, 3) == []
    assert state.snapshot() == (4, True)


def test_both_orders_end_in_the_same_state_with_one_wake() -> None:
    ends = []
    for order in ("complete_first", "start_first"):
        state = running_at(3)
        actions: list[WaveAction] = []
        if order == "complete_first":
            actions += state.on_wave_complete(0, 3)
            actions += state.on_start_wave(1, 4)
        else:
            actions += state.on_start_wave(1, 4)
            actions += state.on_wave_complete(0, 3)
        wakes = [a for a in actions if isinstance(a, BroadcastStartWave)]
        ends.append((state.snapshot(), state.wake_pending_for, wakes))
    assert ends[0] == ends[1] == ((4, True), None, [BroadcastStartWave(4, 1)])


# --- first request through the coordinator ------------------------------------------------------


@pytest.mark.parametrize("stamped", [5, 4, 0])
def test_first_request_while_paused_wakes_everyone_including_the_chosen_engine(
    stamped: int,
) -> None:
    state = paused_at(5)
    assert state.on_first_request(3, stamped, now=2.0) == [BroadcastStartWave(5, None)]
    assert state.wake_pending_for == 5
    assert state.wake_pending(2.0) == 5
    assert state.snapshot() == (5, False)  # running flips only on an engine's report


def test_first_request_keeps_the_old_positional_call() -> None:
    state = paused_at(5)
    assert state.on_first_request(3, 5) == [BroadcastStartWave(5, None)]
    assert state.wake_pending(1e9) == 5  # sent without a time: never expires


def test_first_request_stamped_with_a_newer_wave_adopts_it_then_wakes_at_it() -> None:
    state = paused_at(5)
    assert state.on_first_request(3, 8, now=2.0) == [
        BroadcastStartWave(8, None),
        PublishWave(8, False),
    ]
    assert state.snapshot() == (8, False)
    assert state.wake_pending(2.0) == 8
    # Later requests for the adopted wave are covered by that wake.
    assert state.on_first_request(1, 8, now=2.5) == []
    assert state.on_first_request(1, 5, now=2.5) == []


def test_newer_stamp_overrides_a_live_wake_for_an_older_wave() -> None:
    state = woken_at(5, now=10.0)
    assert state.on_first_request(3, 6, now=10.0) == [
        BroadcastStartWave(6, None),
        PublishWave(6, False),
    ]
    assert (state.snapshot(), state.wake_pending(10.0)) == ((6, False), 6)


@pytest.mark.parametrize("now", [None, 10.0, 10.0 + JUST_BEFORE])
def test_second_first_request_while_the_wake_is_live_does_not_wake_again(
    now: float | None,
) -> None:
    state = woken_at(5, chosen=3, now=10.0)
    assert state.on_first_request(1, 5, now=now) == []
    assert state.on_first_request(0, 4, now=now) == []  # not even a stale-stamped one
    assert state.wake_pending_for == 5


@pytest.mark.parametrize("later", [REWAKE, 3 * REWAKE])
def test_first_request_after_the_wake_expired_wakes_again(later: float) -> None:
    state = woken_at(5, chosen=3, now=10.0)
    assert state.on_first_request(1, 5, now=10.0 + later) == [BroadcastStartWave(5, None)]
    # The new wake is timed from now: it suppresses again for rewake_after_s.
    assert state.wake_pending(10.0 + later + JUST_BEFORE) == 5
    assert state.on_first_request(1, 5, now=10.0 + later + JUST_BEFORE) == []
    assert state.wake_pending(10.0 + later + REWAKE) is None


def test_custom_rewake_interval() -> None:
    state = WaveState(rewake_after_s=0.25)
    assert state.on_first_request(0, 0, now=1.0) == [BroadcastStartWave(0, None)]
    assert state.on_first_request(0, 0, now=1.2) == []
    assert state.on_first_request(0, 0, now=1.25) == [BroadcastStartWave(0, None)]


@pytest.mark.parametrize("stamped", [5, 1, 9])
def test_first_request_while_running_needs_no_wake(stamped: int) -> None:
    state = running_at(5)
    assert state.on_first_request(3, stamped, now=0.0) == []
    assert state.wake_pending_for is None
    assert state.snapshot() == (5, True)


def test_engine_report_then_request_in_a_later_wave_wakes_again() -> None:
    state = woken_at(0, chosen=0, now=0.0)
    assert state.on_start_wave(0, 0, now=0.001) == [PublishWave(0, True)]
    assert state.on_wave_complete(0, 0) == [PublishWave(1, False)]
    assert state.on_first_request(1, 1, now=0.002) == [BroadcastStartWave(1, None)]


# --- reported_wave (stats) ----------------------------------------------------------------------


@pytest.mark.parametrize("running", [True, False])
def test_reported_wave_above_ours_adopts_it_paused(running: bool) -> None:
    state = WaveState(wave=3, running=running)
    assert state.on_reported_wave(1, 7) == [PublishWave(7, False)]
    assert state.snapshot() == (7, False)


def test_reported_wave_above_ours_clears_the_pending_wake() -> None:
    state = woken_at(3)
    assert state.on_reported_wave(1, 4) == [PublishWave(4, False)]
    assert state.wake_pending_for is None
    assert state.on_first_request(2, 4, now=10.0) == [BroadcastStartWave(4, None)]


@pytest.mark.parametrize(("running", "reported"), [(True, 3), (False, 3), (True, 1), (False, 0)])
def test_reported_wave_not_above_ours_is_ignored(running: bool, reported: int) -> None:
    state = WaveState(wave=3, running=running)
    assert state.on_reported_wave(1, reported) == []
    assert state.snapshot() == (3, running)


def test_reported_wave_keeps_a_pending_wake_for_our_wave() -> None:
    state = woken_at(3)
    assert state.on_reported_wave(1, 3) == []
    assert state.wake_pending_for == 3


def test_restarted_coordinator_rebuilds_the_wave_from_stats_then_relays_the_start() -> None:
    state = WaveState()  # restarted: wave 0, paused
    assert state.on_reported_wave(1, 12) == [PublishWave(12, False)]
    assert state.on_reported_wave(0, 12) == []
    assert state.on_reported_wave(2, 11) == []  # an old report never moves it back
    assert state.on_start_wave(2, 12) == [BroadcastStartWave(12, 2), PublishWave(12, True)]
    assert state.snapshot() == (12, True)


def test_stats_running_ahead_of_wave_complete_then_the_late_reports() -> None:
    # Rank 1's stats for wave 4 overtake rank 0's wave_complete(3).
    state = running_at(3)
    assert state.on_reported_wave(1, 4) == [PublishWave(4, False)]
    assert state.on_wave_complete(0, 3) == []
    assert state.on_start_wave(0, 4) == [BroadcastStartWave(4, 0), PublishWave(4, True)]
    assert state.snapshot() == (4, True)


def test_stats_after_the_start_they_follow_change_nothing() -> None:
    state = paused_at(4)
    assert state.on_start_wave(2, 4) == [BroadcastStartWave(4, 2), PublishWave(4, True)]
    assert state.on_reported_wave(2, 4) == []
    assert state.snapshot() == (4, True)


# --- on_engine_output ---------------------------------------------------------------------------


def test_engine_output_wave_complete_hides_start_wave() -> None:
    state = running_at(3)
    assert state.on_engine_output(0, wave_complete=3, start_wave=4) == [PublishWave(4, False)]
    assert state.snapshot() == (4, False)


def test_engine_output_with_only_start_wave() -> None:
    state = paused_at(3)
    assert state.on_engine_output(2, wave_complete=None, start_wave=3) == [
        BroadcastStartWave(3, 2),
        PublishWave(3, True),
    ]


def test_engine_output_passes_the_time_to_start_wave() -> None:
    live = woken_at(3, now=10.0)
    assert live.on_engine_output(2, None, 3, now=10.5) == [PublishWave(3, True)]
    expired = woken_at(3, now=10.0)
    assert expired.on_engine_output(2, None, 3, now=11.0) == [
        BroadcastStartWave(3, 2),
        PublishWave(3, True),
    ]


def test_engine_output_without_wave_fields_changes_nothing() -> None:
    state = woken_at(3)
    assert state.on_engine_output(2, wave_complete=None, start_wave=None, now=99.0) == []
    assert (state.snapshot(), state.wake_pending_for) == ((3, False), 3)


# --- dense mode ---------------------------------------------------------------------------------


def test_dense_mode_ignores_all_wave_input() -> None:
    state = WaveState(lockstep=False)
    calls: list[Callable[[], list[WaveAction]]] = [
        lambda: state.on_first_request(1, 0),
        lambda: state.on_first_request(1, 0, now=0.0),
        lambda: state.on_first_request(1, 5, now=9.0),
        lambda: state.on_start_wave(1, 0),
        lambda: state.on_start_wave(1, 9, now=3.0),
        lambda: state.on_wave_complete(0, 0),
        lambda: state.on_wave_complete(0, 9),
        lambda: state.on_engine_output(0, 3, None),
        lambda: state.on_engine_output(0, None, 3, now=1.0),
        lambda: state.on_reported_wave(0, 0),
        lambda: state.on_reported_wave(2, 7),
        lambda: state.on_first_request(1, 0, now=50.0),
    ]
    for call in calls:
        assert call() == []
        assert (state.snapshot(), state.wake_pending_for) == ((0, False), None)


# ---- timer: one retry of an unanswered coordinator wake ------------------------------


def test_timer_retries_an_unanswered_wake_once_then_leaves_it_to_the_watchdog() -> None:
    state = WaveState(wave=3, rewake_after_s=1.0)
    assert state.on_first_request(2, 3, now=10.0) == [BroadcastStartWave(3, None)]
    assert state.on_timer(10.5) == []  # still live
    assert state.on_timer(11.0) == [BroadcastStartWave(3, None)]  # expired: retry
    assert state.wake_pending(11.5) == 3  # the retry is live again
    assert state.on_timer(12.5) == []  # one retry per wave only
    assert state.snapshot() == (3, False)  # running still waits for an engine


def test_timer_does_nothing_once_an_engine_reported_the_wave() -> None:
    state = WaveState(wave=3, rewake_after_s=1.0)
    state.on_first_request(2, 3, now=10.0)
    assert state.on_start_wave(2, 3, now=10.01) == [PublishWave(3, True)]
    assert state.on_timer(20.0) == []


def test_timer_does_nothing_without_a_coordinator_wake_or_in_dense_mode() -> None:
    assert WaveState(wave=1).on_timer(100.0) == []
    dense = WaveState(lockstep=False)
    dense.on_first_request(0, 0, now=0.0)
    assert dense.on_timer(100.0) == []


def test_timer_retries_again_in_a_later_wave() -> None:
    state = WaveState(wave=3, rewake_after_s=1.0)
    state.on_first_request(0, 3, now=0.0)
    assert state.on_timer(1.0) == [BroadcastStartWave(3, None)]
    state.on_start_wave(1, 3, now=1.1)
    state.on_wave_complete(0, 3)
    assert state.on_first_request(0, 4, now=5.0) == [BroadcastStartWave(4, None)]
    assert state.on_timer(6.0) == [BroadcastStartWave(4, None)]


@pytest.mark.parametrize(
    ("running", "pending", "live", "retried", "expected"),
    [
        (True, 3, None, None, WaveCondition.NOTHING_DUE),
        (False, None, None, None, WaveCondition.NOTHING_DUE),
        (False, 2, None, None, WaveCondition.NOTHING_DUE),  # pending for an older wave
        (False, 3, 3, None, WaveCondition.NOTHING_DUE),  # still live
        (False, 3, None, 3, WaveCondition.NOTHING_DUE),  # already retried
        (False, 3, None, None, WaveCondition.WAKE_UNANSWERED),
        (False, 3, None, 2, WaveCondition.WAKE_UNANSWERED),
    ],
)
def test_classify_timer(
    running: bool, pending: int | None, live: int | None, retried: int | None,
    expected: WaveCondition,
) -> None:
    assert classify_timer(3, running, pending, live, retried) is expected


# ---- a wake held at the start-up gate ------------------------------------------------


def test_classify_wake_released() -> None:
    assert classify_wake_released(3) is WaveCondition.OUR_WAKE_RELEASED
    assert classify_wake_released(None) is WaveCondition.NO_WAKE_PENDING


def test_a_held_wake_counts_from_when_the_gate_let_it_out() -> None:
    """Found by the composed core's model (test_core_stateful): a wake decided at 0.0
    and held by the closed gate left at 0.1, and the timer retried it at 1.0, 0.9 s
    after it was sent, where a wake counts for rewake_after_s after it was sent."""
    state = WaveState(wave=0, rewake_after_s=1.0)
    assert state.on_first_request(0, 0, now=0.0) == [BroadcastStartWave(0, None)]
    assert state.on_wake_released(0.1) == []
    assert state.on_timer(1.0) == []
    assert state.wake_pending(1.0) == 0
    assert state.on_first_request(1, 0, now=1.0) == []  # still live: no second wake
    assert state.on_timer(1.1) == [BroadcastStartWave(0, None)]  # a full second after
    assert state.snapshot() == (0, False)


def test_a_retry_made_while_the_wake_was_held_does_not_use_up_the_retry() -> None:
    state = WaveState(wave=2, rewake_after_s=1.0)
    state.on_first_request(0, 2, now=0.0)
    assert state.on_timer(1.0) == [BroadcastStartWave(2, None)]  # held too: reached nobody
    assert state.on_wake_released(3.0) == []
    assert state.on_timer(3.5) == []
    assert state.on_timer(4.0) == [BroadcastStartWave(2, None)]  # the one real retry
    assert state.on_timer(5.5) == []  # and only one


def test_a_released_relay_or_a_reported_wave_leaves_nothing_to_count() -> None:
    relayed = WaveState(wave=1)
    assert relayed.on_start_wave(2, 1, now=0.0) == [
        BroadcastStartWave(1, 2), PublishWave(1, True)]
    assert relayed.on_wake_released(0.5) == []
    assert (relayed.snapshot(), relayed.wake_pending_for) == ((1, True), None)
    answered = woken_at(1, now=0.0)
    answered.on_start_wave(1, 1, now=0.01)
    assert answered.on_wake_released(0.5) == []
    assert answered.wake_pending_for is None and answered.on_timer(5.0) == []
    dense = WaveState(lockstep=False)
    assert dense.on_wake_released(1.0) == [] and dense.wake_pending_for is None


# ---- a rank died or was replaced ----------------------------------------------------


def test_group_change_while_running_pauses_at_the_current_wave() -> None:
    state = WaveState(wave=6, running=True)
    assert state.on_group_changed() == [PublishWave(6, False)]
    assert state.snapshot() == (6, False)


def test_replaced_group_is_woken_and_its_start_relayed() -> None:
    """The whole group was replaced mid-wave: new engines must not be left idle."""
    state = WaveState(wave=6, running=True)
    state.on_group_changed()
    assert state.on_first_request(2, 6, now=0.0) == [BroadcastStartWave(6, None)]
    # A fresh engine that adopted the stamp reports the start: the group runs.
    assert state.on_start_wave(2, 6, now=0.01) == [PublishWave(6, True)]


def test_replaced_group_report_is_relayed_when_no_request_went_through_us() -> None:
    state = WaveState(wave=6, running=True)
    state.on_group_changed()
    assert state.on_start_wave(1, 6) == [BroadcastStartWave(6, 1), PublishWave(6, True)]


def test_group_change_while_paused_forgets_a_pending_wake() -> None:
    state = WaveState(wave=2)
    state.on_first_request(0, 2, now=0.0)
    assert state.on_group_changed() == []
    assert state.wake_pending_for is None
    assert state.on_first_request(1, 2, now=0.1) == [BroadcastStartWave(2, None)]


def test_group_change_in_dense_mode_does_nothing() -> None:
    state = WaveState(lockstep=False)
    assert state.on_group_changed() == []
