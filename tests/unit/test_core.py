"""The composed core, event by event: every rule the server used to hold, and the glue.

Each test feeds ``CoordinatorCore`` the events the server would (through
``Driver``, which plays the server's side without sockets) and checks the
frames, replies and state that follow.
"""

from __future__ import annotations

import logging

import msgspec
import pytest

from coordinator.core.actions import NO_ACTIONS, REARM_TIMER, DispatchAdd
from coordinator.core.events import (
    DUMP_RECORDER,
    ENGINE_UNSUBSCRIBED,
    FRONTEND_UNSUBSCRIBED,
    BadFrame,
    FrontendRequestReceived,
    GracefulStop,
    HandshakeReceived,
    Restore,
    ServerCounters,
    Shutdown,
    StateSaveFailed,
)
from coordinator.core.ranks.membership import RankState
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.errors import IdentityError, ProtocolError
from coordinator.protocol.identity import rank_to_identity
from tests.unit.core_driver import ADDRESSES, PARALLEL, Driver, frontend_identity

F0, F1 = frontend_identity(0), frontend_identity(1)


def group(engines: int = 2, **config: object) -> Driver:
    """A group whose gate opened, with frontend 0 registered first (so that every INIT
    carries its output address)."""
    driver = Driver.start(engines=engines, **config)
    driver.register(0)
    driver.start_group(range(engines))
    return driver


def error_code(reply: fp.FrontendReply) -> str:
    assert isinstance(reply, fp.ErrorReply), reply
    return reply.code


# ---- submit admission ----------------------------------------------------------------------


def test_a_submit_goes_to_a_ready_rank_and_is_answered_once() -> None:
    driver = group()
    reply = driver.submit("r1")
    assert isinstance(reply, fp.Submitted) and reply.request_id == "r1"
    assert driver.adds(reply.rank) == [[b"payload:r1"]]
    assert driver.replies(F0).count(reply) == 1
    assert driver.core.dispatch.requests.count(reply.rank) == 1


def test_max_in_flight_refuses_until_a_request_finishes() -> None:
    driver = group(max_in_flight=2)
    driver.submit("a")
    driver.submit("b")
    refused = driver.submit("c")
    assert error_code(refused) == fp.ERR_TOO_MANY_IN_FLIGHT
    assert isinstance(refused, fp.ErrorReply) and refused.request_id == "c"
    assert refused.message == ("2 requests in flight (frontends must send 'finished' for "
                               "completed requests)")
    assert len(driver.core.dispatch.requests) == 2
    driver.request(F0, fp.Finished(["a"]))
    assert isinstance(driver.submit("c"), fp.Submitted)
    assert driver.core.counter_values()["submit.refused.too_many_in_flight"] == 1


def test_duplicate_request_id_is_refused_and_the_first_stays_where_it_went() -> None:
    driver = group()
    first = driver.submit("same")
    assert isinstance(first, fp.Submitted)
    again = driver.submit("same", frontend=0)
    assert error_code(again) == fp.ERR_DUPLICATE_REQUEST
    assert sum(len(driver.adds(rank)) for rank in (0, 1)) == 1
    entry = driver.core.dispatch.requests.get("same")
    assert entry is not None and entry.rank == first.rank


def test_shutting_down_refuses_submits_and_says_goodbye() -> None:
    driver = group()
    driver.register(1)
    driver.feed(Shutdown("stopping"))
    for identity in (F0, F1):
        assert fp.ShuttingDown("stopping") in driver.replies(identity)
    # ADDs already acknowledged `submitted` get a bounded grace to reach their engine.
    assert driver.lingers == {"frontend": 500, "front_publish": 500, "dispatch": 3000}
    assert driver.front_publishes()[-1].counts is not None  # a last full publish
    assert error_code(driver.submit("late")) == fp.ERR_SHUTTING_DOWN
    before = len(driver.sends)
    driver.feed(Shutdown("again"))  # only once
    assert len(driver.sends) == before


def test_a_graceful_stop_closes_admission_and_lets_requests_finish() -> None:
    driver = group()
    first = driver.submit("before")
    assert isinstance(first, fp.Submitted)
    driver.feed(GracefulStop("maintenance"))
    late = driver.submit("late")
    assert isinstance(late, fp.ErrorReply) and late.code == fp.ERR_SHUTTING_DOWN
    assert "graceful stop" in late.message and late.request_id == "late"
    assert driver.adds(0) + driver.adds(1) == [[b"payload:before"]]
    assert driver.core.group_state(driver.now).shutting_down
    # What is in flight still finishes, and frontends are not told goodbye yet.
    assert driver.core.requests_in_flight() == 1
    driver.request(F0, fp.Finished(["before"]))
    assert driver.core.requests_in_flight() == 0
    assert not any(isinstance(r, fp.ShuttingDown) for r in driver.replies(F0))
    counters = driver.core.counter_values()
    assert counters["shutdown.graceful"] == 1 and counters["submit.refused.shutting_down"] == 1
    (logged,) = [log for log in driver.logs if log.event == "graceful_stop"]
    assert logged.fields == {"reason": "maintenance", "in_flight": 1}
    driver.feed(GracefulStop("again"))  # once
    assert driver.core.counter_values()["shutdown.graceful"] == 1
    # The shutdown that follows still says goodbye.
    driver.feed(Shutdown("stopping"))
    assert fp.ShuttingDown("stopping") in driver.replies(F0)


@pytest.mark.parametrize(("command", "graceful"), [("stop", False), ("graceful_stop", True)])
def test_an_operators_stop_asks_the_server_to_stop(command: fp.AdminCommand,
                                                   graceful: bool) -> None:
    driver = group()
    (done,) = driver.operator(fp.Admin(driver.call_id(), command, 0))
    assert isinstance(done, fp.AdminDone) and done.state == "stopping"
    assert [stop.graceful for stop in driver.stops] == [graceful]
    assert driver.lingers["admin"] == 500  # the answer outlives the close
    # A graceful stop closes admission at once; a plain one leaves that to the shutdown.
    reply = driver.submit("next")
    if graceful:
        assert error_code(reply) == fp.ERR_SHUTTING_DOWN
    else:
        assert isinstance(reply, fp.Submitted)
    assert driver.core.dispatch.stopping is graceful


def test_a_frontend_that_is_not_an_operator_cannot_stop_the_coordinator() -> None:
    driver = group()
    (reply,) = driver.request(F0, fp.Admin(driver.call_id(), "graceful_stop", 0))
    assert error_code(reply) == fp.ERR_NOT_AUTHORIZED
    assert driver.stops == [] and not driver.core.dispatch.stopping


@pytest.mark.parametrize(
    ("rank", "code", "text"),
    [
        (7, fp.ERR_UNKNOWN_RANK, "dp_rank=7 is outside 0..2"),
        (2, fp.ERR_RANK_NOT_READY, "dp_rank=2 cannot take requests (not registered)"),
        (1, fp.ERR_RANK_NOT_READY, "dp_rank=1 cannot take requests (cordoned)"),
    ],
)
def test_explicit_dp_rank_refusals(rank: int, code: str, text: str) -> None:
    driver = Driver.start(engines=3)
    driver.join(0)
    driver.join(1)  # rank 2 never registers
    driver.subscribe(3)
    driver.register(0)
    driver.operator(fp.Admin(driver.call_id(), "cordon", 1))
    reply = driver.submit("r", rank=rank)
    assert isinstance(reply, fp.ErrorReply)
    assert (reply.code, reply.message) == (code, text)
    assert driver.adds(rank) == [] and len(driver.core.dispatch.requests) == 0


def test_explicit_dp_rank_that_is_unreachable_is_refused_not_moved() -> None:
    driver = group()
    driver.unreachable.add(("dispatch", rank_to_identity(1)))
    reply = driver.submit("r", rank=1)
    assert isinstance(reply, fp.ErrorReply)
    assert (reply.code, reply.message) == (fp.ERR_ENGINE_UNREACHABLE,
                                           "dp_rank=1 is not connected on dispatch")
    assert driver.adds(0) == [] and len(driver.core.dispatch.requests) == 0
    assert "could not send on dispatch" in driver.log_text()
    # Identities are bytes a peer chose: logged as hex, not as a bytes repr.
    assert f"to {rank_to_identity(1).hex()} (peer gone" in driver.log_text()


def test_a_failed_dispatch_goes_to_the_next_best_rank_and_leaves_no_trace() -> None:
    driver = group(engines=3)
    driver.report(0, wave=0, waiting=5)
    driver.report(2, wave=0, waiting=9)
    driver.unreachable.add(("dispatch", rank_to_identity(1)))  # the least loaded
    reply = driver.submit("r")
    assert isinstance(reply, fp.Submitted) and reply.rank == 0
    assert [len(driver.adds(rank)) for rank in range(3)] == [1, 0, 0]
    core = driver.core
    assert core.dispatch.requests.per_rank() == {0: 1}
    assert core.dispatch.dispatched_by_rank[1] == 0
    assert core.loads.load(1).dispatched_since_report == 0
    assert core.counter_values()["submit.dispatched"] == 1
    assert core.counter_values()["send_dropped.dispatch.unreachable"] == 1


def test_all_ranks_unreachable_is_refused_with_what_was_tried_and_the_wake_still_goes() -> None:
    driver = group()
    for rank in (0, 1):
        driver.unreachable.add(("dispatch", rank_to_identity(rank)))
    reply = driver.submit("r")
    assert isinstance(reply, fp.ErrorReply) and reply.code == fp.ERR_ENGINE_UNREACHABLE
    assert reply.message.startswith("no ready engine is connected on dispatch (tried dp_rank [")
    assert len(driver.core.dispatch.requests) == 0
    # The wave machine counted the wake as sent: it is sent, not lost.
    assert driver.wakes() == [(0, None)]


def test_no_dispatchable_rank() -> None:
    driver = Driver.start(engines=2)
    driver.register(0)
    assert error_code(driver.submit("r")) == fp.ERR_NO_READY_ENGINE
    assert driver.wakes() == []


def test_the_first_request_of_a_paused_wave_wakes_everyone_after_its_add() -> None:
    driver = group()
    first = driver.submit("r1", wave=0)
    assert isinstance(first, fp.Submitted) and first.woke
    assert driver.wakes() == [(0, None)]
    # ADD first, then the wake: the chosen engine holds its request before peers step.
    kinds = [("add" if s == "dispatch" else "reply") for s, _, _ in driver.sends[-2:]]
    assert kinds == ["add", "reply"]
    second = driver.submit("r2", wave=0)
    assert isinstance(second, fp.Submitted) and not second.woke
    assert driver.wakes() == [(0, None)]


def test_the_wake_rides_on_the_add_and_follows_a_retry() -> None:
    driver = group()
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.report(1, wave=0, waiting=3)  # rank 0 is picked first
    direct = driver.core.handle(FrontendRequestReceived(F0, fp.Submit(99, "r", 0), [b"p"]),
                                driver.now)
    (add,) = [a for a in direct if isinstance(a, DispatchAdd)]
    assert add.rank == 0 and add.wake  # nothing published yet: it waits for the ADD
    driver.execute(direct)
    assert driver.adds(1) == [[b"p"]] and driver.wakes() == [(0, None)]
    reply = driver.replies(F0)[-1]
    assert isinstance(reply, fp.Submitted) and reply.rank == 1 and reply.woke


# ---- frontends -----------------------------------------------------------------------------


def test_max_frontends_refuses_new_indices_but_not_known_ones() -> None:
    driver = Driver.start(engines=1, max_frontends=2)
    driver.register(0)
    driver.register(1)
    refused = driver.register(2)
    assert isinstance(refused, fp.ErrorReply)
    assert (refused.code, refused.message) == (
        fp.ERR_BAD_CLIENT_INDEX, "client_index 2 is outside 0..1 (at most 2 frontends)")
    assert isinstance(driver.register(1), fp.Registered)
    assert len(driver.core.frontends.registry) == 2


def test_client_index_beyond_expected_frontends_is_refused() -> None:
    driver = Driver.start(engines=1, frontends=2)
    refused = driver.register(2)
    assert isinstance(refused, fp.ErrorReply) and "--frontends 2" in refused.message


def test_init_is_held_until_k_frontends_registered() -> None:
    driver = Driver.start(engines=2, frontends=2)
    driver.hello(0)
    driver.hello(1)
    assert driver.handshake_replies(0) == [] and driver.handshake_replies(1) == []
    assert "INIT waits until 2 frontends registered (0 so far)" in driver.log_text()
    driver.register(0)
    assert driver.handshake_replies(0) == []
    driver.register(1, output="ipc:///run/second")
    for rank in (0, 1):
        (init,) = driver.handshake_replies(rank)
        assert isinstance(init, vllm.EngineHandshakeMetadata)
        assert init.addresses.outputs == ["ipc:///run/out-0", "ipc:///run/second"]
        assert init.addresses.inputs == [ADDRESSES["dispatch"]]
        assert init.addresses.coordinator_input == ADDRESSES["back_publish"]
        assert init.parallel_config == PARALLEL
    # Later HELLOs get their INIT at once.
    driver.hello(0)
    assert len(driver.handshake_replies(0)) == 2


def test_without_expected_frontends_init_goes_at_once() -> None:
    driver = Driver.start(engines=1)
    driver.hello(0, engine_id="e0")
    (init,) = driver.handshake_replies(0)
    assert isinstance(init, vllm.EngineHandshakeMetadata) and init.addresses.outputs == []
    assert driver.core.frontends.registry.inits_sent


def test_output_address_is_pinned_once_inits_went_out() -> None:
    driver = Driver.start(engines=1)
    driver.register(0, output="ipc:///run/a")
    assert isinstance(driver.register(0, output="ipc:///run/b"), fp.Registered)  # no INIT yet
    driver.hello(0)
    refused = driver.register(0, output="ipc:///run/c")
    assert isinstance(refused, fp.ErrorReply) and refused.code == fp.ERR_BAD_CLIENT_INDEX
    assert "registered with outputs at ipc:///run/b, which engines already use" in refused.message
    peer = driver.core.frontends.registry.get(0)
    assert peer is not None and peer.output_address == "ipc:///run/b"


def test_an_init_that_could_not_be_sent_pins_nothing() -> None:
    driver = Driver.start(engines=1)
    driver.unreachable.add(("handshake", rank_to_identity(0)))
    driver.register(0, output="ipc:///run/a")
    driver.hello(0)
    assert not driver.core.frontends.registry.inits_sent
    assert isinstance(driver.register(0, output="ipc:///run/b"), fp.Registered)


def test_a_frontend_that_reconnects_gets_its_requests_failure_notices() -> None:
    driver = group(lease_ttl_s=3.0)
    reply = driver.submit("r1")
    assert isinstance(reply, fp.Submitted)
    new = b"\x00fe-new"
    assert isinstance(driver.register(0, identity=new), fp.Registered)
    assert "1 in-flight requests now report to it" in driver.log_text()
    driver.unreachable.add(("dispatch", rank_to_identity(reply.rank)))
    driver.tick(1.5)  # the quiet engine's probe fails: it is gone
    failed = [r for r in driver.replies(new) if isinstance(r, fp.RequestsFailed)]
    assert failed and failed[0].request_ids == ["r1"]
    assert not [r for r in driver.replies(F0) if isinstance(r, fp.RequestsFailed)]


def test_registered_reply_carries_the_group() -> None:
    driver = Driver.start(engines=3, rank_start=2, lockstep=False)
    reply = driver.register(0)
    assert reply == fp.Registered(reply.call_id, 0, 2, 3, 0, False, False)  # type: ignore[union-attr]


# ---- outputs only where an INIT said so ----------------------------------------------------


def test_a_frontend_that_no_init_carried_gets_no_requests_and_hears_why() -> None:
    driver = Driver.start(engines=2)  # no --frontends: INITs go out with no frontend
    driver.start_group([0, 1])
    assert isinstance(driver.register(0), fp.Registered)
    assert "registered after dp_ranks 0, 1 got their INITs" in driver.log_text()
    reply = driver.submit("lost")
    assert error_code(reply) == fp.ERR_UNDELIVERABLE
    assert isinstance(reply, fp.ErrorReply) and "--frontends N" in reply.message
    assert driver.adds(0) == [] and driver.adds(1) == [] and not driver.core.dispatch.requests
    counters = driver.core.counter_values()
    assert counters["submit.refused.undeliverable"] == 1 and counters["frontend.undeliverable"] == 1
    assert "refused submits from frontend" in driver.log_text()


def test_a_rank_whose_new_init_carries_the_frontend_serves_it_alone() -> None:
    driver = Driver.start(engines=2, lockstep=False)
    driver.start_group([0, 1])
    driver.register(0)

    def restart(rank: int) -> None:
        """The rank's engine dies and a new one takes it: its INIT lists frontend 0."""
        identity = rank_to_identity(rank)
        driver.unreachable.add(("dispatch", identity))
        driver.tick(driver.now + 3 * driver.core.config.lease_ttl_s)
        assert driver.core.membership.lease(rank).state is RankState.DEAD  # type: ignore[union-attr]
        driver.unreachable.discard(("dispatch", identity))
        driver.hello(rank, f"e{rank}-restarted")
        driver.ready(rank)
        driver.greet(rank)

    restart(1)
    for i in range(4):
        reply = driver.submit(f"r{i}")
        assert isinstance(reply, fp.Submitted) and reply.rank == 1
    assert error_code(driver.submit("x", rank=0)) == fp.ERR_UNDELIVERABLE
    # Once rank 0's engine also got an INIT that names it, both serve it.
    restart(0)
    assert driver.core.frontends.registry.undeliverable_indices() == {}
    assert isinstance(driver.submit("y", rank=0), fp.Submitted)


def test_a_frontend_registered_before_the_inits_is_served_everywhere() -> None:
    driver = group()
    assert driver.core.frontends.registry.undeliverable_indices() == {}
    ranks = {driver.submit(f"r{i}").rank for i in range(6)}  # type: ignore[union-attr]
    assert ranks == {0, 1}
    assert "frontend.undeliverable" not in driver.core.counter_values()


# ---- dead ranks, drains, aborts ------------------------------------------------------------


def test_a_dead_ranks_requests_fail_to_the_frontend_that_sent_each() -> None:
    driver = Driver.start(engines=1)
    driver.register(0)
    driver.register(1)
    driver.start_group([0])
    driver.submit("a", frontend=0)
    driver.submit("b", frontend=1)
    driver.submit("c", frontend=0)
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.tick(driver.core.config.lease_ttl_s)  # quiet: probed, and the probe fails
    notices0 = [r for r in driver.replies(F0) if isinstance(r, fp.RequestsFailed)]
    notices1 = [r for r in driver.replies(F1) if isinstance(r, fp.RequestsFailed)]
    assert [n.request_ids for n in notices0] == [["a", "c"]]
    assert [n.request_ids for n in notices1] == [["b"]]
    assert notices0[0].rank == 0 and notices0[0].reason.startswith("engine disconnected")
    assert driver.core.membership.lease(0).state is RankState.DEAD  # type: ignore[union-attr]
    assert len(driver.core.dispatch.requests) == 0
    counters = driver.core.counter_values()
    assert counters["requests.failed"] == 3 and counters["lease.dead"] == 1


def test_drain_notice_comes_when_the_last_request_finishes() -> None:
    driver = group(engines=2)
    driver.register(1)
    first = driver.submit("a")
    assert isinstance(first, fp.Submitted)
    rank = first.rank
    (done,) = driver.operator(fp.Admin(driver.call_id(), "drain", rank))
    assert isinstance(done, fp.AdminDone) and done.state == "draining"
    assert fp.RankDrained(rank) not in driver.replies(F1)
    assert driver.submit("b", rank=rank).code == fp.ERR_RANK_NOT_READY  # type: ignore[union-attr]
    driver.request(F0, fp.Finished(["a"]))
    assert fp.RankDrained(rank) in driver.replies(F0)
    assert fp.RankDrained(rank) in driver.replies(F1)


def test_draining_an_idle_rank_is_announced_at_once() -> None:
    driver = group()
    driver.operator(fp.Admin(driver.call_id(), "drain", 1))
    assert fp.RankDrained(1) in driver.replies(F0)


def test_refused_admin_command_changes_nothing() -> None:
    driver = group()
    (reply,) = driver.operator(fp.Admin(driver.call_id(), "uncordon", 0))
    assert isinstance(reply, fp.ErrorReply) and reply.code == fp.ERR_ADMIN_REFUSED
    assert driver.core.membership.dispatchable() == [0, 1]


def test_abort_goes_to_the_engine_holding_each_request() -> None:
    driver = group()
    a = driver.submit("a", rank=0)
    b = driver.submit("b", rank=1)
    assert isinstance(a, fp.Submitted) and isinstance(b, fp.Submitted)
    (reply,) = driver.request(F0, fp.Abort(driver.call_id(), ["a", "b", "unknown"]))
    assert isinstance(reply, fp.Aborted) and sorted(reply.request_ids) == ["a", "b"]
    for rank, rid in ((0, "a"), (1, "b")):
        aborts = [f for f in driver.sent_to("dispatch", rank_to_identity(rank))
                  if f[0] == vllm.ABORT]
        assert [vllm.decode_abort(f[1]) for f in aborts] == [[rid]]
    assert len(driver.core.dispatch.requests) == 0


def test_state_query_reply() -> None:
    driver = group()
    driver.submit("a", rank=1)
    (reply,) = driver.request(F0, fp.QueryState(driver.call_id()))
    assert isinstance(reply, fp.StateReply)
    state = reply.state
    assert (state.rank_count, state.frontends, state.in_flight) == (2, 1, 1)
    assert [e.state for e in state.engines] == ["ready", "ready"]
    assert state.engines[1].in_flight == 1 and state.counters["submit.dispatched"] == 1


# ---- the start-up gate and the held wake ---------------------------------------------------


def test_a_wake_decided_before_the_gate_opens_goes_out_right_after_ready() -> None:
    driver = Driver.start(engines=2)
    driver.register(0)
    driver.join(0)
    driver.join(1)
    reply = driver.submit("early", wave=0)
    assert isinstance(reply, fp.Submitted) and reply.woke
    assert driver.back_publish() == []  # nothing but READY may come first
    assert driver.core.counter_values()["waves.start_held_for_gate"] == 1
    driver.subscribe()
    assert driver.back_publish() == []
    driver.subscribe()
    assert driver.back_publish() == ["READY", (0, None)]
    driver.subscribe()  # a late engine gets its own READY, and no wake
    assert driver.back_publish() == ["READY", (0, None), "READY"]


def test_the_gate_starts_full_publishes() -> None:
    driver = Driver.start(engines=1, first_publish_delay_s=0.05)
    driver.join(0)
    assert driver.core.next_deadline() == pytest.approx(0.25)  # lease and observe timers only
    driver.tick(0.1)
    assert driver.front_publishes() == []
    driver.subscribe()
    assert driver.rearms >= 1
    assert driver.core.next_deadline() == pytest.approx(0.15)
    driver.tick(driver.core.next_deadline())
    (publish,) = driver.front_publishes()
    assert publish.counts == [(0, 0, 0.0)] and publish.wave == 0


# ---- engine reports and publishing ---------------------------------------------------------


def test_an_unchanged_stats_stream_costs_no_actions() -> None:
    driver = group()
    driver.tick(1.0)  # publishes what changed so far
    assert list(driver.report(0, wave=0, step=1)) == [REARM_TIMER]  # the table changed
    assert driver.report(0, wave=0, step=2) is NO_ACTIONS
    assert driver.report(1, wave=0, step=2) is NO_ACTIONS
    assert driver.core.counter_values()["stats.reports"] == 3


def test_stats_publish_within_the_interval_and_heartbeat_when_idle() -> None:
    driver = group(publish_interval_s=0.1, heartbeat_s=5.0)
    driver.tick(0.3)
    count = len(driver.front_publishes())
    driver.report(1, wave=0, step=1, waiting=4, running=2, kv=0.5)
    assert driver.core.next_deadline() <= 0.4 + 1e-9
    driver.tick(0.4)
    latest = driver.front_publishes()[-1]
    assert latest.counts == [(0, 0, 0.0), (4, 2, 0.5)]
    assert len(driver.front_publishes()) == count + 1
    driver.tick(2.0)
    assert len(driver.front_publishes()) == count + 1  # nothing changed: no publish yet
    driver.tick(5.4)
    assert len(driver.front_publishes()) == count + 2  # the heartbeat


def test_a_new_frontend_subscriber_gets_a_full_publish_soon() -> None:
    driver = group()
    driver.tick(0.3)
    count = len(driver.front_publishes())
    driver.subscribe_frontend()
    driver.tick(0.45)
    assert len(driver.front_publishes()) == count + 1
    assert driver.core.counter_values()["front.subscriptions"] == 1


def test_reports_out_of_range_are_dropped_and_counted() -> None:
    driver = group()
    driver.report(5, wave=3)
    assert driver.core.counter_values()["dropped.back_output.rank_out_of_range"] == 1
    assert driver.core.waves.table.current_wave == 0


def test_a_stale_report_is_counted_and_still_applied() -> None:
    driver = group()
    driver.report(0, wave=1, step=5, waiting=1)
    driver.report(0, wave=1, step=2, waiting=7)
    assert driver.core.counter_values()["stats.stale"] == 1
    assert driver.core.loads.load(0).waiting == 7


def test_wave_reports_relay_and_publish() -> None:
    driver = group()
    driver.report(1, start_wave=0)
    assert driver.wakes() == [(0, 1)]  # relayed, excluding the sender
    assert driver.core.waves.snapshot() == (0, True)
    driver.report(0, wave_complete=0)
    assert driver.core.waves.snapshot() == (1, False)
    assert [(p.wave, p.running) for p in driver.front_publishes() if p.counts is None] == [
        (0, True), (1, False)]


def test_a_pre_033_frontend_wake_is_honoured_by_default_with_3_wide_rows() -> None:
    """vLLM 0.29-0.32: the engine given a current-wave request sends no start_wave, so
    the frontend's [identity, wave] is what wakes its lockstep peers (issue 19)."""
    driver = group(engines=3)
    driver.report(0, start_wave=0)
    driver.report(0, wave_complete=0)  # paused at wave 1
    driver.publishes.clear()
    driver.feed(vllm.LegacyFirstRequest(2, 1, by_identity=True))
    assert driver.wakes() == [(1, None)]  # every rank, the chosen one included
    assert driver.core.waves.snapshot() == (1, False)  # running waits for an engine
    # Concurrent first requests of the same wave cost no second wake.
    driver.feed(vllm.LegacyFirstRequest(0, 1, by_identity=True))
    driver.feed(vllm.LegacyFirstRequest(1, 1))
    assert driver.wakes() == [(1, None)]
    counters = driver.core.counter_values()
    assert counters["legacy.first_requests"] == 3
    assert "dropped.front_publish.legacy_first_request" not in counters
    # Logged once per form, naming which frontend sent it.
    text = driver.log_text()
    assert text.count("vLLM 0.29-0.32 frontend") == 1
    assert text.count("older than vLLM 0.29") == 1
    assert "--vllm-compat legacy" not in text
    driver.tick(1.0)
    rows, wave, running = msgspec.msgpack.decode(
        [f for s, f in driver.publishes if s == "front_publish"][-1][0])
    assert all(len(row) == 3 for row in rows) and (wave, running) == (1, False)


def test_a_pre_033_frontend_wake_in_a_dense_group_wakes_nothing() -> None:
    driver = group(lockstep=False)
    driver.feed(vllm.LegacyFirstRequest(1, 0, by_identity=True))
    assert driver.wakes() == []
    assert "dropped.front_publish.legacy_first_request" not in driver.core.counter_values()


def test_frontend_wake_false_drops_it_and_names_no_row_width_fix() -> None:
    driver = group(frontend_wake=False)
    driver.feed(vllm.LegacyFirstRequest(0, 0))
    assert driver.wakes() == []
    assert driver.core.counter_values()["dropped.front_publish.legacy_first_request"] == 1
    assert "--vllm-compat legacy" not in driver.log_text()
    assert "--frontend-wake" in driver.log_text()


def test_two_wide_rows_are_a_separate_choice_from_the_wake() -> None:
    legacy = group(row_width=2)
    legacy.feed(vllm.LegacyFirstRequest(9, 0))
    assert legacy.core.counter_values()["dropped.front_publish.rank_out_of_range"] == 1
    legacy.feed(vllm.LegacyFirstRequest(1, 0))
    assert legacy.wakes() == [(0, None)]
    legacy.tick(1.0)
    full = [frames for socket, frames in legacy.publishes if socket == "front_publish"]
    # 2-wide rows for older frontends.
    rows, wave, running = msgspec.msgpack.decode(full[-1][0])
    assert rows == [[0, 0], [0, 0]] and (wave, running) == (0, False)
    quiet = group(row_width=2, frontend_wake=False)
    quiet.feed(vllm.LegacyFirstRequest(1, 0))
    assert quiet.wakes() == []


def test_each_ranks_vllm_version_is_shown_and_a_disagreement_logged_once() -> None:
    from coordinator.core.events import EngineGreeted

    driver = group(engines=3)
    driver.feed(EngineGreeted(0, vllm_version="0.33.0"))
    driver.feed(EngineGreeted(1, vllm_version="0.33.0"))
    assert "different vLLM versions" not in driver.log_text()
    driver.feed(EngineGreeted(2, vllm_version="0.32.0"))
    driver.feed(EngineGreeted(2, vllm_version="0.31.0"))
    state = driver.core.group_state(driver.now)
    assert [e.vllm_version for e in state.engines] == ["0.33.0", "0.33.0", "0.31.0"]
    text = driver.log_text()
    assert text.count("different vLLM versions") == 1
    assert "0.33.0 on dp_rank 0, 1; 0.32.0 on dp_rank 2" in text
    # A rank that never named one shows none (nil, the tenth element on the wire).
    quiet = group()
    state = quiet.core.group_state(quiet.now)
    assert [e.vllm_version for e in state.engines] == [None, None]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(state.engines[0]))[9] is None


def test_a_version_outside_the_range_is_warned_once_and_still_used() -> None:
    from coordinator.core.events import EngineGreeted

    driver = group(engines=2)
    driver.feed(EngineGreeted(0, vllm_version="0.28.1"))
    driver.feed(EngineGreeted(0, vllm_version="0.28.1"))
    driver.feed(EngineGreeted(1, vllm_version="0.28.1"))
    assert driver.log_text().count("outside the supported range") == 1
    assert driver.core.membership.state(0) is RankState.READY
    reply = driver.submit("r1", rank=0)
    assert isinstance(reply, fp.Submitted)
    assert "refused.dispatch.vllm_version" not in driver.core.counter_values()


def test_with_require_supported_vllm_an_old_rank_is_cordoned_once_per_incarnation() -> None:
    from coordinator.core.events import EngineGreeted

    driver = group(engines=2, require_supported_vllm=True)
    driver.feed(EngineGreeted(0, vllm_version="0.33.0"))
    driver.feed(EngineGreeted(1, vllm_version="0.28.1"))
    core = driver.core
    assert core.membership.state(0) is RankState.READY
    assert core.membership.state(1) is RankState.CORDONED
    assert core.counter_values()["refused.dispatch.vllm_version"] == 1
    text = driver.log_text()
    assert "dp_rank=1 runs vLLM '0.28.1'" in text and "uncordon 1" in text
    for n in range(4):
        reply = driver.submit(f"r{n}")
        assert isinstance(reply, fp.Submitted) and reply.rank == 0
    assert error_code(driver.submit("pinned", rank=1)) != ""
    # The operator's uncordon of that incarnation stands, even when it greets again.
    driver.operator(fp.Admin(driver.call_id(), "uncordon", 1))
    driver.feed(EngineGreeted(1, vllm_version="0.28.1"))
    assert core.membership.state(1) is RankState.READY
    assert core.counter_values()["refused.dispatch.vllm_version"] == 1


def test_a_version_named_before_ready_is_refused_when_the_rank_becomes_ready() -> None:
    from coordinator.core.events import EngineGreeted

    driver = Driver.start(engines=2, require_supported_vllm=True)
    driver.feed(EngineGreeted(1, vllm_version="0.34.0.dev3"))
    driver.start_group(range(2))
    assert driver.core.membership.state(1) is RankState.CORDONED
    assert driver.core.membership.state(0) is RankState.READY
    assert "pre-release or development build" in driver.log_text()


# ---- elastic resize ------------------------------------------------------------------------


def test_resize_shrinks_and_grows_the_group_without_touching_the_settings() -> None:
    driver = group(engines=3, min_engines=1, max_engines=4)
    driver.submit("on-2", rank=2)
    driver.feed(vllm.ScaleElasticEP(2))
    core = driver.core
    assert core.rank_range == range(0, 2) and core.config.engines == 3
    assert core.membership.lease(2) is None and core.loads.size == 2
    failed = [r for r in driver.replies(F0) if isinstance(r, fp.RequestsFailed)]
    assert failed and failed[0].request_ids == ["on-2"]
    assert core.waves.gate.expected == 2
    registered = driver.register(1)
    assert isinstance(registered, fp.Registered) and registered.rank_count == 2
    driver.feed(vllm.ScaleElasticEP(4))
    assert core.rank_range == range(0, 4) and core.loads.size == 4
    driver.tick(1.0)
    assert len(driver.front_publishes()[-1].counts) == 4


def test_a_resize_that_leaves_no_rank_is_dropped() -> None:
    driver = group(engines=2, rank_start=2)
    driver.feed(vllm.ScaleElasticEP(2))
    assert driver.core.rank_range == range(2, 4)
    assert driver.core.counter_values()["dropped.front_publish.bad_value"] == 1


# ---- handshakes ----------------------------------------------------------------------------


def test_a_second_engine_id_for_a_live_rank_probes_the_holder_first() -> None:
    driver = group()
    driver.hello(1, engine_id="intruder")
    assert driver.probes(1) == 1
    (refusal,) = [r for r in driver.handshake_replies(1) if isinstance(r, vllm.HandshakeError)]
    assert refusal.reason.startswith("Engine ID mismatch for dp_rank=1")
    assert driver.core.counter_values()["refused.handshake.engine_id_mismatch"] == 1


def test_a_holder_whose_connection_is_gone_is_replaced_at_once() -> None:
    driver = group()
    driver.submit("held", rank=1)
    driver.unreachable.add(("dispatch", rank_to_identity(1)))
    driver.hello(1, engine_id="successor")
    lease = driver.core.membership.lease(1)
    assert lease is not None and lease.engine_id == "successor" and lease.incarnation == 2
    assert isinstance(driver.handshake_replies(1)[-1], vllm.EngineHandshakeMetadata)
    failed = [r for r in driver.replies(F0) if isinstance(r, fp.RequestsFailed)]
    assert failed[0].request_ids == ["held"]
    counters = driver.core.counter_values()
    assert counters["handshake.replaced"] == 1 and counters["lease.dead"] == 1


def test_bad_handshake_input_is_refused_with_the_users_message() -> None:
    driver = Driver.start(engines=2)
    error = IdentityError("coordinator requires a Python-compatible two-byte engine id, "
                          "got b'abc'")
    driver.feed(BadFrame("handshake", error, identity=b"abc", frame_count=2))
    (frames,) = driver.sent_to("handshake", b"abc")
    reply = vllm.decode_handshake_reply(frames[0])
    assert isinstance(reply, vllm.HandshakeError) and reply.reason == error.message
    assert driver.core.counter_values()["refused.handshake.identity_length"] == 1
    driver.feed(BadFrame("handshake", ProtocolError("nope", reason="decode"),
                         identity=b"\x01\x00", rank=1, frame_count=2))
    (reply,) = driver.handshake_replies(1)
    assert reply.reason == "bad handshake payload from dp_rank=1: nope"  # type: ignore[union-attr]
    driver.feed(BadFrame("handshake", ProtocolError("3 frames", reason="frame_count"),
                         identity=b"\x01\x00", frame_count=3))
    assert driver.handshake_replies(1)[-1] == vllm.HandshakeError(
        "expected exactly one payload frame")
    driver.feed(HandshakeReceived(b"\x01\x00", 1, vllm.HandshakeMessage("HOWDY")))
    assert "expected HELLO or READY" in driver.handshake_replies(1)[-1].reason  # type: ignore[union-attr]
    assert driver.core.membership.leases() == []


def test_a_bad_frontend_header_gets_an_error_reply_with_its_call_id() -> None:
    driver = Driver.start(engines=1)
    driver.feed(BadFrame("frontend", ProtocolError("bad", reason="decode"), identity=F0,
                         frame_count=2, call_id=41))
    assert driver.replies(F0) == [fp.ErrorReply(41, fp.ERR_BAD_FRAME, "bad")]
    driver.feed(BadFrame("frontend", ProtocolError("1 frame", reason="frame_count"),
                         identity=F0, frame_count=1))
    assert len(driver.replies(F0)) == 1
    assert driver.core.counter_values()["dropped.frontend.decode"] == 1
    assert any(log.key == "frontend:decode:" and log.level == logging.WARNING
               for log in driver.logs)


def test_a_greeting_without_a_handshake_here_is_counted_not_used() -> None:
    driver = Driver.start(engines=2)
    driver.greet(1)
    driver.greet(9)
    counters = driver.core.counter_values()
    assert counters["dispatch.unregistered_greeting"] == 1
    assert counters["dropped.dispatch.rank_out_of_range"] == 1
    assert driver.core.membership.dispatchable() == []


# ---- liveness ------------------------------------------------------------------------------


def test_quiet_engines_are_probed_and_an_answer_renews_the_lease() -> None:
    driver = group(lease_ttl_s=3.0)
    driver.tick(1.5)  # quiet for 1 s = ttl/3 at the lease check of 1.5 s: probed
    assert driver.probes(0) == 1 and driver.probes(1) == 1
    driver.tick(2.5)
    driver.tick(3.9)  # past the original ttl, but the probes renewed the leases
    assert driver.core.membership.dispatchable(now=3.9) == [0, 1]
    assert driver.core.counter_values()["lease.probes"] >= 4


def test_a_lease_that_cannot_be_probed_expires_with_its_ttl() -> None:
    driver = Driver.start(engines=2, lease_ttl_s=3.0)
    driver.hello(0)
    driver.ready(0)  # never greeted on dispatch: nothing to probe it on
    driver.tick(2.0)
    assert driver.probes(0) == 0
    driver.tick(3.75)  # the first lease check past the TTL
    assert driver.core.membership.lease(0).state is RankState.DEAD  # type: ignore[union-attr]
    assert "lease expired" in driver.log_text()


# ---- the watchdog --------------------------------------------------------------------------


def test_the_watchdog_alerts_and_rewakes_a_silent_running_group() -> None:
    driver = group(watchdog_stall_s=2.0)
    driver.report(0, start_wave=0)
    assert driver.core.waves.table.running
    wakes = len(driver.wakes())
    driver.tick(0.3)
    driver.tick(2.5)
    assert driver.core.counter_values()["watchdog.no_progress"] == 1
    assert driver.wakes()[wakes:] == [(0, None)]
    assert "WATCHDOG:" in driver.log_text() and "flight recorder" in driver.log_text()


def test_the_watchdog_blames_no_collective_when_every_rank_is_dead() -> None:
    driver = group(watchdog_stall_s=2.0, lease_ttl_s=1.0)
    driver.report(0, start_wave=0)
    assert driver.core.waves.table.running
    for rank in (0, 1):
        driver.unreachable.add(("dispatch", rank_to_identity(rank)))
    t = 0.0
    while t < 5.0 and not driver.core.ranks.all_dead():
        t += 0.25
        driver.tick(t)
    assert driver.core.ranks.all_dead(), driver.core.group_state(t)
    wakes = len(driver.wakes())
    for _ in range(40):  # ten seconds, five times the stall time
        t += 0.25
        driver.tick(t)
    counters = driver.core.counter_values()
    assert "watchdog.no_progress" not in counters and "watchdog.rewakes" not in counters
    assert driver.wakes()[wakes:] == [] and "WATCHDOG:" not in driver.log_text()
    assert "dp_rank=0 is gone" in driver.log_text()


# ---- state file ----------------------------------------------------------------------------


def test_what_a_restart_needs_is_saved_once_per_event_and_restores() -> None:
    driver = group(persist=True)
    saves = len(driver.saves)
    driver.report(1, start_wave=0)
    driver.report(0, wave_complete=0)
    assert len(driver.saves) == saves + 2
    saved = driver.saves[-1]
    assert saved.wave == 1 and saved.gate_open and saved.inits_sent
    assert [lease.rank for lease in saved.leases] == [0, 1]
    assert [f.client_index for f in saved.frontends] == [0]
    driver.report(0, wave=1, step=3)
    assert len(driver.saves) == saves + 2  # stats are not saved

    again = Driver.start(engines=2, persist=True, now=100.0)
    again.feed(Restore(saved, "/state.json"))
    core = again.core
    assert core.waves.table.current_wave == 1 and core.waves.gate.is_open
    assert core.membership.dispatchable() == [0, 1] and core.frontends.registry.inits_sent
    assert core.saved_state() == saved
    assert "restored from /state.json: wave 1, 2 registrations" in again.log_text()


def test_restore_warns_when_the_addresses_moved() -> None:
    driver = group(persist=True)
    saved = driver.core.saved_state()
    moved = Driver.start(engines=2)
    moved.core.frontends.addresses["dispatch"] = "ipc:///elsewhere"
    moved.feed(Restore(saved, "/s"))
    assert "bound elsewhere (dispatch)" in moved.log_text()


def test_a_failed_write_is_counted_and_retried_a_second_later() -> None:
    driver = group(persist=True)
    driver.feed(StateSaveFailed("/s", "disk full"), now=1.0)
    assert driver.core.counter_values()["state_file.write_errors"] == 1
    saves = len(driver.saves)
    assert driver.core.next_deadline() <= 2.0
    driver.tick(2.0)
    assert len(driver.saves) == saves + 1


def test_without_a_state_file_nothing_is_saved() -> None:
    driver = group()
    driver.report(1, start_wave=0)
    assert driver.saves == []


# ---- operator ------------------------------------------------------------------------------


def test_dump_recorder_logs_every_event() -> None:
    driver = group()
    driver.feed(DUMP_RECORDER)
    text = driver.log_text()
    assert text.count("hello accepted") == 2 and "flight recorder: last" in text


def test_counters_kept_outside_the_core_are_merged_into_every_view() -> None:
    driver = group()
    assert not driver.feed(ServerCounters({"refused.curve.unknown_key": 3}))
    assert driver.core.counter_values()["refused.curve.unknown_key"] == 3
    (reply,) = driver.request(F0, fp.QueryState(driver.call_id()))
    assert isinstance(reply, fp.StateReply)
    assert reply.state.counters["refused.curve.unknown_key"] == 3
    # The server's latest figures replace the earlier ones; the core's own stay.
    driver.feed(ServerCounters({"refused.curve.unknown_key": 5}))
    counters = driver.core.counter_values()
    assert counters["refused.curve.unknown_key"] == 5 and counters["handshake.hello.accepted"] == 2


def test_the_stats_entry_point_is_handle_without_the_lookup() -> None:
    driver = group()
    report = vllm.EngineReport(engine_index=1, start_wave=0)
    actions = driver.core.on_engine_report(report, driver.now)
    driver.execute(actions)
    assert driver.wakes() == [(0, 1)] and driver.core.waves.table.running


def test_a_saved_registration_the_range_no_longer_has_is_skipped_with_a_warning() -> None:
    driver = group(engines=3, persist=True)
    saved = driver.core.saved_state()
    smaller = Driver.start(engines=2)
    smaller.feed(Restore(saved, "/s"))
    assert [lease.rank for lease in smaller.core.membership.leases()] == [0, 1]
    assert "state file: dp_rank=2 is outside" in smaller.log_text()


def test_bad_frames_without_a_peer_to_answer_are_only_dropped() -> None:
    driver = group()
    sends = len(driver.sends)
    driver.feed(BadFrame("back_output", ProtocolError("junk", reason="decode")))
    driver.feed(BadFrame("dispatch", ProtocolError("1 frame", reason="frame_count"),
                         frame_count=1))
    assert len(driver.sends) == sends
    counters = driver.core.counter_values()
    assert counters["dropped.back_output.decode"] == 1
    assert counters["dropped.dispatch.frame_count"] == 1


def test_the_last_engine_subscriber_leaving_changes_nothing() -> None:
    driver = group()
    before = driver.core.saved_state()
    driver.feed(ENGINE_UNSUBSCRIBED)
    driver.feed(FRONTEND_UNSUBSCRIBED)
    assert driver.core.saved_state() == before and driver.core.waves.gate.is_open
    assert "the last engine subscriber left back_publish" in driver.log_text()
