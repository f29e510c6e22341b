"""Frame handlers: each socket's frames become events for the core, whose actions are
carried out at once.

A handler is a closure over the core's ``handle``, the clock and the server's
executor; it decides nothing. Facts a socket's reader learns about a message just
before handing it over (its connection, its peer's CURVE key or address) are kept
here for the decoder to attach.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from coordinator.core.actions import Action, SocketName
from coordinator.core.coordinator import CoordinatorCore
from coordinator.core.events import Event, FrontendRequestReceived
from coordinator.core.ranks.authority import Channel
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.server.connections import PeerConnections
from coordinator.server.observe import DecisionTimes
from coordinator.server.planes import DECODERS, SOURCED_DECODERS, Decoder, dispatch
from coordinator.server.planes import frontend as frontend_plane
from coordinator.server.planes.oversize import oversize_event
from coordinator.server.transport import FrameHandler, OversizeHandler

DECISION_SAMPLE_SPACING_S = 0.005
"""Submits and route calls timed for ``DecisionTimes``: each one that comes at least 5 ms
after the last one timed, so every call at ordinary rates and at most 200 a second under
a flood. Reading a thread's CPU clock is a system call: about 1 µs alone, but measured at
25 µs inside the serving process on a busy virtual machine; timing every call of a
flood halved dispatch throughput."""


class Feeders:
    """Builds the handler of each socket and keeps what readers learn of a message."""

    def __init__(self, core: CoordinatorCore, clock: Callable[[], float],
                 execute: Callable[[Sequence[Action]], None], decision_times: DecisionTimes,
                 connections: Mapping[str, PeerConnections]) -> None:
        self._core = core
        self._clock = clock
        self._execute = execute
        self._decision_times = decision_times
        self._connections = connections
        self.frontend_user_id: str | None = None
        """The CURVE key of the ``frontend`` message being read (``FrameReader.on_peer``)."""
        self.dispatch_peer: str | None = None
        """The address of the ``dispatch`` message's peer (``FrameReader.on_address``)."""

    def handlers(self) -> dict[str, FrameHandler]:
        """One handler per socket, the operators' ``admin`` socket included."""
        handlers = {key: self.plain(decode) for key, decode in DECODERS.items()}
        handlers["back_output"] = self.stats()
        for key in SOURCED_DECODERS:
            handlers[key] = self.sourced(key)
        handlers["frontend"] = self.frontend("frontend")
        handlers["admin"] = self.frontend("admin")
        return handlers

    def feed(self, event: Event) -> None:
        self._execute(self._core.handle(event, self._clock()))

    def on_frontend_peer(self, user_id: str | None) -> None:
        self.frontend_user_id = user_id

    def on_dispatch_peer(self, address: str | None) -> None:
        self.dispatch_peer = address

    def plain(self, decode: Decoder) -> FrameHandler:
        handle, clock, execute = self._core.handle, self._clock, self._execute

        def on_frames(frames: list[bytes]) -> None:
            actions = handle(decode(frames), clock())
            if actions:
                execute(actions)

        return on_frames

    def oversize(self, key: str, limit: int) -> OversizeHandler:
        """A message past ``key``'s size bound: the core counts it and answers if it can."""
        socket = cast(SocketName, key)

        def on_oversize(kept: list[bytes], total: int, frame_count: int) -> None:
            self.feed(oversize_event(socket, kept, total, frame_count, limit))

        return on_oversize

    def frontend(self, channel: Channel) -> FrameHandler:
        """``frontend`` and ``admin``: the request with its channel and the peer's CURVE key
        (``User-Id``, read by the socket's reader just before); submits and route calls
        are timed (``DecisionTimes``)."""
        handle, clock, execute = self._core.handle, self._clock, self._execute
        observe, timed = self._decision_times.observe, (fp.Submit, fp.Route)
        cpu_time = time.thread_time
        request_type = FrontendRequestReceived
        decode = frontend_plane.decode
        spacing = DECISION_SAMPLE_SPACING_S
        next_timed = 0.0

        def on_frames(frames: list[bytes]) -> None:
            nonlocal next_timed
            user_id = self.frontend_user_id if channel == "frontend" else None
            event = decode(frames, channel, user_id)
            now = clock()
            if type(event) is request_type and type(event.message) in timed and (
                    now >= next_timed):
                next_timed = now + spacing
                started = cpu_time()
                actions = handle(event, now)
                observe(cpu_time() - started)
            else:
                actions = handle(event, now)
            if actions:
                execute(actions)

        return on_frames

    def stats(self) -> FrameHandler:
        """``back_output`` one message at a time, straight to the core's stats handler
        (the server reads it in batches with ``StatsReader``; this serves tests)."""
        decode = DECODERS["back_output"]
        handle, on_report = self._core.handle, self._core.on_engine_report
        clock, execute, report_type = self._clock, self._execute, vllm.EngineReport

        def on_frames(frames: list[bytes]) -> None:
            event = decode(frames)
            if type(event) is report_type:
                actions = on_report(event, clock())
            else:
                actions = handle(event, clock())
            if actions:
                execute(actions)

        return on_frames

    def sourced(self, key: str) -> FrameHandler:
        """``handshake`` and ``dispatch``: each event names the connection it came on."""
        decode, handle = SOURCED_DECODERS[key], self._core.handle
        clock, execute = self._clock, self._execute
        if key == "dispatch":
            # With the engine's host, read just before (tcp only): where its KV event
            # publisher is, when the greeting names no host.
            def decode(frames: list[bytes], conn: int) -> Event:
                return dispatch.decode(frames, conn, self.dispatch_peer)

        def on_frames(frames: list[bytes]) -> None:
            connections = self._connections.get(key)
            actions = handle(decode(frames, connections.current if connections else 0),
                             clock())
            if actions:
                execute(actions)
            if connections is not None:
                connections.message_done()

        return on_frames
