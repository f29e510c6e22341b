"""Event-level tests of the bounds on what peers may do: size, leases, authority, logs."""

from __future__ import annotations

from coordinator.core.actions import SocketName
from coordinator.core.events import BadFrame
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError
from tests.unit.core_driver import Driver, frontend_identity

F0 = frontend_identity(0)


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
    assert len(driver.core.requests) == 0


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
