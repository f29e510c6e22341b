"""Parts of the frontend SDK: what it raises and reports, and its operator channel.

The errors, `FinishedRequest`, `EngineDead` and `Notice` are re-exported by
`coordinator.frontend`, which is where users import them from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from coordinator._zmq import CLIENT, HandshakeFailure, HandshakeMonitor, connect
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError

# Loop turns a `rank_lost` notice waits for queued outputs to be read first.
OUTPUT_DRAIN_TURNS = 1000
# Heartbeat interval until the coordinator names its own (in `alive`).
FIRST_HEARTBEAT_S = 1.0


class FrontendError(Exception):
    """Base class of every error the SDK raises."""


class FrontendClosed(FrontendError):
    """The client was closed while a call was waiting (or before it started)."""


class CoordinatorTimeout(FrontendError, TimeoutError):
    """No answer within the call's timeout; `handshake_failure` says why, if a handshake failed."""

    def __init__(self, what: str, timeout_s: float,
                 handshake_failure: HandshakeFailure | None = None) -> None:
        why = f": {handshake_failure.message}" if handshake_failure is not None else ""
        super().__init__(f"no answer from the coordinator to {what} within {timeout_s:g} s{why}")
        self.what = what
        self.timeout_s = timeout_s
        self.handshake_failure = handshake_failure


class HandshakeFailed(FrontendError, ConnectionError):
    """The connection to the coordinator failed its handshake (CURVE keys); `failure` says why.

    `failure.final`: libzmq gave the connection up; make a new client with the right keys.
    """

    def __init__(self, failure: HandshakeFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class InvalidRequest(FrontendError, ValueError):
    """A call's arguments are outside the protocol's bounds; nothing was sent."""


class ReplyError(FrontendError):
    """The coordinator answered a call with an ErrorReply."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class RegisterError(ReplyError):
    """Register was refused (e.g. `bad_client_index`)."""


class SubmitError(ReplyError):
    """Submit was refused (e.g. `unknown_rank`, `duplicate_request_id`)."""


class AdminError(ReplyError):
    """An admin command, state query or abort was refused."""


@dataclass(frozen=True)
class FinishedRequest:
    """One request an engine reported finished, as seen on this client's PULL."""

    request_id: str
    engine_index: int
    at: float
    """`time.monotonic()` when the output was read."""


@dataclass(frozen=True)
class EngineDead:
    """An engine sent ENGINE_CORE_DEAD to this frontend's output socket."""

    at: float


Notice = fp.RequestsFailed | fp.RankDrained | fp.ShuttingDown | fp.ErrorReply | EngineDead
"""Something the coordinator or an engine told us without being asked.

An `ErrorReply` here has call id 0 (or an id no call waits for): the coordinator
could not read one of our messages, so it could not say which call it was."""


class OperatorChannel:
    """A DEALER to the coordinator's owner-only `admin` socket, for operators' commands.

    Connecting needs write permission on the socket file: this process must run as
    the coordinator's user. One call at a time; a late answer to an earlier call is
    skipped.
    """

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.address = address
        self._ctx = ctx
        self._sock: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()

    async def command(self, command: fp.AdminCommand, rank: int, *, call_id: int,
                      timeout_s: float) -> fp.AdminDone:
        """Send one command; AdminError when refused, CoordinatorTimeout after `timeout_s`."""
        async with self._lock:
            if self._sock is None:
                self._sock = connect(self._ctx, zmq.DEALER, self.address, CLIENT)
            sock = self._sock
            deadline = time.monotonic() + timeout_s
            await sock.send(fp.encode(fp.Admin(call_id, command, rank)))
            while (remaining := deadline - time.monotonic()) > 0:
                if not await sock.poll(int(remaining * 1000) + 1):
                    break
                frames = await sock.recv_multipart()
                try:
                    reply = fp.decode_reply(frames[0]) if len(frames) == 1 else None
                except ProtocolError:
                    reply = None
                if reply is None or getattr(reply, "call_id", None) != call_id:
                    continue
                if isinstance(reply, fp.ErrorReply):
                    raise AdminError(reply.code, reply.message)
                if isinstance(reply, fp.AdminDone):
                    return reply
                raise FrontendError(f"admin: the coordinator answered with "
                                    f"{type(reply).__name__}")
        raise CoordinatorTimeout(f"admin {command} {rank}", timeout_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def handshake_failure(monitor: HandshakeMonitor | None) -> HandshakeFailure | None:
    """The last handshake failure of a monitored connection, if any."""
    return monitor.poll() if monitor is not None else None


def raise_if_refused(monitor: HandshakeMonitor | None) -> None:
    """HandshakeFailed when libzmq gave the connection up for good."""
    failure = handshake_failure(monitor)
    if failure is not None and failure.final:
        raise HandshakeFailed(failure)


def heartbeat_frames(client_index: int, progress: list[int]) -> Callable[[int], list[bytes]]:
    """The frames of a heartbeat, given its call id."""
    return lambda call_id: [fp.encode(fp.Heartbeat(call_id, client_index, progress))]


def lost_requests(in_flight: dict[str, int], lost: fp.RankLost) -> fp.RequestsFailed | None:
    """Take from ``in_flight`` (request id -> rank) what was on the lost rank, as the
    failure notice the coordinator could not send (it did not know them); None if none."""
    ids = [request_id for request_id, rank in in_flight.items() if rank == lost.rank]
    for request_id in ids:
        del in_flight[request_id]
    return fp.RequestsFailed(ids, lost.rank, lost.reason) if ids else None


def undeliverable_warning(registered: fp.Registered) -> str:
    """What to tell the user when some ranks cannot deliver this frontend's outputs."""
    return (f"client_index={registered.client_index} registered after the INITs of dp_rank "
            f"{', '.join(map(str, registered.undeliverable_ranks))} went out without its "
            f"output address: those engines cannot deliver its outputs, so the coordinator "
            f"sends its requests elsewhere (and refuses them, undeliverable, when no other "
            f"rank can). Start the coordinator with --frontends N, or restart those engines")
