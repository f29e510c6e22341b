"""Who holds a rank and when it is alive, decided on evidence: the core, event by event.

Connection facts come in as the server reports them (every HELLO, READY and
greeting names the numbered connection it came on; ``PeerConnected`` and
``PeerDisconnected`` say when one opens and closes), probes are answered by
``Driver`` (unreachable when a test says so), and time passes with the timer
ticking at every deadline, except where a test stops the coordinator
(``Driver.stall``).
"""

from __future__ import annotations

import pytest

from coordinator.core.ranks import liveness
from coordinator.core.ranks.claims import GREETING_GRACE_S
from coordinator.core.ranks.membership import RankState
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import rank_to_identity
from tests.unit.core_driver import Driver, frontend_identity

F0 = frontend_identity(0)
TTL = 3.0
HEARD = liveness.heard_within_s(TTL)


def group(engines: int = 2, **config: object) -> Driver:
    """A ready group whose every engine came on its own numbered connections: rank r said
    HELLO and READY on connection 100 + r and greeted from 200 + r, then closed its
    handshake connection as vLLM engines do."""
    settings: dict[str, object] = {"lease_ttl_s": TTL}
    settings.update(config)
    driver = Driver.start(engines=engines, **settings)
    driver.register(0)  # first: every INIT carries its output address
    for rank in range(engines):
        driver.hello(rank, conn=100 + rank)
        driver.greet(rank, conn=200 + rank)
        driver.ready(rank, conn=100 + rank)
        driver.disconnected("handshake", 100 + rank)
    driver.subscribe(engines)
    return driver


def state(driver: Driver, rank: int) -> RankState:
    lease = driver.core.membership.lease(rank)
    assert lease is not None
    return lease.state


def reason(driver: Driver, rank: int) -> str:
    (reply,) = driver.handshake_replies(rank)[-1:]
    assert isinstance(reply, vllm.HandshakeError), reply
    return reply.reason


# ---- a HELLO whose peer vanished -----------------------------------------------------------


def test_a_hello_whose_peer_vanished_frees_the_rank_at_once() -> None:
    driver = Driver.start(engines=2, lease_ttl_s=TTL)
    driver.hello(0, "intruder", conn=7)  # two messages, then gone
    driver.disconnected("handshake", 7)
    driver.hello(0, "engine-a", conn=8, protocol_version=1)
    init = driver.handshake_replies(0)[-1]
    assert isinstance(init, vllm.EngineHandshakeMetadata)
    lease = driver.core.membership.lease(0)
    assert lease is not None and lease.engine_id == "engine-a" and lease.incarnation == 2


def test_a_hello_for_a_rank_whose_holder_is_connected_gets_the_mismatch_and_its_remedy() -> None:
    driver = Driver.start(engines=2, lease_ttl_s=TTL)
    driver.hello(0, "engine-a", conn=7)
    driver.hello(0, "engine-b", conn=8)
    assert reason(driver, 0).startswith(
        "Engine ID mismatch for dp_rank=0: expected engine-a, got engine-b. dp_rank=0 is held "
        "by a live engine (handshaking, incarnation 1, still connected")
    assert "Stop the old engine: its rank is freed as soon as its connections are gone" in (
        reason(driver, 0))
    lease = driver.core.membership.lease(0)
    assert lease is not None and lease.engine_id == "engine-a"


def test_a_stock_hello_never_replaces_a_connected_stock_engine() -> None:
    driver = group()
    driver.hello(1, conn=300)
    assert reason(driver, 1).startswith("dp_rank=1 is held by a live engine (ready")
    assert driver.core.counter_values()["refused.handshake.rank_held"] == 1
    assert state(driver, 1) is RankState.READY and driver.core.membership.dispatchable() == [0, 1]
    # Once its connection is gone (and a probe finds nobody there), the new one takes it.
    driver.disconnected("dispatch", 201)
    driver.unreachable.add(("dispatch", rank_to_identity(1)))
    driver.hello(1, conn=301)
    assert isinstance(driver.handshake_replies(1)[-1], vllm.EngineHandshakeMetadata)
    assert driver.core.membership.lease(1).incarnation == 2  # type: ignore[union-attr]


def test_accepted_goes_only_to_engines_that_wait_for_it() -> None:
    driver = Driver.start(engines=2)
    driver.hello(0, "sdk", conn=1, protocol_version=1)
    driver.hello(1, conn=2)  # vLLM: closes its handshake socket right after READY
    driver.ready(0, conn=1)
    driver.ready(1, conn=2)
    assert isinstance(driver.handshake_replies(0)[-1], vllm.HandshakeAccepted)
    assert [type(r) for r in driver.handshake_replies(1)] == [vllm.EngineHandshakeMetadata]
    assert "send_dropped.handshake.unreachable" not in driver.core.counter_values()


# ---- evidence, not wall time -----------------------------------------------------------------


def test_a_probe_renews_a_lease_only_to_when_the_engine_was_surely_heard() -> None:
    driver = group()
    driver.tick(2.0)  # quiet since 0: probed at the check of 1.5 s, and answered
    lease = driver.core.membership.lease(0)
    assert lease is not None and driver.probes(0) >= 1
    assert lease.last_seen == pytest.approx(1.5 - HEARD)
    driver.tick(30.0)  # idle engines live on their heartbeated connections
    assert driver.core.membership.dispatchable(now=30.0) == [0, 1]


def test_a_closed_dispatch_connection_stops_new_requests_at_once() -> None:
    driver = group()
    driver.disconnected("dispatch", 200)
    for index in range(4):
        reply = driver.submit(f"r{index}")
        assert isinstance(reply, fp.Submitted) and reply.rank == 1
    # Its own engine reconnects (a probe reaches it): back in dispatch, nothing died.
    driver.tick(1.0)
    assert driver.core.membership.dispatchable() == [0, 1]
    assert driver.core.counter_values().get("lease.dead", 0) == 0


def test_a_busy_engine_that_cannot_be_reached_is_kept_out_of_dispatch_not_killed() -> None:
    driver = group()
    reply = driver.submit("r1", rank=0)
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.disconnected("dispatch", 200)
    for at in (0.5, 1.0, 1.4):  # its stats keep arriving: it steps and finishes requests
        driver.now = at
        driver.report(0, wave=0, running=1)
        driver.tick(at + 0.05)
    assert state(driver, 0) is RankState.READY and driver.core.membership.dispatchable() == [1]
    assert isinstance(reply, fp.Submitted) and driver.core.dispatch.requests.count(0) == 1
    driver.unreachable.clear()
    driver.tick(2.0)
    assert driver.core.membership.dispatchable() == [0, 1]


def test_a_stall_longer_than_the_ttl_condemns_nobody() -> None:
    driver = group()
    driver.report(0, start_wave=0)
    first = driver.submit("before-0")
    second = driver.submit("before-1")
    assert isinstance(first, fp.Submitted) and isinstance(second, fp.Submitted)
    driver.tick(1.0)
    driver.stall(21.0)  # SIGSTOP for 20 s, then SIGCONT: one late tick
    counters = driver.core.counter_values()
    assert counters["coordinator.pauses"] == 1
    assert "did not run for 19.8 s" in driver.log_text()
    assert [state(driver, rank) for rank in (0, 1)] == [RankState.READY, RankState.READY]
    # Judged again once the queued traffic is read; probes answer, nobody dies.
    driver.tick(30.0)
    assert driver.core.counter_values().get("lease.dead", 0) == 0
    requests = driver.core.dispatch.requests
    assert requests.count(first.rank) + requests.count(second.rank) == 2
    assert driver.core.waves.table.running


# ---- dead is revisable ---------------------------------------------------------------------


def test_a_dead_rank_that_answers_again_is_revived_and_its_failed_requests_aborted() -> None:
    driver = group()
    driver.report(1, start_wave=0)
    ids = []
    for index in range(3):
        reply = driver.submit(f"r{index}", rank=0)
        assert isinstance(reply, fp.Submitted)
        ids.append(reply.request_id)
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.disconnected("dispatch", 200)
    driver.tick(1.5)  # quiet and unreachable: dead, its requests reported failed
    assert state(driver, 0) is RankState.DEAD
    failed = [r for r in driver.replies(F0) if isinstance(r, fp.RequestsFailed)]
    assert [n.request_ids for n in failed] == [ids]
    # The other engines still run the wave: a death is no pause.
    assert driver.core.waves.table.running
    driver.tick(4.0)
    assert state(driver, 0) is RankState.DEAD  # still unreachable: still dead
    driver.unreachable.clear()  # the partition healed; the engine reconnected
    driver.tick(4.5)
    lease = driver.core.membership.lease(0)
    assert lease is not None and lease.state is RankState.READY and lease.incarnation == 1
    assert driver.core.membership.dispatchable() == [0, 1]
    aborts = [frames for frames in driver.sent_to("dispatch", rank_to_identity(0))
              if frames[0] == vllm.ABORT and vllm.decode_abort(frames[1])]
    assert [vllm.decode_abort(frames[1]) for frames in aborts] == [ids]
    counters = driver.core.counter_values()
    assert counters["lease.revived"] == 1 and counters["lease.dead"] == 1
    assert counters["requests.aborted_on_revival"] == 3
    assert "dead -> ready" in driver.log_text()


def test_a_rank_that_died_handshaking_or_was_replaced_stays_dead() -> None:
    driver = Driver.start(engines=2, lease_ttl_s=TTL, handshake_ttl_s=TTL)
    driver.hello(0, conn=1)
    driver.greet(0, conn=2)
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.tick(2.0)
    assert state(driver, 0) is RankState.DEAD
    driver.unreachable.clear()
    driver.tick(5.0)
    assert state(driver, 0) is RankState.DEAD  # only a new HELLO brings it back
    assert "lease.revived" not in driver.core.counter_values()


def test_a_new_incarnation_forgets_what_its_predecessor_had_failed() -> None:
    driver = group()
    driver.submit("r1", rank=0)
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.disconnected("dispatch", 200)
    driver.tick(1.5)
    driver.hello(0, conn=400)  # a new process: it never had r1
    driver.unreachable.clear()
    driver.greet(0, conn=401)
    driver.ready(0, conn=400)
    driver.tick(5.0)
    assert not [f for f in driver.sent_to("dispatch", rank_to_identity(0))
                if f[0] == vllm.ABORT and vllm.decode_abort(f[1])]


# ---- the rank's identity on dispatch --------------------------------------------------------


def test_a_second_connection_greeting_for_a_rank_is_counted_and_gets_nothing() -> None:
    driver = group()
    driver.greet(0, conn=666)
    counters = driver.core.counter_values()
    assert counters["dispatch.second_claims"] == 1
    assert driver.core.membership.dispatchable() == [1]
    assert [driver.submit(f"r{i}").rank for i in range(3)] == [1, 1, 1]  # type: ignore[union-attr]
    assert "a second connection greeted on dispatch" in driver.log_text()
    driver.disconnected("dispatch", 666)  # the claimant left; the engine answers again
    driver.tick(1.0)
    assert driver.core.membership.dispatchable() == [0, 1]


def test_a_dispatch_connection_that_never_greets_is_counted_and_logged_once() -> None:
    driver = group()
    driver.connected("dispatch", 900, "127.0.0.1:5555")
    driver.connected("dispatch", 901)
    driver.greet(1, conn=901)  # greeted: not silent (and a second claim on its own)
    driver.tick(GREETING_GRACE_S + 1.0)
    assert driver.core.counter_values()["dispatch.silent_connections"] == 1
    text = driver.log_text()
    assert "a connection on dispatch from 127.0.0.1:5555 has not greeted" in text
    driver.tick(GREETING_GRACE_S + 10.0)
    assert driver.core.counter_values()["dispatch.silent_connections"] == 1


def test_an_add_that_finds_nobody_keeps_the_rank_out_until_a_probe_reaches_it() -> None:
    driver = group()
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    replies = [driver.submit(f"r{i}") for i in range(3)]
    assert [r.rank for r in replies] == [1, 1, 1]  # type: ignore[union-attr]
    assert driver.core.counter_values()["send_dropped.dispatch.unreachable"] == 1
    driver.unreachable.clear()
    driver.tick(1.0)
    assert driver.core.membership.dispatchable() == [0, 1]


# ---- what arrived on the connection -------------------------------------------------------


def test_an_open_connection_that_carries_nothing_is_no_evidence_of_life() -> None:
    """A host cut off keeps its tcp connection open; the kernel says nothing arrives."""
    driver = group()
    identity = rank_to_identity(0)
    driver.last_heard[("dispatch", identity)] = 1.0  # the partition: nothing after 1 s
    driver.tick(1.0 + HEARD + 1.0)
    lease = driver.core.membership.lease(0)
    assert lease is not None and lease.last_seen <= 1.0 + 1e-9  # never renewed past it
    assert driver.core.membership.dispatchable() == [1]  # silent: no new requests
    driver.tick(1.0 + TTL + 1.0)
    assert state(driver, 0) is RankState.DEAD and state(driver, 1) is RankState.READY
    assert "lease expired (last seen" in driver.log_text()
    # Still silent: not revived. Heard again (the partition healed): revived.
    driver.tick(1.0 + TTL + 2.0)
    assert state(driver, 0) is RankState.DEAD
    driver.last_heard[("dispatch", identity)] = 1.0 + TTL + 2.5
    driver.tick(1.0 + TTL + 3.0)
    assert state(driver, 0) is RankState.READY and driver.core.membership.dispatchable() == [0, 1]


def test_a_hello_takes_over_from_a_silent_holder_and_cuts_its_connection() -> None:
    driver = group()
    driver.last_heard[("dispatch", rank_to_identity(1))] = -10.0  # crashed, still open
    driver.hello(1, "engine-b", conn=301, protocol_version=1)
    assert isinstance(driver.handshake_replies(1)[-1], vllm.EngineHandshakeMetadata)
    assert driver.cut == [("dispatch", 201)]  # so its successor can connect there
    # A heard holder keeps its rank.
    driver.hello(0, "engine-c", conn=302, protocol_version=1)
    assert reason(driver, 0).startswith("Engine ID mismatch for dp_rank=0: expected None")
    assert driver.cut == [("dispatch", 201)]
