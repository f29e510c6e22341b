"""``back_output`` read in batches: every wave message, each engine's newest stats.

Engines push one ``EngineCoreOutputs`` per change of their counts; the
coordinator needs every ``wave_complete`` and ``start_wave``, but of the
statistics only each engine's newest. The generic per-message reader would
decode every report and run it through the core (about 8 µs each); under a
flood most of that is work whose result the next report overwrites.

Theory of operation
-------------------
* **Reading.** The socket's FD is watched with ``loop.add_reader`` and a drain
  runs right in the callback: no task switch per wake-up. A drain takes up to
  ``batch`` messages with NOBLOCK reads, decides what to decode, feeds the core
  and carries out its actions, all before anything else runs, so no other
  socket ever sees half a batch.
* **Coalescing.** Drains start at least ``gap_s`` after the previous one
  ended (``flood_gap_s`` after a full batch). A message arriving after a
  quiet spell is read at once; under steady input the FD wake-ups (the main
  per-message cost at realistic rates) collapse into one drain per
  ``gap_s``; under a flood the reader's share of the loop is bounded and
  every drain is short, so timers and the other sockets get their turn
  within a drain (publishes stay on time). While a drain is pending the FD
  is not watched, so the loop does not spin on it.
* **Superseding.** Within a batch, a stats report is skipped if a later
  report of the same engine in the batch decodes and carries stats and
  nothing else, and if it names no wave newer than the coordinator's (such a
  report moves the coordinator's wave, so its place in the order matters).
  The batch is walked backwards: ``report_peek.peek_engine_index`` reads the
  engine index from the first bytes; an engine that already has a later
  report has its earlier frames checked with ``report_peek.stats_only_wave``
  (the envelope and the reported wave only, the rest of the statistics
  skipped); those it vouches for are not decoded and are counted as
  ``stats.superseded``. Every other frame is decoded in full, and the events
  are fed to the core in arrival order.
* **Step snapshots.** In lockstep the core keeps the rows as they were before
  the first report of a newer (wave, step) when changes are unpublished, and
  publishes that snapshot first (vLLM 0.33's rule). The skipped reports'
  (wave, step) marks are peeked too (``report_peek.stats_only_mark``), and a
  forward pass over the batch replays the snapshot rule on the marks: a
  report stays out only if it neither raises the mark nor finds the rows
  unchanged (so every snapshot decision is the same without it) and is not
  its engine's last report before the batch's last snapshot (which records
  its counts). No publish happens inside a batch, so that snapshot is the only
  one that can go out. Dense groups take no snapshots and skip as above.
  Wave messages, bad frames and each engine's newest statistics are therefore
  handled exactly as one by one; the core ends in the same state and
  publishes the same rows, and only counters about the skipped reports differ
  (docs/OPERATIONS.md, "Stats ingest"). Engine indices outside
  the managed ranks never supersede anything, so each of their frames is
  still dropped and counted.
* **Bad shapes.** A message of several frames is taken off the socket without
  copying its frames and becomes a ``BadFrame`` in its place in the batch
  (``frame_count``, or ``too_large`` past ``max_message_bytes``), as the
  per-message reader would report it.

No message of a batch stays referenced after the drain: the lists are local.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import cast

import zmq

from coordinator.core.actions import Action
from coordinator.core.coordinator import CoordinatorCore
from coordinator.core.dispatch.balancer import step_snapshot, step_state_unchanged
from coordinator.core.events import BadFrame
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.report_peek import peek_engine_index, stats_only_mark, stats_only_wave
from coordinator.server.planes.back_output import decode_frame, frame_count_error

DEFAULT_BATCH = 256
"""Messages per drain: long enough to supersede most of a flood (64 engines at 150k
msgs/s: three in four reports), short enough (about 1 ms of work) that a publish falls
due at most one drain late."""
DEFAULT_GAP_S = 0.001
"""Drains start at least this long after the previous one ended (1 ms: far below the
100 ms publish interval, and a wave message arriving after a quiet spell waits none)."""
FLOOD_GAP_S = 0.00025
"""After a full batch (more is waiting) the next drain follows this soon: under a flood
the reader takes about four fifths of the loop, never all of it."""

BACK_OUTPUT_RCVHWM = 128
"""Messages libzmq queues per engine connection before it stops reading that connection
(vLLM has no bound: four peers pushing stats as fast as they could grew the coordinator
by 240 MB/s). With stats reports of about 500 bytes that is about 128 KiB per
connection (each message costs about 1 KiB of heap), so even 1,024 engines all
flooding hold about 128 MiB. A sender's surplus waits on its own side: vLLM's and the
SDK's PUSH sockets have no send bound, so an engine is never blocked by it, and one
that is drained every millisecond or so, as every engine is in normal operation, never
comes near it."""

# A plain int: pyzmq converts its flag enums on every call.
_NOBLOCK = int(zmq.NOBLOCK)

Pending = bytes | BadFrame


StepState = tuple[tuple[int, int] | None, bool]
"""A lockstep core's step mark and whether its rows changed since the last publish
(``CoordinatorCore.step_state``); None for a dense core, which takes no snapshots."""


def plan_batch(frames: Sequence[Pending], rank_range: range, wave_floor: int,
               steps: StepState | None = None,
               ) -> tuple[list[vllm.EngineReport | BadFrame | None], int]:
    """Each frame's event (None where a stats report is superseded), and how many are.

    Pure: see the module docstring. ``frames`` holds each message's one frame, or
    the ``BadFrame`` it already is; the events are in arrival order. Only reports
    naming a wave up to ``wave_floor`` are skipped (``CoordinatorCore.skippable_wave``),
    and, with ``steps``, only those whose absence changes no step snapshot.
    """
    events: list[vllm.EngineReport | BadFrame | None] = [None] * len(frames)
    later_stats: set[int] = set()
    held: dict[int, tuple[int, int]] = {}
    superseded = 0
    report_type = vllm.EngineReport
    for index in range(len(frames) - 1, -1, -1):
        frame = frames[index]
        if type(frame) is not bytes:  # a BadFrame already
            events[index] = cast(BadFrame, frame)
            continue
        # peek_engine_index's most common case inline (a fixarray, a fixint index).
        if len(frame) > 2 and 0x91 <= frame[0] <= 0x9F and frame[1] < 0x80:
            rank = frame[1]
        else:
            rank = peek_engine_index(frame)
        if rank in later_stats:
            if steps is None:
                if 0 <= stats_only_wave(frame, rank) <= wave_floor:
                    superseded += 1
                    continue
            else:
                mark = stats_only_mark(frame, rank)
                if mark is not None and 0 <= mark[0] <= wave_floor:
                    held[index] = mark
                    continue
        event = decode_frame(frame)
        events[index] = event
        if (type(event) is report_type and event.scheduler_stats is not None
                and event.wave_complete is None and event.start_wave is None
                and event.engine_index in rank_range):
            later_stats.add(event.engine_index)
    if held and steps is not None:
        _keep_what_snapshots_need(frames, events, held, steps, rank_range)
        superseded += len(held)
    return events, superseded


def _applies(event: vllm.EngineReport | BadFrame | None, rank_range: range) -> bool:
    return (type(event) is vllm.EngineReport and event.scheduler_stats is not None
            and event.engine_index in rank_range)


def _keep_what_snapshots_need(
    frames: Sequence[Pending], events: list[vllm.EngineReport | BadFrame | None],
    held: dict[int, tuple[int, int]], steps: StepState, rank_range: range,
) -> None:
    """Decode the held reports a lockstep step snapshot depends on; the rest stay out.

    Replays the table's snapshot rule (``balancer.step_snapshot``, the one that
    ``LoadTable.apply_stats`` applies) over the batch's marks. A held report may stay
    out only if it neither raises the step mark nor finds the rows unchanged (then the
    mark, the changed flag and so every snapshot decision are the same without it
    (``balancer.step_state_unchanged``)), and if it is not its engine's last report
    before the batch's last snapshot (which records that report's counts). No publish
    happens inside a batch, so the last snapshot is the only one that can be sent.
    """
    step_mark, changed = steps
    last_snapshot = -1
    report_type = vllm.EngineReport
    for index in range(len(events)):
        mark = held.get(index)
        if mark is not None:
            if step_state_unchanged(step_mark, changed, mark):
                continue
            del held[index]
            events[index] = decode_frame(frames[index])  # type: ignore[arg-type]
        event = events[index]
        # _applies, inline: this pass looks at every event of the batch.
        if (type(event) is report_type and event.scheduler_stats is not None
                and event.engine_index in rank_range):
            stats = event.scheduler_stats
            report_mark = (stats.current_wave, stats.step_counter)
            step_mark, taken = step_snapshot(step_mark, changed, report_mark)
            if taken:
                last_snapshot = index
            changed = True
    if last_snapshot <= 0 or not held:
        return
    waiting = {peek_engine_index(frames[i]) for i in held if i < last_snapshot}  # type: ignore[arg-type]
    for index in range(last_snapshot - 1, -1, -1):
        if not waiting:
            return
        if index in held:
            rank = peek_engine_index(frames[index])  # type: ignore[arg-type]
            if rank not in waiting:
                continue
            del held[index]
            events[index] = decode_frame(frames[index])  # type: ignore[arg-type]
        event = events[index]
        if _applies(event, rank_range):
            waiting.discard(event.engine_index)  # type: ignore[union-attr]


def multipart_event(first: zmq.Frame, recv: Callable[..., zmq.Frame],
                    max_message_bytes: int) -> BadFrame:
    """Take the rest of a multipart message off the socket, uncopied; its ``BadFrame``."""
    frame = first
    total = len(frame)
    count = 1
    while frame.more:  # a multipart message arrives whole
        frame = recv(copy=False)
        total += len(frame)
        count += 1
    del frame, first
    if total > max_message_bytes:
        return BadFrame("back_output", ProtocolError(
            f"a message of {count} frames and {total} bytes is larger than this socket's "
            f"bound of {max_message_bytes} bytes", reason="too_large"), frame_count=count)
    return frame_count_error(count)


class StatsReader:
    """Drains ``back_output`` in batches into the core; see the module docstring."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        core: CoordinatorCore,
        execute: Callable[[Sequence[Action]], None],
        *,
        clock: Callable[[], float],
        on_error: Callable[[str, BaseException], None],
        max_message_bytes: int,
        batch: int = DEFAULT_BATCH,
        gap_s: float = DEFAULT_GAP_S,
        flood_gap_s: float = FLOOD_GAP_S,
    ) -> None:
        self._sock = sock
        self._core = core
        self._execute = execute
        self._clock = clock
        self._on_error = on_error
        self._max_message_bytes = max_message_bytes
        self._batch = batch
        self._gap_s = gap_s
        self._flood_gap_s = flood_gap_s
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False
        self._pending: asyncio.Handle | None = None
        self._next_drain = 0.0
        self.drains = 0
        """Drains so far (each one FD wake-up or scheduled turn)."""

    def poke(self) -> None:
        """Look at the socket again soon (a safety net; nothing sends on a PULL socket)."""
        if self._loop is not None and self._pending is None:
            self._schedule(0.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._watch()
        # Messages that came before the FD was watched raised no edge: look now.
        self._schedule(0.0)
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

    def _schedule(self, delay: float) -> None:
        if self._loop is None:
            raise RuntimeError('the stats reader is not running')
        self._unwatch()
        if self._pending is None:
            if delay > 0:
                self._pending = self._loop.call_later(delay, self._scheduled_drain)
            else:
                self._pending = self._loop.call_soon(self._scheduled_drain)

    def _on_readable(self) -> None:
        if self._loop is None:
            raise RuntimeError('the stats reader is not running')
        wait = self._next_drain - self._loop.time()
        if wait > 0:
            self._schedule(wait)
        else:
            self._drain()

    def _scheduled_drain(self) -> None:
        self._pending = None
        self._drain()

    def _drain(self) -> None:
        if self._loop is None:
            raise RuntimeError('the stats reader is not running')
        full = False
        try:
            full = self.read_batch() >= self._batch
        except Exception as exc:  # a bug must not stop the socket
            self._on_error("back_output", exc)
        finally:
            self._next_drain = self._loop.time() + self._gap_s
            if full:
                self._schedule(self._flood_gap_s)  # more is waiting
            elif self._pending is None:
                self._watch()

    # ---- one batch -------------------------------------------------------------------------

    def read_batch(self) -> int:
        """Read up to a batch, feed the core, carry out its actions; return messages read."""
        self.drains += 1
        frames = self._receive()
        if not frames:
            return 0
        core = self._core
        events, superseded = plan_batch(frames, core.rank_range, core.skippable_wave(),
                                        core.step_state())
        now = self._clock()
        on_report, handle, execute = core.on_engine_report, core.handle, self._execute
        report_type = vllm.EngineReport
        for event in events:
            if event is None:
                continue
            try:
                if type(event) is report_type:
                    actions = on_report(event, now)
                else:
                    actions = handle(event, now)
                if actions:
                    execute(actions)
            except Exception as exc:  # a bug must not stop the socket
                self._on_error("back_output", exc)
        if superseded:
            core.note_stats_superseded(superseded)
        return len(frames)

    def _receive(self) -> list[Pending]:
        recv = self._sock.recv
        frames: list[Pending] = []
        append = frames.append
        for _ in range(self._batch):
            try:
                # copy=False gives the "more" flag with the frame, saving a
                # getsockopt(RCVMORE) per message.
                frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            if frame.more:
                append(multipart_event(frame, recv, self._max_message_bytes))
            else:
                append(frame.bytes)
        return frames
