"""The rule behind /readyz: core.ranks.readiness.group_serves, row by row of its table."""

from __future__ import annotations

import pytest

from coordinator.core.ranks.readiness import Readiness, group_serves


def test_every_rank_dispatchable_serves() -> None:
    verdict = group_serves({0: "ready", 1: "ready"}, [0, 1], gate_open=True)
    assert verdict == Readiness(True, "all 2 ranks take requests", {})


@pytest.mark.parametrize("state", ["cordoned", "draining"])
def test_a_rank_out_for_maintenance_leaves_the_group_serving(state: str) -> None:
    verdict = group_serves({0: "ready", 1: state, 2: "ready"}, [0, 2], gate_open=True)
    assert verdict.serves
    assert verdict.out == {1: state}
    assert verdict.reason == f"2 of 3 ranks take requests (1 {state})"


def test_a_dead_rank_beside_live_ones_is_named_but_the_group_serves() -> None:
    verdict = group_serves({0: "dead", 1: "ready", 2: "cordoned"}, [1], gate_open=True)
    assert verdict.serves
    assert verdict.reason == "1 of 3 ranks take requests (1 cordoned, 1 dead)"


def test_every_rank_dead_does_not_serve() -> None:
    verdict = group_serves({0: "dead", 1: "dead"}, [], gate_open=True)
    assert not verdict.serves
    assert verdict.reason == "no rank can take requests (2 dead)"
    assert verdict.out == {0: "dead", 1: "dead"}


def test_every_rank_in_maintenance_does_not_serve_and_says_so() -> None:
    verdict = group_serves({0: "cordoned", 1: "draining"}, [], gate_open=True)
    assert not verdict.serves
    assert "every rank is cordoned or draining" in verdict.reason


@pytest.mark.parametrize("dispatchable", [[], [0, 1]])
def test_a_closed_start_up_gate_does_not_serve(dispatchable: list[int]) -> None:
    verdict = group_serves({0: "ready", 1: "ready"}, dispatchable, gate_open=False)
    assert not verdict.serves
    assert "start-up gate is closed" in verdict.reason


def test_ranks_still_starting_and_none_dispatchable_do_not_serve() -> None:
    verdict = group_serves({0: "handshaking", 1: "absent"}, [], gate_open=True)
    assert not verdict.serves
    assert verdict.reason == "no rank can take requests (1 absent, 1 handshaking)"


def test_a_ready_rank_not_dispatchable_is_out_and_named() -> None:
    verdict = group_serves({0: "ready"}, [], gate_open=True)
    assert not verdict.serves
    assert verdict.out == {0: "ready, not dispatchable"}


def test_an_empty_range_never_serves() -> None:
    assert group_serves({}, [], gate_open=True) == Readiness(False, "the group has no ranks")


def test_dispatchable_ranks_outside_the_range_do_not_count() -> None:
    assert not group_serves({0: "dead"}, [7], gate_open=True).serves
