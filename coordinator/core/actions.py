"""What the core asks the server to do: send, publish, log, save, and a few socket chores.

The core returns a short sequence of these for every event, in the order they
must be carried out. They name sockets by their address-file key and peers
by their routing identity; everything on the wire is already encoded, so the
server only moves bytes.

Sends whose outcome matters report back (see ``coordinator.core.events``):

* a ``Send`` always reports ``SendFailed`` if it could not be handed to its
  socket, and also ``SendSucceeded`` when the core set ``confirm`` (liveness
  probes, INIT); for a send that names the connection it should go out on
  (``conn``), that report says how long ago anything last arrived on it;
* a ``DispatchAdd`` carries out its ``wake`` and sends ``reply`` to the
  frontend only after the ADD was handed to the engine's connection;
  otherwise it reports ``SendFailed`` and the core decides what follows (the
  next best rank, or a refusal).

KV event publishers are followed with ``KVSubscribe`` / ``KVUnsubscribe`` and
asked for missed batches with ``KVRequestReplay``.

Counters and the flight recorder live in the core as plain data, so they are
not actions. Logging is: ``Log.key``, when set, asks the server's rate limiter
for at most one such line per interval.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import msgspec

from coordinator.core.persisted import SavedState

SocketName: TypeAlias = Literal[
    "handshake", "dispatch", "back_output", "back_publish", "front_publish", "frontend",
    "admin",
]
ConnectionSocket: TypeAlias = Literal["handshake", "dispatch"]
PublishSocket: TypeAlias = Literal["back_publish", "front_publish"]


class SendPurpose(enum.Enum):
    """Why a frame goes out: says what a failed (or confirmed) send means to the core."""

    REPLY = "reply"  # an answer to a frontend's request
    NOTICE = "notice"  # an unsolicited notice to a frontend (failed, drained, shutdown)
    HANDSHAKE = "handshake"  # an ERROR or ACCEPTED reply on the handshake socket
    INIT = "init"  # the INIT reply to HELLO (confirmed: the output addresses are pinned)
    ABORT = "abort"  # requests a frontend aborted, to the engine holding them
    PROBE_LEASE = "probe_lease"  # an empty ABORT to a quiet engine (confirmed)
    PROBE_HOLDER = "probe_holder"  # an empty ABORT to a rank's holder during HELLO (confirmed)


class Send(msgspec.Struct, frozen=True):
    """Send ``[identity, *frames]`` on ROUTER socket ``socket``; ``conn`` is the connection
    the core believes holds ``identity`` (0: none known)."""

    socket: SocketName
    identity: bytes
    frames: Sequence[bytes]
    purpose: SendPurpose = SendPurpose.REPLY
    confirm: bool = False
    conn: int = 0


class DispatchAdd(msgspec.Struct, frozen=True):
    """Send ADD ``[engine, b"\x00", *payload]`` on dispatch; if that worked, carry out
    ``wake`` (the wave's actions for a first request, if any), then send ``reply``.

    ``retry`` is the dispatch domain's own note of the submit (opaque here), handed
    back with ``SendFailed`` so that a failed ADD can be tried elsewhere.
    """

    rank: int
    engine: bytes
    payload: list[bytes]
    reply: Send
    wake: tuple[Action, ...] = ()
    retry: Any = None


class Publish(msgspec.Struct, frozen=True):
    """Send ``frames`` on XPUB socket ``socket`` to every subscriber."""

    socket: PublishSocket
    frames: Sequence[bytes]


class Log(msgspec.Struct, frozen=True):
    """Write ``message % args`` to the coordinator's log at ``level`` (a logging level).

    With a ``key``, at most one line per key per interval is written, and the next
    one says how many were suppressed. With an ``event``, the line is also a
    structured event: its stable name and ``fields`` ride with it (the JSON log
    format writes them as the object's keys).
    """

    level: int
    message: str
    args: tuple[object, ...] = ()
    key: str | None = None
    event: str | None = None
    fields: dict[str, object] | None = None

    def extra(self) -> dict[str, object] | None:
        """The ``extra=`` of the logging call: the event's name and fields."""
        if self.event is None:
            return None
        return {"event": self.event, **(self.fields or {})}


class SaveState(msgspec.Struct, frozen=True):
    """Write ``state`` to the state file (atomically; fsync'ed when ``durable``)."""

    state: SavedState
    durable: bool = False


class SetLinger(msgspec.Struct, frozen=True, gc=False):
    """Let ``socket`` keep unsent messages for ``linger_ms`` when it closes."""

    socket: SocketName
    linger_ms: int


class KVSubscribe(msgspec.Struct, frozen=True):
    """Follow ``rank``'s KV event publisher: a SUB that binds or connects at ``address``,
    and replay requests to ``replay_address`` (None: the publisher has no replay
    endpoint). Replaces any earlier subscription of the rank."""

    rank: int
    address: str
    bind: bool
    replay_address: str | None = None


class KVUnsubscribe(msgspec.Struct, frozen=True, gc=False):
    """Stop following ``rank``'s publisher."""

    rank: int


class KVRequestReplay(msgspec.Struct, frozen=True, gc=False):
    """Ask ``rank``'s publisher for its buffered batches from ``start_seq`` on.

    Whatever an earlier request of the rank has not delivered yet is dropped
    unread: its answer is no longer wanted.
    """

    rank: int
    start_seq: int


class RefreshObserved(msgspec.Struct, frozen=True, gc=False):
    """The operators' snapshot (HTTP) is out of date: refresh it soon, or now if ``force``."""

    force: bool = False


class CloseConnection(msgspec.Struct, frozen=True, gc=False):
    """Cut connection ``conn`` of ``socket``: it still holds an identity its engine gave
    up (a host that crashed), and the engine's successor needs it."""

    socket: ConnectionSocket
    conn: int


class RearmTimer(msgspec.Struct, frozen=True, gc=False):
    """``next_deadline()`` may have moved earlier: recompute the timer's sleep."""


REFRESH_OBSERVED = RefreshObserved()
REFRESH_OBSERVED_NOW = RefreshObserved(force=True)
REARM_TIMER = RearmTimer()

class StopProcess(msgspec.Struct, frozen=True):
    """An operator asked the process to stop; after a drain when ``graceful``."""

    graceful: bool


Action: TypeAlias = (
    Send | DispatchAdd | Publish | Log | SaveState | SetLinger | RefreshObserved | RearmTimer
    | CloseConnection | StopProcess
    | KVSubscribe | KVUnsubscribe | KVRequestReplay
)
NO_ACTIONS: tuple[Action, ...] = ()
