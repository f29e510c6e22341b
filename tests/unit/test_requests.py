"""Submit admission and the in-flight ledger, step by step."""

from __future__ import annotations

import pytest

from coordinator.core.dispatch.ledger import (
    NO_READY_ENGINE,
    SHUTTING_DOWN,
    InFlight,
    Refusal,
    RequestLedger,
    dispatch_refusal,
    explicit_rank_refusal,
)
from coordinator.protocol import frontend as fp

A, B = b"\x00a", b"\x00b"


def test_admission_steps_in_order() -> None:
    ledger = RequestLedger(max_in_flight=2)
    ledger.add("r1", 0, A)
    # Shutting down wins over a duplicate id.
    assert ledger.refusal("r1", shutting_down=True) is SHUTTING_DOWN
    duplicate = ledger.refusal("r1", shutting_down=False)
    assert duplicate == Refusal(fp.ERR_DUPLICATE_REQUEST, "request 'r1' is already in flight")
    assert ledger.refusal("r2", shutting_down=False) is None
    ledger.add("r2", 1, A)
    full = ledger.refusal("r3", shutting_down=False)
    assert full is not None and full.code == fp.ERR_TOO_MANY_IN_FLIGHT
    assert full.message.startswith("2 requests in flight")
    # A duplicate is named as such even when the ledger is full.
    assert ledger.refusal("r2", shutting_down=False) == Refusal(
        fp.ERR_DUPLICATE_REQUEST, "request 'r2' is already in flight")


def test_max_in_flight_zero_refuses_everything() -> None:
    refusal = RequestLedger(max_in_flight=0).refusal("r", shutting_down=False)
    assert refusal is not None and refusal.code == fp.ERR_TOO_MANY_IN_FLIGHT


@pytest.mark.parametrize(
    ("in_range", "expected"),
    [
        (False, Refusal(fp.ERR_UNKNOWN_RANK, "dp_rank=9 is outside 2..5")),
        (True, Refusal(fp.ERR_RANK_NOT_READY, "dp_rank=9 cannot take requests (cordoned)")),
    ],
)
def test_explicit_rank_steps(in_range: bool, expected: Refusal) -> None:
    assert explicit_rank_refusal(9, in_range=in_range, state="cordoned", rank_start=2,
                                 rank_count=4) == expected


def test_unreachable_refusals_name_what_was_tried() -> None:
    assert dispatch_refusal((3,), explicit=True).message == "dp_rank=3 is not connected on dispatch"
    assert dispatch_refusal((3, 1), explicit=False).message == (
        "no ready engine is connected on dispatch (tried dp_rank [3, 1])")
    assert NO_READY_ENGINE.code == fp.ERR_NO_READY_ENGINE


def test_forget_counts_down_per_rank() -> None:
    ledger = RequestLedger(max_in_flight=10)
    ledger.add("a", 0, A)
    ledger.add("b", 0, A)
    ledger.add("c", 1, B)
    assert ledger.per_rank() == {0: 2, 1: 1}
    assert ledger.forget("a") == InFlight(0, A)
    assert ledger.forget("a") is None
    assert ledger.count(0) == 1
    ledger.forget("b")
    assert ledger.count(0) == 0 and ledger.per_rank() == {1: 1}
    assert "c" in ledger and "a" not in ledger and len(ledger) == 1


def test_take_rank_returns_requests_by_frontend_and_leaves_others() -> None:
    ledger = RequestLedger(max_in_flight=10)
    ledger.add("a", 0, A)
    ledger.add("b", 1, A)
    ledger.add("c", 0, B)
    ledger.add("d", 0, A)
    assert ledger.take_rank(0) == {A: ["a", "d"], B: ["c"]}
    assert ledger.take_rank(0) == {}
    assert ledger.per_rank() == {1: 1} and ledger.get("b") == InFlight(1, A)


def test_move_frontend_redirects_only_that_connections_requests() -> None:
    ledger = RequestLedger(max_in_flight=10)
    ledger.add("a", 0, A)
    ledger.add("b", 1, B)
    assert ledger.move_frontend(A, b"\x00new") == 1
    assert ledger.take_rank(0) == {b"\x00new": ["a"]}


def test_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError):
        RequestLedger(max_in_flight=-1)
