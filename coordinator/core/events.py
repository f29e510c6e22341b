"""What the server tells the core: decoded frames, send outcomes, timers, commands.

Every event is small and immutable. The server decodes each frame at the edge
with the protocol package's typed decoders and hands the core the result:

* a decoded struct, where the struct says it all: ``vllm.EngineReport`` (the
  stats and wave reports on ``back_output``, the hot path, so no wrapper is
  built for it), ``vllm.ScaleElasticEP`` and ``vllm.LegacyFirstRequest``
  (``front_publish``);
* an event of this module wrapping a decoded struct with where it came from
  (``HandshakeReceived``, ``FrontendRequestReceived``), or saying what
  happened (``EngineGreeted``, ``EngineSubscribed``, ``FrontendSubscribed``);
* ``BadFrame`` when decoding failed, carrying the ``ProtocolError``: counting,
  logging and any reply are the core's decision too;
* connection facts of ``handshake`` and ``dispatch``: the server numbers each
  connection of those sockets (``conn``, never 0), says which one a HELLO,
  READY or greeting came on, and reports ``PeerConnected`` and
  ``PeerDisconnected``.

KV cache events from the engines' publishers come as ``KVBatchReceived``,
``KVReplayEnded`` and ``KVBadMessage``, and ``KVPublisherConnected`` or
``KVPublisherDisconnected`` when a connection to one comes up or ends;
``KVDrain`` asks the core to apply one bounded slice of the queued ones;
``KVSubscribeFailed`` and ``KVReplayUnsent`` say that a KV action could not be
carried out, so the core never believes it follows a publisher it does not.

Outcomes of sends come back as ``SendFailed`` (always) and ``SendSucceeded``
(only for a ``Send`` the core marked ``confirm``), right after the send and
before any other event. Time comes with every event as ``now``; ``Tick`` is
the timer firing. The rest are the process's own life: ``Bound`` (the
sockets' addresses), ``Restore`` (a state file to resume from),
``StateSaveFailed``, ``Shutdown``, the operator's ``DumpRecorder``, and
``ServerCounters`` (the server's own counters, shown in the core's views).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import msgspec

from coordinator.core.actions import ConnectionSocket, DispatchAdd, Send, SocketName
from coordinator.core.persisted import SavedState
from coordinator.core.ranks.authority import Channel
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.kv_events import GreetingKV, KVEventBatch

SendFailure: TypeAlias = Literal["full", "unreachable"]


class HandshakeReceived(msgspec.Struct, frozen=True):
    """HELLO, READY or any other status from the engine whose identity names ``rank``."""

    identity: bytes
    rank: int
    message: vllm.HandshakeMessage
    conn: int = 0
    """The connection it came on (0: not known)."""


class EngineGreeted(msgspec.Struct, frozen=True, gc=False):
    """The engine holding ``rank`` spoke on the dispatch socket (its ready greeting).

    ``conn`` is the connection it came on (0: not known), ``kv`` what the greeting
    says about the engine's prefix cache and KV event publisher (None when it says
    nothing readable), ``host`` the address the engine connected from (tcp only).
    """

    rank: int
    conn: int = 0
    kv: GreetingKV | None = None
    host: str | None = None
    kv_unreadable: bool = False
    vllm_version: str | None = None
    """The greeting's ``vllm_version`` (vLLM engines send one), at most 64 characters."""


class PeerConnected(msgspec.Struct, frozen=True):
    """Connection ``conn`` was accepted on ``socket``; ``peer`` says who it is from."""

    socket: ConnectionSocket
    conn: int
    peer: str = ""


class PeerDisconnected(msgspec.Struct, frozen=True, gc=False):
    """Connection ``conn`` of ``socket`` closed (the peer left, or heartbeats cut it off)."""

    socket: ConnectionSocket
    conn: int


class EngineSubscribed(msgspec.Struct, frozen=True, gc=False):
    """An engine subscribed on ``back_publish``."""


class EngineUnsubscribed(msgspec.Struct, frozen=True, gc=False):
    """The last engine subscriber left ``back_publish``."""


class FrontendSubscribed(msgspec.Struct, frozen=True, gc=False):
    """A frontend subscribed on ``front_publish``."""


class FrontendUnsubscribed(msgspec.Struct, frozen=True, gc=False):
    """The last frontend subscriber left ``front_publish``."""


class FrontendRequestReceived(msgspec.Struct, frozen=True):
    """A decoded frontend request from connection ``identity``; ``payload`` only for submit.

    ``channel`` is the socket it came in on (``frontend``, or the operators' owner-only
    ``admin`` socket) and ``user_id`` the peer's CURVE key (Z85) when it has one: the
    facts ``core.authority`` judges operators by.
    """

    identity: bytes
    message: fp.FrontendRequest
    payload: list[bytes]
    channel: Channel = "frontend"
    user_id: str | None = None


class BadFrame(msgspec.Struct, frozen=True):
    """Input on ``socket`` that failed to decode.

    ``identity`` is the peer's routing identity on ROUTER sockets, ``rank`` the
    rank it names when it did (a handshake whose payload was bad),
    ``frame_count`` how many frames the message had (identity included) and
    ``call_id`` a frontend header's call id, when one could be read.
    """

    socket: SocketName
    error: ProtocolError
    identity: bytes | None = None
    rank: int | None = None
    frame_count: int = 0
    call_id: int = 0


class KVBatchReceived(msgspec.Struct, frozen=True, gc=False):
    """A batch of ``rank``'s KV events: live, or part of a replay answer (``replayed``)."""

    rank: int
    seq: int
    batch: KVEventBatch
    unknown_events: int = 0
    replayed: bool = False


class KVReplayEnded(msgspec.Struct, frozen=True, gc=False):
    """The end marker of ``rank``'s replay answer."""

    rank: int


class KVBadMessage(msgspec.Struct, frozen=True):
    """A message from ``rank``'s publisher that did not decode; ``seq`` if it was readable."""

    rank: int
    error: ProtocolError
    seq: int | None = None
    replayed: bool = False


class KVPublisherConnected(msgspec.Struct, frozen=True, gc=False):
    """The connection to ``rank``'s KV event publisher came up (first, or again)."""

    rank: int


class KVPublisherDisconnected(msgspec.Struct, frozen=True, gc=False):
    """The connection to ``rank``'s KV event publisher ended."""

    rank: int


class KVDrain(msgspec.Struct, frozen=True, gc=False):
    """Apply queued KV events to the prefix index, one bounded slice."""


class KVSubscribeFailed(msgspec.Struct, frozen=True):
    """A ``KVSubscribe`` could not be carried out (an address in use, a bad one): the
    rank's publisher is not followed."""

    rank: int
    address: str
    error: str


class KVReplayUnsent(msgspec.Struct, frozen=True):
    """A ``KVRequestReplay`` could not be sent: no answer will come."""

    rank: int
    error: str


class ServerCounters(msgspec.Struct, frozen=True):
    """The server's own counters (its internal errors, CURVE refusals), as they are now;
    the core shows them beside its own in every view."""

    values: dict[str, int]


class SendFailed(msgspec.Struct, frozen=True):
    """The server could not hand ``action`` to its socket (peer gone, or queue full)."""

    action: Send | DispatchAdd
    reason: SendFailure


class SendSucceeded(msgspec.Struct, frozen=True):
    """A ``Send`` marked ``confirm`` was handed to its socket. ``heard_ago_s``: how long
    ago anything (a heartbeat answer included) last arrived on the connection it named,
    when the server can tell (tcp); None otherwise."""

    action: Send
    heard_ago_s: float | None = None


class Tick(msgspec.Struct, frozen=True, gc=False):
    """The timer fired (at or after ``CoordinatorCore.next_deadline()``)."""


class Bound(msgspec.Struct, frozen=True):
    """The sockets are bound: their addresses, and the DP meeting point sent in INIT."""

    addresses: dict[str, str]
    parallel_config: dict[str, int | str | list[int]]


class Restore(msgspec.Struct, frozen=True):
    """Resume from a previous process's state file (read from ``path``)."""

    saved: SavedState
    path: str


class StateSaveFailed(msgspec.Struct, frozen=True):
    """Writing the state file failed; ``error`` says why."""

    path: str
    error: str


class Shutdown(msgspec.Struct, frozen=True):
    """Stop taking work and say goodbye; the sockets close after this."""

    reason: str


class GracefulStop(msgspec.Struct, frozen=True):
    """Planned maintenance: refuse new submits and routes; those in flight finish, and
    the process stops once none is left (or its deadline passes)."""

    reason: str


class DumpRecorder(msgspec.Struct, frozen=True, gc=False):
    """The operator asked for the whole flight recorder in the log (SIGUSR1)."""


TICK = Tick()
ENGINE_SUBSCRIBED = EngineSubscribed()
ENGINE_UNSUBSCRIBED = EngineUnsubscribed()
FRONTEND_SUBSCRIBED = FrontendSubscribed()
FRONTEND_UNSUBSCRIBED = FrontendUnsubscribed()
DUMP_RECORDER = DumpRecorder()
KV_DRAIN = KVDrain()

Event: TypeAlias = (
    HandshakeReceived
    | EngineGreeted
    | PeerConnected
    | PeerDisconnected
    | vllm.EngineReport
    | EngineSubscribed
    | EngineUnsubscribed
    | FrontendSubscribed
    | FrontendUnsubscribed
    | vllm.ScaleElasticEP
    | vllm.LegacyFirstRequest
    | FrontendRequestReceived
    | KVBatchReceived
    | KVReplayEnded
    | KVBadMessage
    | KVPublisherConnected
    | KVPublisherDisconnected
    | KVDrain
    | KVSubscribeFailed
    | KVReplayUnsent
    | ServerCounters
    | BadFrame
    | GracefulStop
    | SendFailed
    | SendSucceeded
    | Tick
    | Bound
    | Restore
    | StateSaveFailed
    | Shutdown
    | DumpRecorder
)
