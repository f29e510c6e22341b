"""Connection facts of the leases, one report at a time (``core.ranks.connections``)."""

from __future__ import annotations

from coordinator.core.ranks.claims import Greeting
from coordinator.core.ranks.connections import (
    Connections,
    LeaseConnections,
    reachable_on_dispatch,
)


def test_the_first_greeting_binds_the_identity_and_a_repeat_keeps_it() -> None:
    book, facts = Connections(), LeaseConnections()
    assert not reachable_on_dispatch(facts)
    assert book.greeted(3, facts, 7) is Greeting.BOUND
    assert (facts.dispatch_conn, facts.dispatch_connected) == (7, True)
    assert reachable_on_dispatch(facts)
    assert book.greeted(3, facts, 7) is Greeting.REPEATED
    assert book.greeted(3, facts, 0) is Greeting.REPEATED  # no connection facts
    assert facts.dispatch_conn == 7


def test_a_greeting_from_another_connection_is_a_second_claim_until_it_closes() -> None:
    book, facts = Connections(), LeaseConnections()
    book.greeted(3, facts, 7)
    assert book.greeted(3, facts, 8) is Greeting.SECOND_CLAIM
    assert facts.dispatch_conn == 7 and facts.dispatch_claimed_by == 8
    assert not reachable_on_dispatch(facts)
    assert book.closed(8, {3: facts}) == 3
    # The identity is free again: whoever holds it next must answer a probe first.
    assert facts.dispatch_claimed_by == 0 and facts.dispatch_lost
    assert not reachable_on_dispatch(facts)
    assert book.greeted(3, facts, 7) is Greeting.REPEATED
    assert reachable_on_dispatch(facts)


def test_a_closed_dispatch_connection_is_lost_and_reported_once() -> None:
    book, facts = Connections(), LeaseConnections()
    book.greeted(3, facts, 7)
    assert book.closed(7, {3: facts}) == 3
    assert facts.dispatch_closed and facts.dispatch_lost
    assert book.closed(7, {3: facts}) is None
    assert book.closed(99, {3: facts}) is None  # never seen


def test_a_new_handshake_connection_replaces_the_old_one() -> None:
    book, facts = Connections(), LeaseConnections()
    book.said_hello(3, facts, 5)
    assert book.closed(5, {3: facts}) == 3 and facts.handshake_lost
    book.said_hello(3, facts, 6)
    assert (facts.handshake_conn, facts.handshake_lost) == (6, False)
    book.said_hello(3, facts, 9)
    assert book.closed(6, {3: facts}) is None  # no longer followed
    book.said_hello(3, facts, 0)  # not known: changes nothing
    assert facts.handshake_conn == 9


def test_a_forgotten_lease_is_not_touched_by_its_connections_closing() -> None:
    book, old = Connections(), LeaseConnections()
    book.said_hello(3, old, 5)
    book.greeted(3, old, 7)
    book.greeted(3, old, 8)
    book.forget(3, old)
    successor = LeaseConnections()
    for conn in (5, 7, 8):
        assert book.closed(conn, {3: successor}) is None
    assert successor == LeaseConnections()
    assert book == Connections()


def test_a_close_for_a_rank_without_a_lease_reports_nothing() -> None:
    book, facts = Connections(), LeaseConnections()
    book.greeted(3, facts, 7)
    assert book.closed(7, {}) is None
    assert book.closed(7, {3: facts}) is None  # the report was used up
