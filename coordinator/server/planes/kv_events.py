"""KV cache event publishers (vLLM's ``ZmqEventPublisher``): one SUB and one DEALER per rank.

The core says which publishers to follow (``KVSubscribe``, ``KVUnsubscribe``)
and when to ask one for missed batches (``KVRequestReplay``); this plane owns
the sockets and turns what they deliver into events: ``KVBatchReceived``,
``KVReplayEnded`` and ``KVBadMessage`` (with the batch's number when it was
readable), and ``KVPublisherConnected`` / ``KVPublisherDisconnected`` when a
SUB's connection comes up or ends (a socket monitor per SUB). It decides nothing.

Bounds. Every socket has ``MAXMSGSIZE`` (a larger message costs the sender its
connection) and a receive high-water mark (``LIVE_HWM`` messages on a SUB,
``REPLAY_HWM`` on a replay DEALER: a whole replay of vLLM's default buffer
fits). Reading is paid in turns of at most ``MESSAGES_PER_TURN`` messages
across all ranks, round robin, each turn followed by one slice of applying
(``KVDrain``) and a yield to the loop, so dispatch never waits behind a
burst of events. While the core's queue of batches to apply is full, nothing
is read: the publishers' own queues fill, and what they drop is a gap the
core asks for again.

A replay request goes out on a new DEALER: closing the previous one drops,
unread, whatever is left of an answer the core no longer wants.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from coordinator.core.actions import KVRequestReplay, KVSubscribe, KVUnsubscribe
from coordinator.core.events import (
    KV_DRAIN,
    Event,
    KVBadMessage,
    KVBatchReceived,
    KVPublisherConnected,
    KVPublisherDisconnected,
    KVReplayEnded,
    KVReplayUnsent,
    KVSubscribeFailed,
)
from coordinator.protocol.addresses import is_ipv6_tcp
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.kv_events import (
    ReplayEnd,
    decode_kv_frames,
    decode_replay_frames,
    decode_seq,
    encode_replay_request,
)

LIVE_HWM: Final = 10_000
REPLAY_HWM: Final = 25_000
MESSAGES_PER_TURN: Final = 64


def decode_live(rank: int, frames: list[bytes]) -> KVBatchReceived | KVBadMessage:
    """One live-stream message of ``rank``'s publisher as an event."""
    try:
        message = decode_kv_frames(frames)
    except ProtocolError as exc:
        return KVBadMessage(rank, exc, _readable_seq(frames, 1, 3))
    return KVBatchReceived(rank, message.seq, message.batch, message.unknown_events)


def decode_replay(rank: int, frames: list[bytes]) -> KVBatchReceived | KVReplayEnded | KVBadMessage:
    """One message of a replay answer (after the DEALER stripped nothing: the
    publisher's ROUTER sends ``[b"", topic, seq, payload]``) as an event."""
    try:
        message = decode_replay_frames(frames)
    except ProtocolError as exc:
        return KVBadMessage(rank, exc, _readable_seq(frames, 2, 4), replayed=True)
    if isinstance(message, ReplayEnd):
        return KVReplayEnded(rank)
    return KVBatchReceived(rank, message.seq, message.batch, message.unknown_events,
                           replayed=True)


def _readable_seq(frames: list[bytes], index: int, count: int) -> int | None:
    if len(frames) != count:
        return None
    try:
        return decode_seq(frames[index])
    except ProtocolError:
        return None


LIVE: Final = "live"
REPLAY: Final = "replay"
MONITOR: Final = "monitor"
_CONNECTED_EVENTS: Final = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED
_WATCHED_EVENTS: Final = _CONNECTED_EVENTS | zmq.EVENT_DISCONNECTED
# A connecting SUB whose connection ended for a protocol error (a message past
# MAXMSGSIZE) is never reconnected by libzmq: it is made again, at most this often.
REOPEN_INTERVAL_S: Final = 1.0


class _Source:
    __slots__ = ("fd", "kind", "rank", "sock")

    def __init__(self, rank: int, sock: zmq.Socket[bytes], kind: str) -> None:
        self.rank = rank
        self.sock = sock
        self.kind = kind
        self.fd = int(sock.getsockopt(zmq.FD))


class KVEventsPlane:
    """The sockets that follow the engines' KV event publishers; see the module docstring."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        feed: Callable[[Event], None],
        *,
        backlog_full: Callable[[], bool],
        pending: Callable[[], bool],
        max_message_bytes: int,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._ctx = ctx
        self._feed = self._guard(feed, on_error)
        self._backlog_full = backlog_full
        self._pending = pending
        self._max_message_bytes = max_message_bytes
        self._live: dict[int, _Source] = {}
        self._replay: dict[int, _Source] = {}
        self._monitors: dict[int, _Source] = {}
        self._replay_addresses: dict[int, str] = {}
        self._subscriptions: dict[int, KVSubscribe] = {}
        self._reopen_at: dict[int, float] = {}
        self._readable = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next = 0

    @staticmethod
    def _guard(feed: Callable[[Event], None],
               on_error: Callable[[str, BaseException], None]) -> Callable[[Event], None]:
        def guarded(event: Event) -> None:
            try:
                feed(event)
            except Exception as exc:  # a bug must not stop the plane
                on_error("kv_events", exc)

        return guarded

    # ---- what the core asks for -------------------------------------------------------------

    def subscribe(self, action: KVSubscribe) -> None:
        """Follow a publisher (replacing the rank's earlier sockets). Raises zmq.ZMQError if
        the address cannot be bound or connected; the rank is then not followed."""
        self.unsubscribe(action.rank)
        sock = self._socket(zmq.SUB, action.address, LIVE_HWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Watched before it connects, so that not even the first connection goes unseen.
        monitor = sock.get_monitor_socket(_WATCHED_EVENTS)
        try:
            if action.bind:
                sock.bind(action.address)
            else:
                sock.connect(action.address)
        except zmq.ZMQError:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            raise
        self._add(self._monitors, _Source(action.rank, monitor, MONITOR))
        self._add(self._live, _Source(action.rank, sock, LIVE))
        self._subscriptions[action.rank] = action
        if action.replay_address is not None:
            self._replay_addresses[action.rank] = action.replay_address

    def unsubscribe(self, rank: int) -> None:
        live = self._live.get(rank)
        if live is not None:
            with contextlib.suppress(zmq.ZMQError):
                live.sock.disable_monitor()
        for sources in (self._monitors, self._live, self._replay):
            source = sources.pop(rank, None)
            if source is not None:
                self._remove(source)
        self._replay_addresses.pop(rank, None)
        self._subscriptions.pop(rank, None)

    def request_replay(self, action: KVRequestReplay) -> bool:
        """Ask for a replay on a new DEALER; False if the rank has no replay endpoint."""
        address = self._replay_addresses.get(action.rank)
        if address is None:
            return False
        old = self._replay.pop(action.rank, None)
        if old is not None:
            self._remove(old)
        sock = self._socket(zmq.DEALER, address, REPLAY_HWM)
        try:
            sock.connect(address)
        except zmq.ZMQError:
            sock.close(0)
            raise
        source = _Source(action.rank, sock, REPLAY)
        self._add(self._replay, source)
        # The publisher's ROUTER answers this DEALER's identity; a fresh connection
        # queues the request until it is up.
        sock.send_multipart(encode_replay_request(action.start_seq), zmq.NOBLOCK)
        self._readable.set()  # a send can swallow the read edge (see FrameReader)
        return True

    def close(self) -> None:
        for rank in list({*self._live, *self._replay, *self._monitors}):
            self.unsubscribe(rank)

    @property
    def ranks(self) -> list[int]:
        return sorted(self._live)

    # ---- sockets ------------------------------------------------------------------------------

    def _socket(self, kind: int, address: str, hwm: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if is_ipv6_tcp(address):
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    def _add(self, sources: dict[int, _Source], source: _Source) -> None:
        sources[source.rank] = source
        if self._loop is not None:
            self._loop.add_reader(source.fd, self._readable.set)
        self._readable.set()

    def _remove(self, source: _Source) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(source.fd)
        source.sock.close(0)

    # ---- the reading loop ---------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        for source in self._sources():
            loop.add_reader(source.fd, self._readable.set)
        try:
            while True:
                read = self.turn()
                if self._pending():
                    self._feed(KV_DRAIN)
                if read or self._pending():
                    await asyncio.sleep(0)
                    continue
                self._readable.clear()
                if self._any_readable():
                    continue
                await self._readable.wait()
        finally:
            for source in self._sources():
                with contextlib.suppress(Exception):
                    loop.remove_reader(source.fd)
            self._loop = None

    def _sources(self) -> list[_Source]:
        return [*self._monitors.values(), *self._replay.values(), *self._live.values()]

    def turn(self) -> int:
        """Read at most ``MESSAGES_PER_TURN`` messages, round robin over the sockets."""
        sources = self._sources()
        if not sources:
            return 0
        read = 0
        idle = 0
        start = self._next % len(sources)
        index = start
        while read < MESSAGES_PER_TURN and idle < len(sources) and not self._backlog_full():
            source = sources[index]
            index = (index + 1) % len(sources)
            try:
                if source.kind == MONITOR:
                    event = recv_monitor_message(source.sock, zmq.NOBLOCK)
                else:
                    frames = source.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                idle += 1
                continue
            except zmq.ZMQError:
                idle += 1  # closed by a replay request earlier in this turn
                continue
            idle = 0
            read += 1
            # Handling it may replace this rank's replay DEALER: the old one is closed
            # and reads as idle for the rest of the turn.
            if source.kind == MONITOR:
                kind = int(event["event"])
                if kind & _CONNECTED_EVENTS:
                    self._feed(KVPublisherConnected(source.rank))
                elif kind & zmq.EVENT_DISCONNECTED:
                    self._feed(KVPublisherDisconnected(source.rank))
                    self._disconnected(source.rank)
            elif source.kind == LIVE:
                self._feed(decode_live(source.rank, frames))
            else:
                self._feed(decode_replay(source.rank, frames))
        self._next = index
        return read

    def _disconnected(self, rank: int) -> None:
        """Make a connecting SUB again (see ``REOPEN_INTERVAL_S``); a bound one is
        reconnected by its publisher."""
        action = self._subscriptions.get(rank)
        if action is None or action.bind or self._loop is None:
            return
        now = self._loop.time()
        due = self._reopen_at.get(rank, 0.0)
        self._reopen_at[rank] = max(now, due) + REOPEN_INTERVAL_S
        self._loop.call_later(max(0.0, due - now), self._reopen, action)

    def _reopen(self, action: KVSubscribe) -> None:
        if self._subscriptions.get(action.rank) is not action:
            return  # replaced or dropped since
        replay = self._replay.pop(action.rank, None)
        try:
            self.subscribe(action)
        except zmq.ZMQError:
            return  # the address is gone; the core's next subscription decides
        if replay is not None:
            self._replay[action.rank] = replay  # an answer under way stays wanted

    def _any_readable(self) -> bool:
        for source in self._sources():
            with contextlib.suppress(zmq.ZMQError):
                if int(source.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return True
        return False


def kv_action_runners(
    plane: Callable[[], KVEventsPlane | None],
) -> dict[type, Callable[[Any], Event | None]]:
    """The server's carriers for the core's KV actions, on ``plane()`` (None: nothing to do).

    A subscription or replay request that fails (an address in use, a bad one) comes
    back to the core as ``KVSubscribeFailed`` / ``KVReplayUnsent``, which decides
    what follows (the rank is not followed; the replay is given up).
    """

    def subscribe(action: KVSubscribe) -> Event | None:
        current = plane()
        if current is None:
            return None
        try:
            current.subscribe(action)
        except zmq.ZMQError as exc:
            how = "bind" if action.bind else "connect to"
            return KVSubscribeFailed(action.rank, action.address, f"cannot {how} it: {exc}")
        return None

    def unsubscribe(action: KVUnsubscribe) -> None:
        current = plane()
        if current is not None:
            current.unsubscribe(action.rank)

    def request_replay(action: KVRequestReplay) -> Event | None:
        current = plane()
        if current is None:
            return None
        try:
            current.request_replay(action)
        except zmq.ZMQError as exc:
            return KVReplayUnsent(action.rank, str(exc))
        return None

    return {KVSubscribe: subscribe, KVUnsubscribe: unsubscribe, KVRequestReplay: request_replay}
