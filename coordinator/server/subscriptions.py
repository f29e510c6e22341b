"""Subscriptions on the two publish sockets: only the topic the protocol uses is kept.

An XPUB socket keeps every topic its peers subscribe to, in a trie of one
node per byte (about 44 bytes a byte of topic), for as long as the
connection lasts; nothing in libzmq bounds their number, and its manual mode
keeps them all the same. A peer sending thousands of distinct topics grows
the process by hundreds of MiB and stalls publishes while libzmq files them.

vLLM's engines and API servers, and this package's engine and frontend
clients, subscribe to everything: the empty topic, once per connection. So on
``back_publish`` and ``front_publish``:

* a message is at most ``PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES`` (libzmq drops a
  connection whose frame is larger, before it is filed), which bounds a topic;
* libzmq takes in at most ``PUBLISH_UPSTREAM_RCVHWM`` message of a connection
  before the coordinator's thread has filed it, which paces its reading of a
  flooding peer to the coordinator's (with libzmq's default of 1,000 a flood
  grew the process several times as much, and stalled the loop for seconds);
* a subscription to any other topic is refused: counted as
  ``refused.subscriptions.<socket>``, logged (a WARNING, at most one per log
  interval), not passed on, and its connection (from the message's
  descriptor) is shut down, so libzmq drops the connection and every topic it
  filed for it. A cancellation of such a topic holds nothing and is dropped.

What this does not bound: libzmq files the topics it reads in the coordinator's
own thread (while the socket processes its commands) before the coordinator
sees the first of them, and keeps reading while the peer keeps writing. So a
peer that writes topics without pause holds the loop, and the memory of its
topics, until it pauses; only then is its connection closed (docs/OPERATIONS.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping

from coordinator.protocol import vllm
from coordinator.server.connection_gate import ConnectionGate
from coordinator.server.connections import describe_peer
from coordinator.server.transport import FrameHandler, RateLimitedLog

log = logging.getLogger("coordinator.server")

PUBLISH_SOCKETS = ("back_publish", "front_publish")
PROTOCOL_TOPICS = frozenset({b""})
"""The topics vLLM's peers and this package's clients subscribe to."""
_FLAGS = (vllm.SUBSCRIBE, vllm.UNSUBSCRIBE)


class SubscriptionGuard:
    """Refuses subscriptions to topics the protocol does not use; see the module docstring."""

    def __init__(self, gate: ConnectionGate, log_interval_s: float,
                 clock: Callable[[], float]) -> None:
        self._gate = gate
        self._last_fd = dict.fromkeys(PUBLISH_SOCKETS, -1)
        self._counters: Counter[str] = Counter()
        self._ratelog = RateLimitedLog(log, interval_s=log_interval_s, clock=clock)

    def source(self, key: str) -> Callable[[int], None] | None:
        """For a publish socket's reader: hears the descriptor of each message."""
        if key not in self._last_fd:
            return None
        last_fd = self._last_fd

        def note(fd: int) -> None:
            last_fd[key] = fd

        return note

    def guarded(self, handlers: Mapping[str, FrameHandler]) -> dict[str, FrameHandler]:
        """``handlers`` with the publish sockets' behind the guard."""
        out = dict(handlers)
        for key in PUBLISH_SOCKETS:
            if key in out:
                out[key] = self._guard(key, out[key])
        return out

    def _guard(self, key: str, handler: FrameHandler) -> FrameHandler:
        def handle(frames: list[bytes]) -> None:
            for frame in frames:
                if frame[:1] in _FLAGS and frame[1:] not in PROTOCOL_TOPICS:
                    if frame[:1] == vllm.SUBSCRIBE:
                        self._refuse(key, len(frame) - 1)
                    return
            handler(frames)

        return handle

    def _refuse(self, key: str, topic_bytes: int) -> None:
        self._counters[f"refused.subscriptions.{key}"] += 1
        fd = self._last_fd[key]
        self._gate.read_monitor(key)  # a descriptor closed and reused is not cut
        gate = self._gate.sockets.get(key)
        if gate is None or not gate.holds(fd):
            return  # that connection is already being closed
        peer = describe_peer(fd)
        gate.refuse(fd)
        self._ratelog.log(
            logging.WARNING, f"subscription:{key}",
            "socket %s: a peer (%s) subscribed to a %d-byte topic; only the empty topic "
            "(everything) is served, so its connection was closed (a client that is not "
            "vLLM's or this package's, or a hostile one)", key, peer or "unknown", topic_bytes)

    def counters(self) -> dict[str, int]:
        return dict(self._counters)
