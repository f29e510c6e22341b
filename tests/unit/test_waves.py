"""Row-by-row tests of the wave table, driving WaveState one event at a time."""

from __future__ import annotations

import pytest

from coordinator.core.waves import (
    TRANSITIONS,
    BroadcastStartWave,
    PublishWave,
    WaveAction,
    WaveCondition,
    WaveEvent,
    WaveState,
    classify_first_request,
    classify_start_wave,
    classify_wave_complete,
)


def paused_at(wave: int) -> WaveState:
    return WaveState(wave=wave, running=False)


def running_at(wave: int) -> WaveState:
    return WaveState(wave=wave, running=True)


def woken_at(wave: int, chosen: int = 1) -> WaveState:
    """Paused at `wave` with the coordinator's own wake for it already sent."""
    state = paused_at(wave)
    assert state.on_first_request(chosen, wave) == [BroadcastStartWave(wave, chosen)]
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
        (WaveEvent.FIRST_REQUEST, WaveCondition.PAUSED_STALE_STAMP),
    }
    assert set(TRANSITIONS) == expected


def test_classifiers_cover_every_case() -> None:
    assert classify_wave_complete(5, 4) is WaveCondition.STALE
    assert classify_wave_complete(5, 5) is WaveCondition.CURRENT_OR_NEWER
    assert classify_wave_complete(5, 9) is WaveCondition.CURRENT_OR_NEWER

    assert classify_start_wave(5, False, None, 4) is WaveCondition.STALE
    assert classify_start_wave(5, True, None, 6) is WaveCondition.NEWER
    assert classify_start_wave(5, True, None, 5) is WaveCondition.CURRENT_RUNNING
    assert classify_start_wave(5, False, 5, 5) is WaveCondition.CURRENT_PAUSED_WOKEN
    assert classify_start_wave(5, False, None, 5) is WaveCondition.CURRENT_PAUSED

    assert classify_first_request(5, True, None, 5) is WaveCondition.RUNNING
    assert classify_first_request(5, False, 5, 5) is WaveCondition.WAKE_SENT
    assert classify_first_request(5, False, None, 4) is WaveCondition.PAUSED_STALE_STAMP
    assert classify_first_request(5, False, None, 5) is WaveCondition.PAUSED
    assert classify_first_request(5, False, None, 7) is WaveCondition.PAUSED


def test_initial_state() -> None:
    state = WaveState()
    assert state.lockstep is True
    assert state.snapshot() == (0, False)
    assert (state.current_wave, state.running, state.wake_pending_for) == (0, False, None)


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
    # The next wave needs its own wake.
    assert state.on_first_request(2, 4) == [BroadcastStartWave(4, 2)]


@pytest.mark.parametrize("running", [True, False])
def test_stale_wave_complete_is_ignored(running: bool) -> None:
    state = WaveState(wave=5, running=running)
    assert state.on_wave_complete(0, 4) == []
    assert state.snapshot() == (5, running)


def test_stale_wave_complete_keeps_the_pending_wake() -> None:
    state = woken_at(5)
    assert state.on_wave_complete(0, 4) == []
    assert state.wake_pending_for == 5


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
    assert state.on_start_wave(1, 3) == [BroadcastStartWave(3, 1), PublishWave(3, True)]
    assert state.snapshot() == (3, True)
    assert state.wake_pending_for is None


@pytest.mark.parametrize("running", [True, False])
def test_stale_start_wave_is_ignored(running: bool) -> None:
    state = WaveState(wave=6, running=running)
    assert state.on_start_wave(2, 5) == []
    assert state.snapshot() == (6, running)


def test_start_wave_after_our_own_wake_runs_and_publishes_without_a_second_broadcast() -> None:
    state = woken_at(4, chosen=2)
    assert state.running is False  # a wake sent is not a wave started
    assert state.on_start_wave(2, 4) == [PublishWave(4, True)]
    assert state.snapshot() == (4, True)
    assert state.wake_pending_for is None


def test_start_wave_from_another_engine_after_our_own_wake_does_not_broadcast() -> None:
    state = woken_at(4, chosen=2)
    assert state.on_start_wave(0, 4) == [PublishWave(4, True)]
    assert state.on_start_wave(2, 4) == []
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


def test_first_request_while_paused_wakes_everyone_but_the_chosen_engine() -> None:
    state = paused_at(5)
    assert state.on_first_request(3, 5) == [BroadcastStartWave(5, 3)]
    assert state.wake_pending_for == 5
    assert state.snapshot() == (5, False)  # running flips only on an engine's report


def test_first_request_stamped_with_a_stale_wave_wakes_everyone() -> None:
    state = paused_at(5)
    assert state.on_first_request(3, 4) == [BroadcastStartWave(5, None)]
    assert state.wake_pending_for == 5
    assert state.snapshot() == (5, False)


def test_first_request_stamped_with_a_later_wave_wakes_the_current_one() -> None:
    state = paused_at(5)
    assert state.on_first_request(3, 8) == [BroadcastStartWave(5, 3)]
    assert state.snapshot() == (5, False)


def test_second_first_request_for_the_same_wave_does_not_wake_again() -> None:
    state = woken_at(5, chosen=3)
    assert state.on_first_request(1, 5) == []
    assert state.on_first_request(0, 4) == []  # not even a stale-stamped one
    assert state.wake_pending_for == 5


def test_first_request_while_running_needs_no_wake() -> None:
    state = running_at(5)
    assert state.on_first_request(3, 5) == []
    assert state.on_first_request(3, 1) == []
    assert state.wake_pending_for is None
    assert state.snapshot() == (5, True)


def test_engine_report_then_request_in_a_later_wave_wakes_again() -> None:
    state = woken_at(0, chosen=0)
    assert state.on_start_wave(0, 0) == [PublishWave(0, True)]
    assert state.on_wave_complete(0, 0) == [PublishWave(1, False)]
    assert state.on_first_request(1, 1) == [BroadcastStartWave(1, 1)]


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


def test_engine_output_without_wave_fields_changes_nothing() -> None:
    state = woken_at(3)
    assert state.on_engine_output(2, wave_complete=None, start_wave=None) == []
    assert (state.snapshot(), state.wake_pending_for) == ((3, False), 3)


# --- dense mode ---------------------------------------------------------------------------------


def test_dense_mode_ignores_all_wave_input() -> None:
    state = WaveState(lockstep=False)
    calls = [
        lambda: state.on_first_request(1, 0),
        lambda: state.on_start_wave(1, 0),
        lambda: state.on_start_wave(1, 9),
        lambda: state.on_wave_complete(0, 0),
        lambda: state.on_wave_complete(0, 9),
        lambda: state.on_engine_output(0, 3, None),
        lambda: state.on_engine_output(0, None, 3),
        lambda: state.on_first_request(1, 0),
    ]
    for call in calls:
        assert call() == []
        assert (state.snapshot(), state.wake_pending_for) == ((0, False), None)
