"""Rank leases: every row of the state table, every refusal, and the exact texts."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from coordinator.core.ranks.membership import (
    Accepted,
    EngineLease,
    Greeting,
    HelloVerdict,
    Membership,
    ProbeHolder,
    RankChanged,
    RankState,
    RefusalReason,
    Refused,
    hello_verdict,
    is_alive,
)
from coordinator.protocol.errors import RankRangeError
from coordinator.protocol.identity import MAX_RANK

START = 4
COUNT = 3
TTL = 10.0
S = RankState
R = RefusalReason


def make(*, start: int = START, count: int = COUNT, ttl: float = TTL) -> Membership:
    return Membership(rank_start=start, rank_count=count, lease_ttl_s=ttl)


def state_of(m: Membership) -> dict[str, Any]:
    return copy.deepcopy(vars(m))


def accepted(result: Accepted | Refused) -> Accepted:
    assert isinstance(result, Accepted), result
    return result


def refused(result: object) -> Refused:
    assert isinstance(result, Refused), result
    return result


def changed(result: RankChanged | Refused) -> RankChanged:
    assert isinstance(result, RankChanged), result
    return result


def hello(
    m: Membership, rank: int, engine_id: str | None = None, now: float = 0.0, conn: int = 0
) -> Accepted | Refused:
    result = m.hello(rank, engine_id=engine_id, local=False, headless=True, now=now,
                     conn=conn)
    assert not isinstance(result, ProbeHolder), result  # no greeted holder, or facts
    return result


def bring(m: Membership, rank: int, state: RankState, now: float = 0.0) -> None:
    """Put `rank` in `state` through the public API only."""
    accepted(hello(m, rank, now=now))
    if state is S.HANDSHAKING:
        return
    if state is S.DEAD:
        assert m.disconnected(rank, now)
        return
    accepted(m.ready(rank, parallel_config_hash=None, now=now))
    if state is S.CORDONED:
        changed(m.cordon(rank))
    elif state is S.DRAINING:
        changed(m.drain(rank))


# -- the state table ----------------------------------------------------------------

# Written out independently of the module: what each event does in each state.
# A RankState is the next state, a RefusalReason a refusal, None "nothing happens".
EXPECTED: dict[RankState, dict[str, RankState | RefusalReason | None]] = {
    S.HANDSHAKING: {
        "ready": S.READY,
        "cordon": R.INVALID_TRANSITION,
        "uncordon": R.INVALID_TRANSITION,
        "drain": R.INVALID_TRANSITION,
        "disconnect": S.DEAD,
        "expire": S.DEAD,
    },
    S.READY: {
        "ready": R.OUT_OF_ORDER,
        "cordon": S.CORDONED,
        "uncordon": R.INVALID_TRANSITION,
        "drain": S.DRAINING,
        "disconnect": S.DEAD,
        "expire": S.DEAD,
    },
    S.CORDONED: {
        "ready": R.OUT_OF_ORDER,
        "cordon": R.INVALID_TRANSITION,
        "uncordon": S.READY,
        "drain": S.DRAINING,
        "disconnect": S.DEAD,
        "expire": S.DEAD,
    },
    S.DRAINING: {
        "ready": R.OUT_OF_ORDER,
        "cordon": R.INVALID_TRANSITION,
        "uncordon": S.READY,
        "drain": R.INVALID_TRANSITION,
        "disconnect": S.DEAD,
        "expire": S.DEAD,
    },
    S.DEAD: {
        "ready": R.OUT_OF_ORDER,
        "cordon": R.UNKNOWN_RANK,
        "uncordon": R.UNKNOWN_RANK,
        "drain": R.UNKNOWN_RANK,
        "disconnect": None,
        "expire": None,
    },
}

TABLE_ROWS = [(state, event) for state, row in EXPECTED.items() for event in row]


def fire(m: Membership, rank: int, event: str, now: float) -> RankChanged | Refused | None:
    if event == "ready":
        result = m.ready(rank, parallel_config_hash=None, now=now)
        return result if isinstance(result, Refused) else None
    if event == "cordon":
        return m.cordon(rank, now=now)
    if event == "uncordon":
        return m.uncordon(rank, now=now)
    if event == "drain":
        return m.drain(rank, now=now)
    changes = m.disconnected(rank, now) if event == "disconnect" else m.expire(now + TTL + 1)
    assert len(changes) <= 1
    return changes[0] if changes else None


@pytest.mark.parametrize(("state", "event"), TABLE_ROWS, ids=lambda v: getattr(v, "value", v))
def test_state_table_row(state: RankState, event: str) -> None:
    m = make()
    bring(m, 5, state, now=1.0)
    before = state_of(m)
    old = m.lease(5)
    assert old is not None and old.state is state

    outcome = fire(m, 5, event, now=2.0)
    expected = EXPECTED[state][event]
    after = m.lease(5)
    assert after is not None

    if isinstance(expected, RefusalReason):
        assert isinstance(outcome, Refused)
        assert outcome.reason is expected
        assert "dp_rank=5" in outcome.message
        assert state_of(m) == before
    elif expected is None:
        assert outcome is None
        assert state_of(m) == before
    else:
        assert after.state is expected
        assert after.incarnation == old.incarnation
        if event != "ready":
            assert isinstance(outcome, RankChanged)
            assert (outcome.rank, outcome.old, outcome.new) == (5, state, expected)
            assert outcome.cause


def test_table_covers_every_state() -> None:
    assert set(EXPECTED) == set(RankState)


# -- HELLO ----------------------------------------------------------------------


def test_hello_takes_a_free_rank() -> None:
    m = make()
    result = accepted(m.hello(5, engine_id="engine-a", local=True, headless=False, now=3.0))
    assert result.replaced is None and not result.duplicate
    lease = result.lease
    assert lease == EngineLease(
        rank=5,
        engine_id="engine-a",
        state=S.HANDSHAKING,
        registered_at=3.0,
        last_seen=3.0,
        local=True,
        headless=False,
        dispatch_connected=False,
        parallel_config_hash=None,
        incarnation=1,
    )
    assert m.lease(5) == lease


@pytest.mark.parametrize("rank", [0, START - 1, START + COUNT, MAX_RANK])
def test_hello_out_of_range_is_refused_with_the_range_error_text(rank: int) -> None:
    m = make()
    before = state_of(m)
    result = refused(hello(m, rank, "engine-a"))
    assert result.reason is R.RANK_OUT_OF_RANGE
    assert result.message == str(RankRangeError(rank, START, COUNT))
    assert result.message.startswith(f"dp_rank={rank} is outside this coordinator's range")
    assert state_of(m) == before


def test_hello_without_ids_takes_a_rank_whose_holder_nothing_says_is_there() -> None:
    # vLLM engines carry no engine_id and say HELLO once per process; with no
    # connection facts and nothing to probe, a new HELLO is a new process.
    m = make()
    bring(m, 5, S.READY, now=1.0)
    result = accepted(hello(m, 5, None, now=2.0))
    assert result.replaced is not None
    assert result.replaced.incarnation == 1 and result.replaced.state is S.READY
    assert result.lease.incarnation == 2
    assert result.lease.state is S.HANDSHAKING
    assert not result.lease.dispatch_connected
    assert result.lease.registered_at == 2.0


def test_hello_without_ids_is_refused_while_the_holder_is_heard() -> None:
    m = make()
    accepted(hello(m, 5, None, now=0.0, conn=11))
    accepted(m.ready(5, parallel_config_hash=None, now=0.5, conn=11))
    assert m.greeted(5, 1.0, conn=12) is Greeting.BOUND
    assert m.connection_closed(11) == 5  # vLLM closes its handshake socket after READY
    before = state_of(m)
    # What its dispatch connection carries decides: it is probed first.
    asked = m.hello(5, engine_id=None, local=False, headless=True, now=4.0, conn=13)
    assert isinstance(asked, ProbeHolder) and state_of(m) == before
    result = refused(m.hello(5, engine_id=None, local=False, headless=True, now=4.0,
                             conn=13, holder_reachable=True))
    assert result.reason is R.RANK_HELD
    assert result.message == (
        "dp_rank=5 is held by a live engine (ready, incarnation 1, still connected, last "
        "seen 3.0 s ago), and neither engine has an engine_id to tell whether they are the "
        "same. Stop the old engine: its rank is freed as soon as its connections are gone, "
        "and this engine is accepted when it says HELLO again; or give this engine another "
        "rank."
    )
    assert state_of(m) == before


def test_hello_without_ids_asks_for_a_probe_once_the_dispatch_connection_closed() -> None:
    m = make()
    accepted(hello(m, 5, None, now=0.0, conn=11))
    accepted(m.ready(5, parallel_config_hash=None, now=0.5, conn=11))
    m.greeted(5, 1.0, conn=12)
    assert m.connection_closed(12) == 5
    assert m.dispatchable() == []  # lost: no new requests until a probe reaches it
    asked = m.hello(5, engine_id=None, local=False, headless=True, now=2.0, conn=13)
    assert isinstance(asked, ProbeHolder)  # it may be back under a new connection
    taken = m.hello(5, engine_id=None, local=False, headless=True, now=2.0, conn=13,
                    holder_reachable=False)
    assert isinstance(taken, Accepted) and taken.lease.incarnation == 2
    assert taken.released is not None and taken.released.new is S.DEAD


def test_a_hello_whose_peer_vanished_frees_the_rank_at_once() -> None:
    m = make(ttl=TTL)
    accepted(hello(m, 5, "intruder", now=0.0, conn=21))
    refused(hello(m, 5, "engine-a", now=1.0, conn=22))  # still connected: it holds
    assert m.connection_closed(21) == 5
    taken = accepted(hello(m, 5, "engine-a", now=1.5, conn=23))
    assert taken.released == RankChanged(
        5, S.HANDSHAKING, S.DEAD, "engine disconnected (last seen 1.5 s ago)")
    assert taken.lease.engine_id == "engine-a" and taken.lease.incarnation == 2
    assert taken.lease.handshake_conn == 23


def test_a_handshaking_lease_whose_connection_came_back_still_takes_its_ready() -> None:
    m = make()
    accepted(hello(m, 5, None, now=0.0, conn=31))
    m.connection_closed(31)  # a tcp connection dropped while the model loads
    lease = accepted(m.ready(5, parallel_config_hash=None, now=5.0, conn=32)).lease
    assert lease.state is S.READY and lease.handshake_conn == 32 and not lease.handshake_lost


def test_duplicate_hello_with_the_same_id_is_idempotent() -> None:
    m = make()
    first = accepted(hello(m, 5, "engine-a", now=1.0)).lease
    again = accepted(hello(m, 5, "engine-a", now=4.0))
    assert again.duplicate and again.replaced is None
    assert again.lease.incarnation == first.incarnation
    assert again.lease.registered_at == 1.0
    assert again.lease.last_seen == 4.0
    assert m.lease(5) == again.lease


@pytest.mark.parametrize(
    ("held", "new"),
    [("engine-a", "engine-b"), (None, "engine-b"), ("engine-a", None)],
)
def test_hello_with_another_id_is_refused_while_the_holder_lives(
    held: str | None, new: str | None
) -> None:
    m = make()
    accepted(hello(m, 5, held, now=1.0))
    before = state_of(m)
    result = refused(hello(m, 5, new, now=4.0))
    assert result.reason is R.ENGINE_ID_MISMATCH
    assert result.message.startswith(
        f"Engine ID mismatch for dp_rank=5: expected {held}, got {new}. "
    )
    assert "Stop the old engine: its rank is freed as soon as its connections are gone" in (
        result.message)
    assert state_of(m) == before


def test_engine_id_mismatch_exact_text() -> None:
    m = make()
    accepted(hello(m, 6, "engine-a", now=0.0))
    accepted(m.ready(6, parallel_config_hash=None, now=2.5))
    result = refused(hello(m, 6, "engine-b", now=4.0))
    assert result.message == (
        "Engine ID mismatch for dp_rank=6: expected engine-a, got engine-b. "
        "dp_rank=6 is held by a live engine (ready, incarnation 1, still connected, last "
        "seen 1.5 s ago). Stop the old engine: its rank is freed as soon as its connections "
        "are gone, and this engine is accepted when it says HELLO again."
    )


def probed_hello(
    m: Membership, rank: int, engine_id: str | None, now: float, reachable: bool | None
) -> Accepted | Refused | ProbeHolder:
    return m.hello(rank, engine_id=engine_id, local=False, headless=True, now=now,
                   holder_reachable=reachable)


@pytest.mark.parametrize(
    ("greeted", "reachable", "verdict"),
    [
        (True, None, HelloVerdict.PROBE_HOLDER),
        (False, None, HelloVerdict.MISMATCH),  # nothing to probe it on
        (True, True, HelloVerdict.MISMATCH),
        (False, True, HelloVerdict.MISMATCH),
        (True, False, HelloVerdict.TAKE_OVER),
        (False, False, HelloVerdict.TAKE_OVER),
    ],
)
def test_hello_verdict_reachability_column(
    greeted: bool, reachable: bool | None, verdict: HelloVerdict
) -> None:
    m = make()
    bring(m, 5, S.READY)
    if greeted:
        assert m.greeted(5, 0.0)
    holder = m.lease(5)
    assert hello_verdict(holder, "other", reachable) is verdict
    # Without ids on either side, only a connected holder keeps the rank.
    unnamed = {None: HelloVerdict.PROBE_HOLDER if greeted else HelloVerdict.TAKE,
               True: HelloVerdict.RANK_HELD, False: HelloVerdict.TAKE_OVER}
    assert hello_verdict(holder, None, reachable) is unnamed[reachable]
    # Nobody holds the rank: reachability never matters.
    assert hello_verdict(None, "other", reachable) is HelloVerdict.TAKE


def test_unknown_reachability_of_a_greeted_holder_asks_for_a_probe_and_changes_nothing() -> None:
    m = make()
    accepted(hello(m, 5, "engine-a", now=0.0))
    accepted(m.ready(5, parallel_config_hash=None, now=0.0))
    assert m.greeted(5, 1.0)
    before = state_of(m)
    result = probed_hello(m, 5, "engine-b", 2.0, None)
    assert isinstance(result, ProbeHolder)
    assert result.rank == 5 and result.holder.engine_id == "engine-a"
    assert state_of(m) == before
    # The holder answered: an ordinary mismatch refusal.
    assert refused(probed_hello(m, 5, "engine-b", 2.0, True)).reason is R.ENGINE_ID_MISMATCH


def test_an_unreachable_holder_is_released_and_the_new_engine_takes_over() -> None:
    m = make()
    accepted(hello(m, 5, "engine-a", now=0.0))
    accepted(m.ready(5, parallel_config_hash=None, now=0.0))
    assert m.greeted(5, 1.0)
    taken = probed_hello(m, 5, "engine-b", 3.0, False)
    assert isinstance(taken, Accepted)
    assert taken.released == RankChanged(
        5, S.READY, S.DEAD, "engine disconnected (last seen 2.0 s ago)")
    assert taken.replaced is not None and taken.replaced.state is S.DEAD
    assert taken.lease.engine_id == "engine-b" and taken.lease.incarnation == 2
    assert m.dispatchable() == []


def test_lease_is_alive_up_to_and_including_its_ttl() -> None:
    m = make()
    accepted(hello(m, 5, "engine-a", now=0.0))
    result = refused(hello(m, 5, "engine-b", now=TTL))
    assert "last seen 10.0 s ago" in result.message
    taken = accepted(hello(m, 5, "engine-b", now=TTL + 0.001))
    assert taken.replaced is not None and taken.replaced.engine_id == "engine-a"
    assert taken.lease.incarnation == 2


def test_hello_takes_over_a_dead_lease_at_once() -> None:
    m = make()
    accepted(hello(m, 5, "engine-a", now=0.0))
    assert m.disconnected(5, 1.0)
    taken = accepted(hello(m, 5, "engine-b", now=1.0))
    assert taken.replaced is not None and taken.replaced.state is S.DEAD
    assert taken.lease.engine_id == "engine-b" and taken.lease.incarnation == 2


def test_same_id_after_expiry_is_a_new_incarnation_not_a_duplicate() -> None:
    m = make()
    accepted(hello(m, 5, "engine-a", now=0.0))
    again = accepted(hello(m, 5, "engine-a", now=TTL + 1))
    assert not again.duplicate
    assert again.lease.incarnation == 2


# -- READY ----------------------------------------------------------------------


def test_ready_before_hello_is_out_of_order() -> None:
    m = make()
    before = state_of(m)
    result = refused(m.ready(5, parallel_config_hash="h1", now=0.0))
    assert result.reason is R.OUT_OF_ORDER
    assert result.message.startswith("READY from dp_rank=5 before any HELLO")
    assert state_of(m) == before
    assert m.group_config_hash is None


def test_ready_out_of_range_is_refused() -> None:
    m = make()
    result = refused(m.ready(START + COUNT, parallel_config_hash=None, now=0.0))
    assert result.reason is R.RANK_OUT_OF_RANGE
    assert result.message == str(RankRangeError(START + COUNT, START, COUNT))


def test_ready_twice_is_out_of_order() -> None:
    m = make()
    bring(m, 5, S.READY)
    before = state_of(m)
    result = refused(m.ready(5, parallel_config_hash=None, now=1.0))
    assert result.reason is R.OUT_OF_ORDER
    assert result.message.startswith(
        "duplicate READY from dp_rank=5: the rank is already ready (incarnation 1)"
    )
    assert state_of(m) == before


def test_ready_for_a_dead_lease_is_out_of_order() -> None:
    m = make()
    bring(m, 5, S.DEAD)
    result = refused(m.ready(5, parallel_config_hash=None, now=1.0))
    assert result.reason is R.OUT_OF_ORDER
    assert "its registration (incarnation 1) is dead" in result.message
    assert "HELLO" in result.message


def test_ready_after_the_lease_expired_is_refused_and_changes_nothing() -> None:
    m = make()
    bring(m, 5, S.HANDSHAKING, now=0.0)
    before = state_of(m)
    result = refused(m.ready(5, parallel_config_hash=None, now=TTL + 1))
    assert result.reason is R.OUT_OF_ORDER
    assert "its lease expired (last seen 11.0 s ago)" in result.message
    assert state_of(m) == before


def test_ready_accepted_moves_to_ready_and_renews() -> None:
    m = make()
    bring(m, 5, S.HANDSHAKING, now=0.0)
    result = accepted(m.ready(5, parallel_config_hash="h1", now=3.0))
    assert result.lease.state is S.READY
    assert result.lease.parallel_config_hash == "h1"
    assert result.lease.last_seen == 3.0
    assert not result.duplicate and result.replaced is None
    assert m.group_config_hash == "h1"


def test_config_hash_mismatch_is_refused_and_frees_the_rank() -> None:
    m = make()
    bring(m, 4, S.HANDSHAKING)
    accepted(m.ready(4, parallel_config_hash="aaa111", now=0.0))
    accepted(hello(m, 5, "engine-a", now=1.0))
    result = refused(m.ready(5, parallel_config_hash="bbb222", now=2.0))
    assert result.reason is R.CONFIG_HASH_MISMATCH
    assert result.message.startswith(
        "parallel config hash mismatch for dp_rank=5: the group runs with aaa111, "
        "this engine has bbb222."
    )
    assert "make collectives hang" in result.message
    lease5 = m.lease(5)
    assert lease5 is not None and lease5.state is S.DEAD
    assert m.group_config_hash == "aaa111"
    # The rank is free: an engine with another id takes it at once.
    assert accepted(hello(m, 5, "engine-b", now=2.0)).lease.incarnation == 2
    assert accepted(m.ready(5, parallel_config_hash="aaa111", now=2.0)).lease.state is S.READY


def test_matching_and_missing_hashes_are_accepted() -> None:
    m = make()
    for rank in (4, 5, 6):
        bring(m, rank, S.HANDSHAKING)
    accepted(m.ready(4, parallel_config_hash="h1", now=0.0))
    accepted(m.ready(5, parallel_config_hash="h1", now=0.0))
    lease6 = accepted(m.ready(6, parallel_config_hash=None, now=0.0)).lease
    assert lease6.parallel_config_hash is None
    assert m.group_config_hash == "h1"


def test_group_hash_is_released_when_no_live_engine_carries_it() -> None:
    # A whole group redeployed with new settings must not need a coordinator restart.
    m = make()
    bring(m, 4, S.HANDSHAKING)
    accepted(m.ready(4, parallel_config_hash="old", now=0.0))
    m.disconnected(4, 1.0)
    bring(m, 5, S.HANDSHAKING, now=1.0)
    accepted(m.ready(5, parallel_config_hash="new", now=1.0))
    assert m.group_config_hash == "new"
    # A holder past its TTL pins it until expire judges it (its next traffic or probe
    # answer would renew it); once it is DEAD the group may move on.
    bring(m, 6, S.HANDSHAKING, now=TTL + 5)
    assert refused(m.ready(6, parallel_config_hash="newer", now=TTL + 5)).reason is (
        R.CONFIG_HASH_MISMATCH)
    assert m.group_config_hash == "new"
    assert [c.rank for c in m.expire(TTL + 5)] == [5]
    bring(m, 6, S.HANDSHAKING, now=TTL + 5)
    accepted(m.ready(6, parallel_config_hash="newer", now=TTL + 5))
    assert m.group_config_hash == "newer"


def test_the_rank_itself_does_not_pin_its_own_hash() -> None:
    # A lease still handshaking has no hash: only ranks past READY pin one.
    m = make()
    bring(m, 4, S.HANDSHAKING)
    accepted(m.ready(4, parallel_config_hash="h1", now=0.0))
    accepted(hello(m, 4, None, now=1.0))  # vLLM restart replaces the holder
    assert accepted(m.ready(4, parallel_config_hash="h2", now=1.0)).lease.state is S.READY
    assert m.group_config_hash == "h2"


# -- greeting, touch, liveness --------------------------------------------------


def test_greeted_marks_dispatch_connected_and_renews() -> None:
    m = make()
    bring(m, 5, S.HANDSHAKING, now=0.0)
    assert m.greeted(5, 4.0)
    lease = m.lease(5)
    assert lease is not None and lease.dispatch_connected and lease.last_seen == 4.0
    assert lease.state is S.HANDSHAKING


@pytest.mark.parametrize("situation", ["unknown", "out_of_range", "dead", "stale"])
def test_greeted_without_a_live_lease_is_false_and_changes_nothing(situation: str) -> None:
    m = make()
    rank, now = 5, 1.0
    if situation == "out_of_range":
        rank = START + COUNT
    elif situation == "dead":
        bring(m, 5, S.DEAD)
    elif situation == "stale":
        bring(m, 5, S.READY)
        now = TTL + 1
    before = state_of(m)
    assert m.greeted(rank, now) is Greeting.UNREGISTERED
    assert state_of(m) == before


def test_touch_renews_a_live_lease() -> None:
    m = make()
    bring(m, 5, S.READY, now=0.0)
    m.touch(5, 8.0)
    assert m.expire(TTL + 1) == []
    lease = m.lease(5)
    assert lease is not None and lease.last_seen == 8.0 and lease.state is S.READY


def test_touch_renews_a_lease_past_its_ttl_but_never_a_dead_one() -> None:
    # Traffic that arrived is evidence, however late the timer is to look at it.
    m = make()
    bring(m, 5, S.READY, now=0.0)
    bring(m, 6, S.DEAD, now=0.0)
    m.touch(5, TTL + 1)
    before = state_of(m)
    m.touch(6, 1.0)
    m.touch(4, 1.0)  # nobody there
    m.touch(99, 1.0)  # out of range
    assert state_of(m) == before
    assert m.expire(TTL + 1) == []
    assert m.lease(5).last_seen == TTL + 1  # type: ignore[union-attr]


def test_disconnected_kills_a_live_lease_at_once() -> None:
    m = make()
    bring(m, 5, S.READY, now=1.0)
    assert m.disconnected(5, 3.0) == [
        RankChanged(5, S.READY, S.DEAD, "engine disconnected (last seen 2.0 s ago)")
    ]
    assert m.disconnected(5, 4.0) == []
    assert m.disconnected(6, 4.0) == []
    assert m.dispatchable() == []


def test_disconnected_for_an_older_incarnation_is_ignored() -> None:
    m = make()
    bring(m, 5, S.HANDSHAKING, now=0.0)
    accepted(hello(m, 5, None, now=1.0))  # incarnation 2 replaced 1
    before = state_of(m)
    assert m.disconnected(5, 2.0, incarnation=1) == []
    assert state_of(m) == before
    [change] = m.disconnected(5, 2.0, incarnation=2)
    assert change.new is S.DEAD


def test_expire_reaps_only_leases_past_their_ttl() -> None:
    m = make()
    bring(m, 4, S.READY, now=0.0)
    bring(m, 5, S.CORDONED, now=0.5)
    bring(m, 6, S.HANDSHAKING, now=5.0)
    assert m.expire(TTL) == []  # rank 4 is exactly at its ttl: still alive
    assert m.expire(TTL + 0.5) == [
        RankChanged(4, S.READY, S.DEAD, "lease expired (last seen 10.5 s ago)"),
    ]
    assert m.expire(TTL + 2) == [
        RankChanged(5, S.CORDONED, S.DEAD, "lease expired (last seen 11.5 s ago)"),
    ]
    assert m.expire(100.0) == [
        RankChanged(6, S.HANDSHAKING, S.DEAD, "lease expired (last seen 95.0 s ago)"),
    ]
    assert m.expire(200.0) == []


def test_expire_spares_ranks_being_probed() -> None:
    m = make()
    bring(m, 4, S.READY, now=0.0)
    bring(m, 5, S.READY, now=0.0)
    assert m.expire(TTL + 1, spare={4}) == [
        RankChanged(5, S.READY, S.DEAD, "lease expired (last seen 11.0 s ago)"),
    ]
    assert [change.rank for change in m.expire(TTL + 1)] == [4]


def test_dead_comes_back_only_by_revival_or_hello() -> None:
    m = make()
    bring(m, 5, S.READY, now=0.0)
    m.expire(TTL + 1)
    assert m.greeted(5, TTL + 2) is Greeting.UNREGISTERED
    m.touch(5, TTL + 2)
    m.renew(5, TTL + 2)
    assert refused(m.uncordon(5)).reason is R.UNKNOWN_RANK
    assert refused(m.ready(5, parallel_config_hash=None, now=TTL + 2)).reason is R.OUT_OF_ORDER
    lease = m.lease(5)
    assert lease is not None and lease.state is S.DEAD


# -- operator commands ------------------------------------------------------------


def test_command_causes_are_human_readable() -> None:
    m = make()
    bring(m, 5, S.READY)
    assert "cordoned" in changed(m.cordon(5)).cause
    assert "uncordoned" in changed(m.uncordon(5)).cause
    assert "draining" in changed(m.drain(5)).cause


@pytest.mark.parametrize("command", ["cordon", "uncordon", "drain"])
def test_command_on_a_rank_nobody_holds(command: str) -> None:
    m = make()
    result = refused(getattr(m, command)(5))
    assert result.reason is R.UNKNOWN_RANK
    assert result.message == (
        f"cannot {command} dp_rank=5: no live engine holds it (no engine has registered for it)"
    )


def test_command_on_a_dead_rank() -> None:
    m = make()
    bring(m, 5, S.DEAD)
    assert refused(m.cordon(5)).message == (
        "cannot cordon dp_rank=5: no live engine holds it (its last engine (incarnation 1) is dead)"
    )


def test_command_on_an_expired_rank_when_now_is_given() -> None:
    m = make()
    bring(m, 5, S.READY, now=0.0)
    before = state_of(m)
    result = refused(m.drain(5, now=TTL + 1))
    assert result.reason is R.UNKNOWN_RANK
    assert result.message.endswith("(its engine's lease has expired)")
    assert state_of(m) == before
    # Without `now` only the state counts: the server's expire timer decides.
    assert changed(m.drain(5)).new is S.DRAINING


@pytest.mark.parametrize("command", ["cordon", "uncordon", "drain"])
def test_command_out_of_range(command: str) -> None:
    m = make()
    result = refused(getattr(m, command)(START - 1))
    assert result.reason is R.RANK_OUT_OF_RANGE
    assert result.message == str(RankRangeError(START - 1, START, COUNT))


@pytest.mark.parametrize(
    ("state", "command", "text"),
    [
        (S.HANDSHAKING, "cordon", "cannot cordon dp_rank=5: it is handshaking; wait until"),
        (S.HANDSHAKING, "drain", "cannot drain dp_rank=5: it is handshaking; wait until"),
        (S.HANDSHAKING, "uncordon", "cannot uncordon dp_rank=5: it is handshaking; only a"),
        (S.READY, "uncordon", "cannot uncordon dp_rank=5: it is ready; only a cordoned"),
        (S.CORDONED, "cordon", "cannot cordon dp_rank=5: it is cordoned; it is already"),
        (S.DRAINING, "cordon", "cannot cordon dp_rank=5: it is draining; draining already"),
        (S.DRAINING, "drain", "cannot drain dp_rank=5: it is draining; it is already"),
    ],
)
def test_illegal_command_texts(state: RankState, command: str, text: str) -> None:
    m = make()
    bring(m, 5, state)
    result = refused(getattr(m, command)(5))
    assert result.reason is R.INVALID_TRANSITION
    assert result.message.startswith(text)


# -- dispatchable, all_ready ----------------------------------------------------------


def test_dispatchable_needs_ready_greeted_and_alive() -> None:
    m = make(count=4)
    for rank in (4, 5, 6, 7):
        bring(m, rank, S.READY, now=0.0)
    assert m.dispatchable() == []  # nobody greeted on dispatch yet
    for rank in (7, 4, 5):
        assert m.greeted(rank, 1.0)
    assert m.dispatchable() == [4, 5, 7]
    changed(m.cordon(5))
    assert m.dispatchable() == [4, 7]
    changed(m.drain(7))
    assert m.dispatchable() == [4]
    changed(m.uncordon(5))
    assert m.dispatchable() == [4, 5]
    m.touch(5, 6.0)
    assert m.dispatchable(now=TTL + 2) == [5]  # rank 4 is past its ttl
    assert m.dispatchable() == [4, 5]  # until expire() reaps it
    m.expire(TTL + 2)
    assert m.dispatchable() == [5]


def test_all_ready() -> None:
    m = make()
    assert not m.all_ready()
    for rank in (4, 5):
        bring(m, rank, S.READY, now=0.0)
    assert not m.all_ready()
    bring(m, 6, S.HANDSHAKING, now=0.0)
    assert not m.all_ready()
    accepted(m.ready(6, parallel_config_hash=None, now=5.0))
    assert m.all_ready()
    assert not m.all_ready(now=TTL + 1)
    changed(m.cordon(6))
    assert not m.all_ready()


def test_all_ready_is_false_for_an_empty_range() -> None:
    assert not make(count=0).all_ready()


# -- resize --------------------------------------------------------------------


def test_grow_adds_empty_ranks() -> None:
    m = make()
    bring(m, 4, S.READY)
    assert refused(hello(m, 8, "engine-x")).reason is R.RANK_OUT_OF_RANGE
    assert m.resize(5) == []
    assert m.rank_count == 5
    assert m.check_rank(8) is None
    assert m.lease(8) is None
    assert accepted(hello(m, 8, "engine-x")).lease.incarnation == 1
    assert not m.all_ready()


def test_shrink_drops_leases_above_the_range() -> None:
    m = make()
    bring(m, 4, S.READY)
    bring(m, 5, S.CORDONED)
    bring(m, 6, S.DEAD)
    cause = "rank removed: group resized from 3 to 1 ranks"
    assert m.resize(1) == [
        RankChanged(5, S.CORDONED, None, cause),
        RankChanged(6, S.DEAD, None, cause),
    ]
    assert [lease.rank for lease in m.leases()] == [4]
    assert m.lease(5) is None
    assert refused(m.cordon(5)).reason is R.RANK_OUT_OF_RANGE


def test_incarnations_survive_shrink_and_grow() -> None:
    m = make()
    bring(m, 6, S.READY)
    m.resize(2)
    m.resize(3)
    assert accepted(hello(m, 6)).lease.incarnation == 2


def test_shrink_to_zero_and_bad_sizes() -> None:
    m = make()
    bring(m, 4, S.READY)
    assert [c.rank for c in m.resize(0)] == [4]
    assert m.check_rank(4) is not None
    with pytest.raises(ValueError):
        m.resize(-1)
    with pytest.raises(ValueError):
        m.resize(MAX_RANK + 1)


# -- construction, copies, helpers ------------------------------------------------


@pytest.mark.parametrize(
    ("start", "count", "ttl"),
    [
        (-1, 2, 1.0),
        (0, -1, 1.0),
        (MAX_RANK, 2, 1.0),
        (0, 2, 0.0),
        (0, 2, math.nan),
        (0, 2, math.inf),
    ],
)
def test_bad_construction(start: int, count: int, ttl: float) -> None:
    with pytest.raises(ValueError):
        Membership(rank_start=start, rank_count=count, lease_ttl_s=ttl)


def test_attributes() -> None:
    m = Membership(rank_start=MAX_RANK, rank_count=1, lease_ttl_s=2.5)
    assert (m.rank_start, m.rank_count, m.lease_ttl_s, m.group_config_hash) == (
        MAX_RANK,
        1,
        2.5,
        None,
    )
    assert m.check_rank(MAX_RANK) is None


def test_handed_out_leases_are_copies() -> None:
    m = make()
    lease = accepted(hello(m, 5, "engine-a")).lease
    lease.state = S.READY
    lease.dispatch_connected = True
    copy_ = m.lease(5)
    assert copy_ is not None
    copy_.last_seen = 1000.0
    m.leases()[0].state = S.DRAINING
    held = m.lease(5)
    assert held is not None
    assert held.state is S.HANDSHAKING and not held.dispatch_connected and held.last_seen == 0.0
    assert m.dispatchable() == []


def test_leases_are_listed_by_rank() -> None:
    m = make()
    for rank in (6, 4, 5):
        bring(m, rank, S.HANDSHAKING)
    assert [lease.rank for lease in m.leases()] == [4, 5, 6]


def _lease(engine_id: str | None, state: RankState = S.READY) -> EngineLease:
    return EngineLease(
        rank=0, engine_id=engine_id, state=state, registered_at=0.0, last_seen=0.0, incarnation=1
    )


@pytest.mark.parametrize(
    ("holder", "new", "verdict"),
    [
        (None, None, HelloVerdict.TAKE),
        (None, "a", HelloVerdict.TAKE),
        (_lease(None), None, HelloVerdict.TAKE),
        (_lease("a"), "a", HelloVerdict.DUPLICATE),
        (_lease("a"), "b", HelloVerdict.MISMATCH),
        (_lease(None), "a", HelloVerdict.MISMATCH),
        (_lease("a"), None, HelloVerdict.MISMATCH),
    ],
)
def test_hello_verdict_without_connection_facts(
    holder: EngineLease | None, new: str | None, verdict: HelloVerdict
) -> None:
    assert hello_verdict(holder, new, None) is verdict


def test_is_alive() -> None:
    assert is_alive(_lease("a"), 5.0, 5.0)
    assert not is_alive(_lease("a"), 5.01, 5.0)
    assert is_alive(_lease("a"), None, 5.0)
    assert not is_alive(_lease("a", S.DEAD), 0.0, 5.0)
    assert not is_alive(_lease("a", S.DEAD), None, 5.0)


# -- handshake TTL ---------------------------------------------------------------


def test_handshaking_lease_lives_for_the_handshake_ttl_not_the_lease_ttl() -> None:
    """A vLLM engine is silent while it loads its model between INIT and READY."""
    m = Membership(rank_start=0, rank_count=1, lease_ttl_s=10.0, handshake_ttl_s=600.0)
    assert isinstance(m.hello(0, engine_id=None, local=True, headless=False, now=0.0), Accepted)
    assert m.expire(300.0) == []
    assert isinstance(m.ready(0, parallel_config_hash="h", now=300.0), Accepted)
    # Once READY, the ordinary lease TTL applies again.
    changes = m.expire(311.0)
    assert [(c.rank, c.new) for c in changes] == [(0, RankState.DEAD)]


def test_handshaking_lease_expires_after_the_handshake_ttl() -> None:
    m = Membership(rank_start=0, rank_count=1, lease_ttl_s=10.0, handshake_ttl_s=60.0)
    m.hello(0, engine_id="a", local=True, headless=False, now=0.0)
    refused = m.hello(0, engine_id="b", local=True, headless=False, now=30.0)
    assert isinstance(refused, Refused)
    assert "last seen 30.0 s ago" in refused.message
    assert [c.new for c in m.expire(60.5)] == [RankState.DEAD]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_handshake_ttl_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="handshake_ttl_s"):
        Membership(rank_start=0, rank_count=1, lease_ttl_s=1.0, handshake_ttl_s=bad)


# -- restore after a coordinator restart -------------------------------------------


def _restore(m: Membership, rank: int, state: RankState, **kw: Any) -> Accepted | Refused:
    args: dict[str, Any] = dict(engine_id="e", incarnation=3, state=state, local=True,
                                headless=False, parallel_config_hash="h", now=100.0)
    args.update(kw)
    return m.restore(rank, **args)


@pytest.mark.parametrize("state", [RankState.READY, RankState.CORDONED, RankState.DRAINING])
def test_restore_brings_back_settled_leases_as_connected(state: RankState) -> None:
    m = Membership(rank_start=0, rank_count=2, lease_ttl_s=10.0)
    result = _restore(m, 1, state)
    assert isinstance(result, Accepted)
    lease = m.lease(1)
    assert lease is not None
    assert (lease.state, lease.engine_id, lease.incarnation, lease.dispatch_connected) == (
        state, "e", 3, True)
    assert lease.last_seen == 100.0
    assert m.group_config_hash == "h"
    assert m.dispatchable(now=100.0) == ([1] if state is RankState.READY else [])


def test_restored_lease_expires_like_any_other() -> None:
    m = Membership(rank_start=0, rank_count=1, lease_ttl_s=10.0)
    _restore(m, 0, RankState.READY)
    assert [c.new for c in m.expire(111.0)] == [RankState.DEAD]


def test_restored_lease_blocks_a_different_engine_and_counts_incarnations_on() -> None:
    m = Membership(rank_start=0, rank_count=1, lease_ttl_s=10.0)
    _restore(m, 0, RankState.READY, incarnation=7)
    # No connection facts survive a restart: the holder is probed on dispatch first.
    asked = m.hello(0, engine_id="other", local=True, headless=False, now=101.0)
    assert isinstance(asked, ProbeHolder)
    refused = m.hello(0, engine_id="other", local=True, headless=False, now=101.0,
                      holder_reachable=True)
    assert isinstance(refused, Refused)
    assert refused.reason is RefusalReason.ENGINE_ID_MISMATCH
    m.disconnected(0, 102.0)
    taken = m.hello(0, engine_id="other", local=True, headless=False, now=103.0)
    assert isinstance(taken, Accepted)
    assert taken.lease.incarnation == 8


@pytest.mark.parametrize(
    ("rank", "state", "match"),
    [
        (5, RankState.READY, "outside"),
        (0, RankState.HANDSHAKING, "only ready, cordoned or draining"),
        (0, RankState.DEAD, "only ready, cordoned or draining"),
    ],
)
def test_restore_refuses_what_cannot_come_back(rank: int, state: RankState, match: str) -> None:
    m = Membership(rank_start=0, rank_count=1, lease_ttl_s=10.0)
    refused = _restore(m, rank, state)
    assert isinstance(refused, Refused)
    assert match in refused.message
    assert m.leases() == []


def test_restore_refuses_a_rank_that_is_already_registered() -> None:
    m = Membership(rank_start=0, rank_count=1, lease_ttl_s=10.0)
    m.hello(0, engine_id="a", local=True, headless=False, now=0.0)
    refused = _restore(m, 0, RankState.READY)
    assert isinstance(refused, Refused)
    assert "already registered" in refused.message


# -- revival and the group's parallel config -------------------------------------------------


def test_a_rank_whose_group_was_redeployed_meanwhile_is_not_revived() -> None:
    """Found by the whole-membership model: a rank that died with one config hash, while
    the group came back with another, must not rejoin it (its collectives would hang)."""
    m = make()
    accepted(hello(m, START, now=0.0))
    accepted(m.ready(START, parallel_config_hash="h2", now=0.0))
    assert [c.new for c in m.expire(TTL + 1.0)] == [S.DEAD]
    accepted(hello(m, START + 1, now=TTL + 1.0))
    accepted(m.ready(START + 1, parallel_config_hash="h1", now=TTL + 1.0))
    before = state_of(m)
    refusal = refused(m.revive(START, TTL + 2.0, "heard again"))
    assert refusal.reason is R.CONFIG_HASH_MISMATCH
    assert "it stays dead: restart it with the group's parallel settings" in refusal.message
    assert state_of(m) == before
    assert m.group_config_hash == "h1"


def test_a_revived_rank_pins_its_hash_when_no_live_rank_carries_one() -> None:
    m = make()
    accepted(hello(m, START, now=0.0))
    accepted(m.ready(START, parallel_config_hash="h2", now=0.0))
    m.expire(TTL + 1.0)
    assert isinstance(m.revive(START, TTL + 2.0, "heard again"), RankChanged)
    assert m.group_config_hash == "h2"
    accepted(hello(m, START + 1, now=TTL + 2.0))
    refusal = refused(m.ready(START + 1, parallel_config_hash="h1", now=TTL + 2.0))
    assert refusal.reason is R.CONFIG_HASH_MISMATCH


def test_a_lease_past_its_ttl_but_not_yet_judged_keeps_pinning_the_groups_hash() -> None:
    """Found by the whole-membership model: rank A joined with h1 and fell silent past
    its TTL, but nothing judged it yet (its probe's answer decides); rank B's READY with
    h2 was accepted meanwhile, and then A's probe was answered. Traffic and probes renew
    a lease whatever its age, so A was live again with h1 while the group ran h2."""
    m = make()
    accepted(hello(m, START, now=0.0))
    accepted(m.ready(START, parallel_config_hash="h1", now=0.0))
    m.greeted(START, 0.0)
    late = TTL + 0.5
    accepted(hello(m, START + 1, now=late))
    refusal = refused(m.ready(START + 1, parallel_config_hash="h2", now=late))
    assert refusal.reason is R.CONFIG_HASH_MISMATCH
    assert "the group runs with h1, this engine has h2" in refusal.message
    m.renew(START, late)  # the probe reached A: it was heard just now
    assert m.group_config_hash == "h1"
    assert [(lease.rank, lease.state, lease.parallel_config_hash) for lease in m.leases()] == [
        (START, S.READY, "h1"), (START + 1, S.DEAD, None)]
    # Once A is judged dead, the group may come back with other settings.
    assert [c.new for c in m.expire(2 * TTL + 1.0)] == [S.DEAD]
    accepted(hello(m, START + 1, now=2 * TTL + 1.0))
    accepted(m.ready(START + 1, parallel_config_hash="h2", now=2 * TTL + 1.0))
    assert m.group_config_hash == "h2"
