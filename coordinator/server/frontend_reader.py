"""``frontend`` read in batches, right in the FD callback, payloads passed through.

A frontend pipelines submits: under load many wait on the socket at each
wake-up. The generic ``FrameReader`` wakes an asyncio task per burst, copies
every frame into ``bytes`` and has the server look at each socket it sent on
after every message; at the rates of the ``dispatch`` benchmark those are
most of a submit's cost outside the core.

Theory of operation
-------------------
* **Reading.** The socket's FD is watched with ``loop.add_reader`` and a drain
  runs in the callback: no task switch. A drain takes up to ``batch`` messages
  with NOBLOCK reads; a full batch hands the loop back (``call_soon``) so that
  timers and the other sockets get their turn. The FD stays watched (there is
  no wait between drains to spin through), and nothing waits for a batch to
  fill: a message is read at once.
* **Per message, in arrival order.** Each message is taken off the socket,
  decoded, given to the core and its actions carried out (``run``) before the
  next message is read. So the core hears an outcome (a failed ADD) before the
  next request, exactly as one by one, and a submit that wakes the group has
  its ADD sent and its START_DP_WAVE published before anything after it in the
  drain is even read: batching never delays a wave's first request.
* **Once per drain.** The look at each socket sent on for a swallowed read
  edge (``settle``; see ``FrameReader``), the clock for the decision sample,
  the loop's bookkeeping. The replies of a drain leave in one pass of the
  loop, one after the other on the same socket.
* **No copies.** The identity is needed as ``bytes`` (a dictionary key), and
  the header is decoded straight from its frame's buffer; the payload frames
  stay ``zmq.Frame`` objects and are handed to the dispatch socket as they
  are, so a 1 MB payload costs no 1 MB copy.
* **Size bound and CURVE.** A message whose frames together pass
  ``max_message_bytes`` is not decoded: the frames before the bound (identity
  and header) go to ``on_oversize`` as ``bytes``, the rest are released. With
  ``curve``, each message carries its connection's ``User-Id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import cast

import zmq

from coordinator.core.actions import Action
from coordinator.core.coordinator import CoordinatorCore
from coordinator.core.events import BadFrame, FrontendRequestReceived
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError
from coordinator.server.feeders import DECISION_SAMPLE_SPACING_S
from coordinator.server.transport import OversizeHandler, peer_user_id

DEFAULT_BATCH = 128
"""Messages per drain, as the generic reader takes: a full drain is a few milliseconds
of work (about 30 µs a submit in the serving process), so a wave message on another
socket or a publish falling due waits at most that long; the per-drain costs are
already under 1% of a submit at this size."""

# A plain int: pyzmq converts its flag enums on every call.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class FrontendReader:
    """Drains ``frontend`` into the core from the FD callback; see the module docstring."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        core: CoordinatorCore,
        run: Callable[[Sequence[Action]], None],
        settle: Callable[[], None],
        *,
        clock: Callable[[], float],
        on_error: Callable[[str, BaseException], None],
        on_oversize: OversizeHandler,
        observe_decision: Callable[[float], None],
        max_message_bytes: int,
        curve: bool = False,
        batch: int = DEFAULT_BATCH,
    ) -> None:
        self._sock = sock
        self._core = core
        self._run = run
        self._settle = settle
        self._clock = clock
        self._on_error = on_error
        self._on_oversize = on_oversize
        self._observe_decision = observe_decision
        self._max_message_bytes = max_message_bytes
        self._curve = curve
        self._batch = batch
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False
        self._pending: asyncio.Handle | None = None
        self._next_timed = 0.0
        self.drains = 0
        """Drains so far (each one FD wake-up or scheduled turn)."""
        self.oversize_dropped = 0

    def poke(self) -> None:
        """Look at the socket again soon (after a send on it elsewhere)."""
        if self._loop is not None and self._pending is None:
            self._schedule()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._watch()
        # Messages that came before the FD was watched raised no edge: look now.
        self._schedule()
        try:
            await loop.create_future()  # drains run from loop callbacks until cancelled
        finally:
            self._unwatch()
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None
            self._loop = None

    # ---- scheduling ------------------------------------------------------------------------

    def _watch(self) -> None:
        if not self._watching and self._loop is not None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._fd)
            self._watching = False

    def _schedule(self) -> None:
        if self._loop is None:
            raise RuntimeError("the frontend reader is not running")
        if self._pending is None:
            self._pending = self._loop.call_soon(self._scheduled_drain)

    def _on_readable(self) -> None:
        # The FD stays watched throughout (uvloop makes a poll handle per add_reader, too
        # dear to flap per drain); a drain already due reads whatever raised the edge.
        if self._pending is None:
            self._drain()

    def _scheduled_drain(self) -> None:
        self._pending = None
        self._drain()

    def _drain(self) -> None:
        full = False
        try:
            full = self.read_batch() >= self._batch
        except Exception as exc:  # a bug must not stop the socket
            self._on_error("frontend", exc)
        finally:
            if full:
                self._schedule()  # more is waiting: after the loop's other work
            # After the drain's sends: a reply may have swallowed a read edge.
            try:
                self._settle()
            except Exception as exc:
                self._on_error("frontend", exc)

    # ---- one batch -------------------------------------------------------------------------

    def read_batch(self) -> int:
        """Read, decide and carry out up to a batch of messages; return how many were read."""
        self.drains += 1
        recv, sock_get = self._sock.recv, self._sock.get
        events, pollin = _EVENTS, _POLLIN
        handle, run, on_error = self._core.handle, self._run, self._on_error
        group_paused = self._core.group_paused
        limit = self._max_message_bytes
        curve = self._curve
        request_type = FrontendRequestReceived
        submit_type, route_type = fp.Submit, fp.Route
        now = self._clock()
        count = 0
        while count < self._batch:
            # After a first message, ask whether another waits rather than let a receive
            # fail: an EAGAIN costs pyzmq an exception (2.7 µs against 0.9), and at
            # ordinary rates a drain holds one request.
            if count == 1 and not int(sock_get(events)) & pollin:
                break
            try:
                # copy=False gives the "more" flag with the frame, saving a
                # getsockopt(RCVMORE) per frame.
                first = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            count += 1
            try:
                user_id = peer_user_id(first) if curve else None
                event = self._take(first, recv, limit, user_id)
                if event is None:
                    continue
                # A wave's first request is never timed: reading the thread's CPU clock
                # is a system call (a point where a busy host preempts) before its wake.
                if (type(event) is request_type and now >= self._next_timed and (
                        type(event.message) is route_type or (
                            type(event.message) is submit_type and not group_paused()))):
                    actions = self._timed(event, now)
                else:
                    actions = handle(event, now)
                if actions:
                    run(actions)
            except Exception as exc:  # a bug must not stop the socket
                on_error("frontend", exc)
        return count

    def _timed(self, event: FrontendRequestReceived, now: float) -> Sequence[Action]:
        """``handle`` with the loop thread's CPU time observed (``DecisionTimes``)."""
        self._next_timed = now + DECISION_SAMPLE_SPACING_S
        started = time.thread_time()
        actions = self._core.handle(event, now)
        self._observe_decision(time.thread_time() - started)
        return actions

    def _take(self, first: zmq.Frame, recv: Callable[..., zmq.Frame], limit: int,
              user_id: str | None) -> FrontendRequestReceived | BadFrame | None:
        """The rest of the message that ``first`` opens, as the core's event; None if it
        passed the size bound (then ``on_oversize`` has heard of it)."""
        identity = first.bytes
        if not first.more:
            return BadFrame("frontend", ProtocolError("got 1 frames", reason="frame_count"),
                            identity=identity, frame_count=1)
        header = recv(copy=False)
        total = len(first) + len(header)
        payload: list[zmq.Frame] = []
        frame = header
        while frame.more:  # a multipart message arrives whole
            frame = recv(copy=False)
            total += len(frame)
            payload.append(frame)
        del frame
        if total > limit:
            self._oversize(identity, header, payload, total, limit)
            return None
        try:
            message = fp.decode_header(cast(bytes, header), len(payload))
        except ProtocolError as exc:
            # The call id, when readable, lets the frontend match the error to its call.
            return BadFrame("frontend", exc, identity=identity, frame_count=2 + len(payload),
                            call_id=fp.salvage_call_id(header.bytes))
        return FrontendRequestReceived(identity, message, cast(list[bytes], payload),
                                       "frontend", user_id)

    def _oversize(self, identity: bytes, header: zmq.Frame, payload: list[zmq.Frame],
                  total: int, limit: int) -> None:
        # As FrameReader keeps them: the frames read before the bound was passed.
        kept = [identity]
        running = len(identity)
        for frame in (header, *payload):
            running += len(frame)
            if running > limit:
                break
            kept.append(frame.bytes)
        self.oversize_dropped += 1
        try:
            self._on_oversize(kept, total, 2 + len(payload))
        except Exception as exc:
            self._on_error("frontend", exc)
