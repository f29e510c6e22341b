"""The start-up gate, row by row."""

from __future__ import annotations

import pytest

from coordinator.core.waves.gate import GATE, GateEvent, GateState, GateStep, StartGate


def test_every_state_and_event_has_a_row() -> None:
    assert set(GATE) == {(state, event) for state in GateState for event in GateEvent}


def test_opens_at_the_expected_subscription_and_not_before() -> None:
    gate = StartGate(3)
    assert [gate.subscribed() for _ in range(2)] == [GateStep.COUNT, GateStep.COUNT]
    assert not gate.is_open
    assert gate.subscribed() is GateStep.OPEN
    assert gate.is_open and gate.subscriptions == 3


def test_every_later_subscription_gets_its_own_ready() -> None:
    gate = StartGate(1)
    assert gate.subscribed() is GateStep.OPEN
    assert gate.subscribed() is GateStep.LATE_READY
    assert gate.subscribed() is GateStep.LATE_READY


def test_a_wake_before_the_gate_is_held_newest_only_and_released_once() -> None:
    gate = StartGate(2)
    assert gate.wake([b"\x02", b"old"]) is GateStep.HOLD
    assert gate.wake([b"\x02", b"new"]) is GateStep.HOLD
    assert gate.held_wake == [b"\x02", b"new"]
    gate.subscribed()
    assert gate.subscribed() is GateStep.OPEN
    assert gate.take_held() == [b"\x02", b"new"]
    assert gate.take_held() is None


def test_a_wake_after_the_gate_passes_and_is_not_kept() -> None:
    gate = StartGate(1)
    gate.subscribed()
    assert gate.wake([b"\x02", b"w"]) is GateStep.PASS
    assert gate.held_wake is None


def test_a_smaller_group_opens_at_the_next_subscription() -> None:
    gate = StartGate(4)
    gate.subscribed()
    gate.subscribed()
    gate.expected = 2
    assert not gate.is_open
    assert gate.subscribed() is GateStep.OPEN


def test_restored_gate_is_open_and_answers_late_subscribers() -> None:
    gate = StartGate(4)
    gate.restore_open()
    assert gate.is_open and gate.subscriptions == 4
    assert gate.subscribed() is GateStep.LATE_READY
    assert gate.wake([b"\x02", b"w"]) is GateStep.PASS


def test_an_empty_group_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        StartGate(0)
