"""Event-level tests of the bounds on what peers may do: size, leases, authority, logs."""

from __future__ import annotations

import pytest

from coordinator.core.actions import SocketName
from coordinator.core.events import BadFrame, FrontendRequestReceived
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from tests.unit.core_driver import Driver, frontend_identity

F0 = frontend_identity(0)
ADMIN_KEY = "A" * 40


def too_large(socket: SocketName, *, identity: bytes | None = None, rank: int | None = None,
              frame_count: int = 9, call_id: int = 0) -> BadFrame:
    error = ProtocolError("a message of 9 frames and 99 bytes is larger than this socket's "
                          "bound of 50 bytes", reason="too_large")
    return BadFrame(socket, error, identity=identity, rank=rank, frame_count=frame_count,
                    call_id=call_id)


def test_an_oversize_frontend_message_is_answered_too_large_with_its_call_id() -> None:
    driver = Driver.start()
    driver.feed(too_large("frontend", identity=F0, frame_count=9, call_id=12))
    (reply,) = driver.replies(F0)
    assert isinstance(reply, fp.ErrorReply)
    assert (reply.call_id, reply.code) == (12, fp.ERR_TOO_LARGE)
    assert "bound of 50 bytes" in reply.message
    assert driver.core.counter_values()["dropped.frontend.too_large"] == 1
    assert len(driver.core.dispatch.requests) == 0


def test_an_oversize_engine_message_is_counted_and_changes_nothing() -> None:
    driver = Driver.start()
    before = driver.core.group_state(driver.now)
    driver.feed(too_large("back_output", frame_count=9))
    driver.feed(too_large("dispatch", identity=b"\x00\x00", frame_count=9))
    counters = driver.core.counter_values()
    assert counters["dropped.back_output.too_large"] == 1
    assert counters["dropped.dispatch.too_large"] == 1
    assert driver.core.group_state(driver.now).engines == before.engines
    assert not driver.sends


def test_an_oversize_handshake_is_refused_with_a_reply_the_engine_can_read() -> None:
    driver = Driver.start()
    driver.feed(too_large("handshake", identity=b"\x01\x00", rank=1, frame_count=9))
    (reply,) = driver.handshake_replies(1)
    assert "bound of 50 bytes" in reply.reason  # type: ignore[union-attr]
    assert driver.core.counter_values()["refused.handshake.too_large"] == 1
    assert driver.core.membership.lease(1) is None


# ---- operator authority --------------------------------------------------------------------


def ready_group(engines: int = 2, **config: object) -> Driver:
    driver = Driver.start(engines=engines, **config)
    driver.register(0)
    driver.start_group(range(engines))
    return driver


def states(driver: Driver) -> list[str]:
    return [engine.state for engine in driver.core.group_state(driver.now).engines]


@pytest.mark.parametrize("command", ["cordon", "uncordon", "drain"])
def test_admin_from_a_frontend_connection_is_refused_and_changes_nothing(command: str) -> None:
    driver = ready_group()
    before = states(driver)
    (reply,) = driver.request(F0, fp.Admin(driver.call_id(), command, 1))  # type: ignore[arg-type]
    assert isinstance(reply, fp.ErrorReply) and reply.code == fp.ERR_NOT_AUTHORIZED
    assert reply.message.startswith(f"{command} changes membership and needs an operator")
    assert states(driver) == before
    assert driver.core.counter_values()["refused.admin.not_authorized"] == 1


def test_admin_from_a_curve_key_is_taken_only_when_the_key_is_an_admin_key() -> None:
    driver = ready_group(admin_keys=frozenset({ADMIN_KEY}))
    stranger = FrontendRequestReceived(F0, fp.Admin(driver.call_id(), "cordon", 1), [],
                                       "frontend", "B" * 40)
    driver.feed(stranger)
    assert states(driver) == ["ready", "ready"]
    operator = FrontendRequestReceived(F0, fp.Admin(driver.call_id(), "cordon", 1), [],
                                       "frontend", ADMIN_KEY)
    driver.feed(operator)
    assert states(driver) == ["ready", "cordoned"]
    codes = [r.code if isinstance(r, fp.ErrorReply) else type(r).__name__
             for r in driver.replies(F0)[1:]]
    assert codes == [fp.ERR_NOT_AUTHORIZED, "AdminDone"]
    assert driver.core.counter_values()["admin.cordon"] == 1


def test_the_admin_socket_is_an_operator_and_answers_on_itself() -> None:
    driver = ready_group()
    (done,) = driver.operator(fp.Admin(driver.call_id(), "drain", 1))
    assert isinstance(done, fp.AdminDone) and done.state == "draining"
    (state,) = driver.operator(fp.QueryState(driver.call_id()))
    assert isinstance(state, fp.StateReply)
    # Frontend business does not belong there.
    (refused,) = driver.operator(fp.Register(driver.call_id(), 1, "ipc:///run/x"))
    assert isinstance(refused, fp.ErrorReply) and refused.code == fp.ERR_BAD_FRAME
    assert "the admin socket takes only" in refused.message
    assert len(driver.core.frontends.registry) == 1


def test_a_rank_out_of_range_gets_an_operators_message() -> None:
    driver = ready_group()
    (reply,) = driver.operator(fp.Admin(driver.call_id(), "cordon", 9))
    assert isinstance(reply, fp.ErrorReply) and reply.code == fp.ERR_ADMIN_REFUSED
    assert reply.message == ("dp_rank=9 is not one of this coordinator's ranks (0..1); "
                             "`dp-coordinator status` lists them")


# ---- SCALE_ELASTIC_EP bounds ---------------------------------------------------------------


def test_a_resize_out_of_the_bounds_is_refused_counted_and_changes_nothing() -> None:
    driver = ready_group()
    for count in (65536, 3, 1):
        driver.feed(vllm.ScaleElasticEP(count))
    assert driver.core.rank_range == range(0, 2) and driver.core.loads.size == 2
    assert driver.core.counter_values()["refused.front_publish.scale_out_of_range"] == 3
    assert states(driver) == ["ready", "ready"]


def test_a_resize_within_the_bounds_is_honoured() -> None:
    driver = ready_group(min_engines=1, max_engines=4)
    driver.feed(vllm.ScaleElasticEP(4))
    assert driver.core.rank_range == range(0, 4)
    driver.feed(vllm.ScaleElasticEP(5))
    assert driver.core.rank_range == range(0, 4)


# ---- frontend leases -----------------------------------------------------------------------

TTL = 30.0


def frontends(driver: Driver) -> list[int]:
    return [peer.client_index for peer in driver.core.frontends.registry.peers()]


def advance(driver: Driver, until: float) -> None:
    """Tick once a second, as the server's timer does, up to ``until``."""
    now = driver.now
    while now < until:
        now = min(until, now + 1.0)
        driver.tick(now)


def test_a_registration_no_one_renews_expires_and_frees_its_slot_and_index() -> None:
    driver = Driver.start(engines=1, max_frontends=4)
    for index in range(4):
        driver.register(index, identity=b"\x00gone-" + bytes([index]))
    advance(driver, TTL / 2)
    assert frontends(driver) == [0, 1, 2, 3]
    advance(driver, TTL + 1.5)
    assert frontends(driver) == []
    assert driver.core.counter_values()["frontend.expired"] == 4
    assert "no message or heartbeat for 30 s; its registration expired" in driver.log_text()
    # No INIT carried them: any frontend may take the indices, with any address.
    assert isinstance(driver.register(0, output="ipc:///run/new"), fp.Registered)


def test_traffic_and_heartbeats_renew_a_registration() -> None:
    driver = Driver.start(engines=1)
    driver.register(0)
    driver.register(1)
    for step in range(1, 5):
        advance(driver, step * TTL / 2)
        driver.request(F0, fp.QueryState(driver.call_id()))
        (alive,) = driver.request(frontend_identity(1), fp.Heartbeat(driver.call_id(), 1))
        assert isinstance(alive, fp.Alive)
        assert (alive.lease_ttl_s, alive.interval_s) == (TTL, min(TTL / 3, 30.0 / 4))
    assert frontends(driver) == [0, 1]


def test_a_heartbeat_for_an_index_this_connection_does_not_hold_asks_to_register() -> None:
    driver = Driver.start(engines=1)
    (reply,) = driver.request(F0, fp.Heartbeat(driver.call_id(), 0))
    assert isinstance(reply, fp.ErrorReply) and reply.code == fp.ERR_NOT_REGISTERED
    assert reply.message.endswith("register again")
    assert frontends(driver) == []


def test_a_pause_of_the_coordinator_renews_instead_of_expiring() -> None:
    driver = Driver.start(engines=1)
    driver.register(0)
    driver.tick(1.0)
    # Nothing checked for longer than the TTL: the coordinator itself was stopped.
    driver.stall(1.0 + TTL + 5.0)
    assert frontends(driver) == [0]
    # Checked every second from there on, the lease runs from the end of the pause.
    advance(driver, 1.0 + 2 * TTL + 4.0)
    assert frontends(driver) == [0]
    advance(driver, 1.0 + 2 * TTL + 6.0)
    assert frontends(driver) == []


def test_an_index_an_init_carried_keeps_its_address_after_its_lease() -> None:
    driver = Driver.start(engines=2)
    driver.register(0, output="ipc:///run/a")
    driver.register(2, output="ipc:///run/c")
    driver.hello(0)
    (init,) = [frames for frames in driver.sent_to("handshake", b"\x00\x00")]
    outputs = vllm.decode_init(init[0]).addresses.outputs
    # By client index: index 1 has nobody and gets the coordinator's own back_output.
    assert outputs == ["ipc:///run/a", "ipc:///run/bo", "ipc:///run/c"]
    advance(driver, TTL + 1.0)
    assert frontends(driver) == []
    refused = driver.register(0, output="ipc:///run/elsewhere")
    assert isinstance(refused, fp.ErrorReply) and refused.code == fp.ERR_BAD_CLIENT_INDEX
    assert "ipc:///run/a, which engines already use" in refused.message
    assert isinstance(driver.register(0, output="ipc:///run/a"), fp.Registered)
    assert isinstance(driver.register(1, output="ipc:///run/b"), fp.Registered)


def test_an_expired_frontends_requests_are_forgotten_and_a_drain_completes() -> None:
    driver = ready_group()
    driver.submit("r1", rank=1)
    driver.operator(fp.Admin(driver.call_id(), "drain", 1))
    assert driver.core.dispatch.requests.count(1) == 1
    advance(driver, TTL + 1.0)
    assert driver.core.dispatch.requests.count(1) == 0
    assert "(1 requests in flight from it forgotten)" in driver.log_text()
    assert "dp_rank=1 drained" in driver.log_text()


def test_every_registered_frontend_hears_that_a_rank_was_lost() -> None:
    driver = ready_group()
    driver.register(1)
    driver.submit("r1", rank=1)
    driver.unreachable.add(("dispatch", b"\x01\x00"))
    advance(driver, 8.0)  # rank 1 is quiet: probed, the probe fails, it is dead
    failed = [r for r in driver.replies(F0) if isinstance(r, fp.RequestsFailed)]
    assert [f.request_ids for f in failed] == [["r1"]]
    for index in (0, 1):
        lost = [r for r in driver.replies(frontend_identity(index))
                if isinstance(r, fp.RankLost)]
        assert [(r.rank, r.reason) for r in lost] == [(1, failed[0].reason)]
    # Its own failures come first, so the SDK only fails what the coordinator did not know.
    notices = [r for r in driver.replies(F0) if isinstance(r, (fp.RequestsFailed, fp.RankLost))]
    assert [type(n).__name__ for n in notices] == ["RequestsFailed", "RankLost"]


# ---- watchdog progress from frontends ------------------------------------------------------


def alerts(driver: Driver) -> int:
    return driver.core.counter_values().get("watchdog.no_progress", 0)


def test_outputs_a_frontend_saw_are_progress_and_their_end_is_a_stall() -> None:
    driver = ready_group(watchdog_stall_s=3.0)
    driver.report(0, start_wave=0)
    assert driver.core.waves.snapshot() == (0, True)
    now = 0.0
    for _ in range(40):  # 10 s of a steady decode: no stats, outputs seen every second
        now += 0.25
        if now == int(now):
            driver.request(F0, fp.Heartbeat(driver.call_id(), 0, [0]))
        driver.tick(now)
    assert alerts(driver) == 0
    # Outputs from a rank outside the group prove nothing.
    driver.request(F0, fp.Heartbeat(driver.call_id(), 0, [7]))
    for _ in range(16):
        now += 0.25
        driver.tick(now)
    assert alerts(driver) == 1
