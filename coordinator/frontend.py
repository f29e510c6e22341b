"""Frontend SDK: register with the coordinator, submit and abort requests, follow state.

    client = FrontendClient(addresses, client_index=0)
    await client.start()            # bind the output PULL, connect to the coordinator
    await client.register()
    sub = await client.submit("req-1", [payload])     # -> Submitted(rank=..., woke=...)
    async for done in client.finished():               # engine outputs, by request id
        ...
    await client.close()

Sockets, all owned by one client:

* a PULL bound for engine outputs (ipc in a private temp dir, or tcp on `host`
  with a free port); its address goes to the coordinator in `Register`, and the
  coordinator passes it to every engine in INIT;
* a DEALER connected to the coordinator's `frontend` ROUTER, carrying this
  project's frontend protocol (`coordinator.protocol.frontend`). Every request
  has a fresh call id and its reply is matched by that id, so calls may run
  concurrently; unsolicited notices (`RequestsFailed`, `RankDrained`,
  `ShuttingDown`) arrive on the same socket and go to `notices()` / `on_notice`;
* an XSUB connected to `front_publish` (subscribed with the single frame
  `b"\\x01"`), from which the client learns `wave`, `running` and per-rank
  `counts`. Like a vLLM frontend it drains every pending publish and keeps only
  the newest, so a slow reader never acts on old state.

With `curve_secret_key` and `curve_server_key` the DEALER and the XSUB are CURVE
clients of the coordinator when they connect over TCP (the coordinator encrypts
its tcp sockets only). The output PULL is this client's own socket and stays
plain: engines connect to it without keys.

Engine outputs arriving on the PULL are scanned for finished requests (vLLM's
`finished_requests` set, and outputs whose `finish_reason` is set). Their ids are
reported to the user and, in batches, to the coordinator with `Finished`, which
frees the coordinator's routing entry for each.

Every wait is bounded: each call takes a `timeout` (default `call_timeout_s`) and
raises `CoordinatorTimeout` when the coordinator does not answer in time (naming a
failed handshake, such as a wrong server key, if there was one). A refused CURVE
key, or keys on one side only, raises `HandshakeFailed` at once instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from coordinator._zmq import (
    CLIENT,
    OUTPUTS,
    CurveClientKeys,
    HandshakeMonitor,
    bind,
    connect_monitored,
)
from coordinator.frontend_support import (
    FIRST_HEARTBEAT_S,
    OUTPUT_DRAIN_TURNS,
    AdminError,
    CoordinatorTimeout,
    EngineDead,
    FinishedRequest,
    FrontendClosed,
    FrontendError,
    HandshakeFailed,
    InvalidRequest,
    Notice,
    OperatorChannel,
    RegisterError,
    ReplyError,
    SubmitError,
    handshake_failure,
    heartbeat_frames,
    lost_requests,
    raise_if_refused,
    undeliverable_warning,
)
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.addresses import tcp_endpoint
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.frontend import group_state_to_builtins

__all__ = [
    "AdminError",
    "CoordinatorTimeout",
    "EngineDead",
    "FinishedRequest",
    "FrontendClient",
    "FrontendClosed",
    "FrontendError",
    "HandshakeFailed",
    "InvalidRequest",
    "Notice",
    "RegisterError",
    "ReplyError",
    "SubmitError",
    "group_state_to_builtins",
]

log = logging.getLogger("coordinator.frontend")

# Ids per Finished message: the protocol's bound on one list.
_FINISHED_BATCH = fp.MAX_ABORT_IDS
# Finished ids kept while the coordinator does not take them, and the retry pause.
_MAX_UNREPORTED = 1 << 20
_REPORT_RETRY_S = 0.1


_T = TypeVar("_T")


class FrontendClient:
    """One frontend's connection to a coordinator (one asyncio loop, not thread-safe).

    Parameters:
        addresses: the coordinator's address map (keys `frontend`, `front_publish`;
            the JSON of its address file).
        client_index: this frontend's index; engines push its outputs to
            `outputs[client_index]` of INIT.
        host: bind the output PULL on `tcp://host:<free port>`; None binds ipc in a
            private temp directory (`ipc_dir` to choose the directory).
        call_timeout_s: default bound on every call.
        finished_flush_s: `Finished` batches go out at most this long after the
            first id of the batch was seen.
        on_finished: called for every finished request; when None, finished
            requests queue up for `finished()` (at most `max_queued` of them).
        on_notice: called for every unsolicited notice; when None they queue up
            for `notices()`.
        on_publish: called after each publish was applied, with the client.
        on_outputs: called with every decoded `EngineCoreOutputs` an engine sent to
            this client and the `time.monotonic()` it was read at (token outputs,
            scheduler stats, utility results), before finished requests are handled.
        context: a zmq.asyncio.Context to share; by default the client owns one.
        curve_secret_key: path of this frontend's secret key file (`NAME.key_secret`
            from `dp-coordinator keygen`); with `curve_server_key`, the sockets to the
            coordinator use CURVE over TCP. Give both or neither.
        curve_server_key: path of the coordinator's public key file (`NAME.key`).
    """

    def __init__(
        self,
        addresses: Mapping[str, str],
        *,
        client_index: int = 0,
        host: str | None = None,
        ipc_dir: str | None = None,
        call_timeout_s: float = 5.0,
        finished_flush_s: float = 0.01,
        on_finished: Callable[[FinishedRequest], None] | None = None,
        on_notice: Callable[[Notice], None] | None = None,
        on_publish: Callable[[FrontendClient], None] | None = None,
        on_outputs: Callable[[vllm.EngineCoreOutputs, float], None] | None = None,
        max_queued: int = 1 << 20,
        context: zmq.asyncio.Context | None = None,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
    ) -> None:
        missing = [key for key in ("frontend", "front_publish") if key not in addresses]
        if missing:
            raise ValueError(f"coordinator addresses lack {', '.join(missing)}")
        self.curve = CurveClientKeys.from_options(curve_secret_key, curve_server_key)
        self.frontend_address = addresses["frontend"]
        self.publish_address = addresses["front_publish"]
        #: The coordinator's owner-only operator socket, when the addresses name it.
        self.admin_address = addresses.get("admin")
        self.client_index = client_index
        self.host = host
        self.call_timeout_s = call_timeout_s
        self.finished_flush_s = finished_flush_s
        self.on_finished = on_finished
        self.on_notice = on_notice
        self.on_publish = on_publish
        self.on_outputs = on_outputs

        self._owns_context = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._ipc_dir = ipc_dir
        self._owns_ipc_dir = False

        self.output_address = ""
        #: What Registered said; None before `register()` succeeded.
        self.registered: fp.Registered | None = None
        #: Request ids submitted by this client and not yet finished/aborted/failed -> rank.
        self.in_flight: dict[str, int] = {}
        #: Event counts: publishes, bad input by reason, finished, notices, ...
        self.stats: Counter[str] = Counter()

        self._wave = 0
        self._running = False
        self._counts: list[tuple[int, int, float]] | None = None
        self._publish_seen = asyncio.Event()

        self._dealer: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer_handshakes: HandshakeMonitor | None = None
        self._sub_handshakes: HandshakeMonitor | None = None
        self._pending: dict[int, asyncio.Future[fp.FrontendReply]] = {}
        self._call_ids = itertools.count(1)
        self._finished_q: asyncio.Queue[FinishedRequest] = asyncio.Queue(max_queued)
        self._notice_q: asyncio.Queue[Notice] = asyncio.Queue(max_queued)
        self._to_report: list[str] = []
        # Submits awaiting their reply (by request id), and which of those already finished.
        self._submitting: dict[str, int] = {}
        self._finished_early: set[str] = set()
        self._report_due = asyncio.Event()
        # Ranks whose outputs arrived since the last heartbeat, and its interval.
        self._progress: set[int] = set()
        self.heartbeat_s = FIRST_HEARTBEAT_S
        self._tasks: list[asyncio.Task[None]] = []
        self._operator: OperatorChannel | None = None
        self._started = False
        self._closed = False

    # ------------------------------------------------------------ state

    @property
    def wave(self) -> int:
        """The newest wave number the coordinator published (stamped on submits)."""
        return self._wave

    @property
    def running(self) -> bool:
        """Whether the coordinator last said the group is running a wave."""
        return self._running

    @property
    def counts(self) -> list[tuple[int, int, float]] | None:
        """Per-rank `(waiting, running, kv_cache_usage)` from the last full publish."""
        return self._counts

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the output socket and connect to the coordinator (no messages yet)."""
        if self._closed:
            raise FrontendClosed("the client is closed")
        if self._started:
            return
        try:
            self._open_sockets()
        except BaseException:
            await self.close()
            raise
        self._started = True
        self._spawn(self._dealer_loop(), "dealer")
        self._spawn(self._pull_loop(), "outputs")
        self._spawn(self._publish_loop(), "publishes")
        self._spawn(self._report_loop(), "finished")
        self._spawn(self._handshake_loop(), "handshakes")
        self._spawn(self._heartbeat_loop(), "heartbeat")

    def _open_sockets(self) -> None:
        if self.host is None:
            if self._ipc_dir is None:
                self._ipc_dir = tempfile.mkdtemp(prefix="dp-frontend-")
                self._owns_ipc_dir = True
            endpoint = f"ipc://{os.path.join(self._ipc_dir, f'outputs-{self.client_index}')}"
        else:
            endpoint = tcp_endpoint(self.host)
        self._pull, self.output_address = bind(self._ctx, zmq.PULL, endpoint, OUTPUTS)
        # A fixed identity survives reconnects (a restarted coordinator sees the same
        # peer), so failure notices for requests sent earlier still find this client.
        self._dealer, self._dealer_handshakes = connect_monitored(
            self._ctx, zmq.DEALER, self.frontend_address, CLIENT,
            identity=b"fe" + uuid.uuid4().bytes[:8], curve=self.curve)
        self._sub, self._sub_handshakes = connect_monitored(
            self._ctx, zmq.XSUB, self.publish_address, CLIENT, curve=self.curve)

    async def close(self, timeout: float = 1.0) -> None:
        """Report pending finished ids (best effort), stop, close every socket."""
        if self._closed:
            return
        self._closed = True
        if self._dealer is not None and self._to_report:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush_finished(), timeout)
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for future in self._pending.values():
            if not future.done():
                future.set_exception(FrontendClosed("the client was closed"))
        self._pending.clear()
        for monitor in (self._dealer_handshakes, self._sub_handshakes):
            if monitor is not None:
                monitor.close()
        for sock in (self._dealer, self._pull, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._dealer = self._pull = self._sub = None
        if self._operator is not None:
            self._operator.close()
            self._operator = None
        if self._owns_context:
            self._ctx.term()
        if self._owns_ipc_dir and self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def __aenter__(self) -> FrontendClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(f"frontend-{self.client_index}-{name}")
        self._tasks.append(task)

    # ------------------------------------------------------------ calls

    async def register(self, *, timeout: float | None = None) -> fp.Registered:
        """Register this frontend (client index and output address); starts the client."""
        await self.start()
        reply = await self._call(
            lambda call_id: [fp.encode(fp.Register(call_id, self.client_index,
                                                   self.output_address))],
            "register", timeout, RegisterError,
        )
        registered = _expect(reply, fp.Registered, "register")
        self.registered = registered
        if registered.undeliverable_ranks:
            log.warning("%s", undeliverable_warning(registered))
        if self.stats["publishes"] == 0:
            self._wave, self._running = registered.wave, registered.running
        return registered

    async def submit(
        self,
        request_id: str,
        payload_frames: Sequence[bytes],
        *,
        dp_rank: int | None = None,
        wave: int | None = None,
        timeout: float | None = None,
    ) -> fp.Submitted:
        """Send one request (payload frames go to the engine untouched).

        The header carries `wave` (by default the newest published wave), which the
        coordinator uses to tell a stale first request from a current one.
        Raises SubmitError with the coordinator's code when it refuses.
        """
        if not payload_frames:
            raise ValueError("submit needs at least one payload frame")
        stamped = self._wave if wave is None else wave
        frames = list(payload_frames)
        self._submitting[request_id] = self._submitting.get(request_id, 0) + 1
        try:
            reply = await self._call(
                lambda call_id: [fp.encode(fp.Submit(call_id, request_id, stamped, dp_rank)),
                                 *frames],
                f"submit {request_id!r}", timeout, SubmitError,
            )
        finally:
            left = self._submitting.pop(request_id, 1) - 1
            if left > 0:
                self._submitting[request_id] = left
            finished_early = request_id in self._finished_early
            if not left:
                self._finished_early.discard(request_id)
        submitted = _expect(reply, fp.Submitted, "submit")
        if not finished_early:
            # The engine's output can overtake the coordinator's reply; such a
            # request is already done and must not linger in `in_flight`.
            self.in_flight[submitted.request_id] = submitted.rank
        self.stats["submitted"] += 1
        if submitted.woke:
            self.stats["submits_that_woke"] += 1
        return submitted

    async def abort(self, request_ids: Sequence[str], *,
                    timeout: float | None = None) -> list[str]:
        """Abort requests; returns the ids the coordinator routed to an engine."""
        routed: list[str] = []
        ids = list(request_ids)
        for start in range(0, max(1, len(ids)), fp.MAX_ABORT_IDS):
            chunk = ids[start:start + fp.MAX_ABORT_IDS]
            reply = await self._call(_abort_builder(chunk), "abort", timeout, AdminError)
            routed += _expect(reply, fp.Aborted, "abort").request_ids
            for request_id in chunk:
                self.in_flight.pop(request_id, None)
        return routed

    async def query_state(self, *, timeout: float | None = None) -> fp.GroupState:
        """The coordinator's view of the group: membership, loads, wave, counters."""
        reply = await self._call(
            lambda call_id: [fp.encode(fp.QueryState(call_id))], "state query", timeout,
            AdminError,
        )
        return _expect(reply, fp.StateReply, "state query").state

    async def admin(self, command: fp.AdminCommand, rank: int, *,
                    timeout: float | None = None) -> fp.AdminDone:
        """Cordon, uncordon or drain one rank; raises AdminError when refused.

        Admin commands need an operator (docs/OPERATIONS.md): without CURVE keys they go
        to the coordinator's owner-only `admin` socket when the addresses name it (this
        process must run as the coordinator's user); with keys, to the frontend socket,
        where the key must be one of the coordinator's admin keys.
        """
        if self.curve is None and self.admin_address is not None and not self._closed:
            if self._operator is None:
                self._operator = OperatorChannel(self._ctx, self.admin_address)
            return await self._operator.command(command, rank, call_id=next(self._call_ids),
                                                timeout_s=timeout or self.call_timeout_s)
        reply = await self._call(
            lambda call_id: [fp.encode(fp.Admin(call_id, command, rank))],
            f"admin {command} {rank}", timeout, AdminError,
        )
        return _expect(reply, fp.AdminDone, "admin")

    async def _call(
        self,
        build: Callable[[int], list[bytes]],
        what: str,
        timeout: float | None,
        error: type[ReplyError],
    ) -> fp.FrontendReply:
        if self._closed:
            raise FrontendClosed("the client is closed")
        if not self._started:
            await self.start()
        dealer = self._dealer
        if dealer is None:
            raise FrontendClosed("the client is closed")
        raise_if_refused(self._dealer_handshakes)
        limit = self.call_timeout_s if timeout is None else timeout
        call_id = next(self._call_ids)
        frames = build(call_id)
        try:
            # The coordinator would answer an out-of-bounds value with a `bad_frame`
            # error it cannot tie to this call; say what is wrong here instead.
            fp.decode_request(frames)
        except ProtocolError as exc:
            raise InvalidRequest(f"{what}: {exc.message}") from None
        future: asyncio.Future[fp.FrontendReply] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        deadline = time.monotonic() + limit
        try:
            try:
                await asyncio.wait_for(dealer.send_multipart(frames), limit)
                reply = await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.stats["timeouts"] += 1
                raise CoordinatorTimeout(what, limit, handshake_failure(self._dealer_handshakes)) \
                    from None
        finally:
            self._pending.pop(call_id, None)
        if isinstance(reply, fp.ErrorReply):
            raise error(reply.code, reply.message, reply.request_id)
        return reply

    # ------------------------------------------------------------ waiting for state

    async def wait_for(self, predicate: Callable[[FrontendClient], bool], *,
                       timeout: float | None = None) -> None:
        """Wait until `predicate(self)` holds after some publish (or already holds)."""
        limit = self.call_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not predicate(self):
            raise_if_refused(self._sub_handshakes)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorTimeout("a publish matching the condition", limit,
                                         handshake_failure(self._sub_handshakes))
            self._publish_seen.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._publish_seen.wait(), remaining)

    # ------------------------------------------------------------ finished and notices

    async def finished(self, *, idle_timeout: float | None = None
                       ) -> AsyncIterator[FinishedRequest]:
        """Finished requests as they arrive (only when no `on_finished` callback is set).

        Ends when the client closes, or after `idle_timeout` seconds with nothing new.
        """
        async for item in self._drain(self._finished_q, idle_timeout):
            yield item

    async def notices(self, *, idle_timeout: float | None = None) -> AsyncIterator[Notice]:
        """Unsolicited notices (only when no `on_notice` callback is set)."""
        async for item in self._drain(self._notice_q, idle_timeout):
            yield item

    def notices_nowait(self) -> list[Notice]:
        """Every queued notice, without waiting."""
        return _take_all(self._notice_q)

    def finished_nowait(self) -> list[FinishedRequest]:
        """Every queued finished request, without waiting."""
        return _take_all(self._finished_q)

    async def _drain(self, queue: asyncio.Queue[_T], idle_timeout: float | None
                     ) -> AsyncIterator[_T]:
        while not self._closed:
            try:
                if idle_timeout is None:
                    # Wake up now and then to notice close().
                    item = await asyncio.wait_for(queue.get(), 0.5)
                else:
                    item = await asyncio.wait_for(queue.get(), idle_timeout)
            except asyncio.TimeoutError:
                if idle_timeout is None:
                    continue
                return
            yield item

    def _notice(self, notice: Notice) -> None:
        self.stats[f"notice.{type(notice).__name__}"] += 1
        if self.on_notice is not None:
            try:
                self.on_notice(notice)
            except Exception:
                log.exception("on_notice callback failed")
            return
        _put(self._notice_q, notice, self.stats, "notices_dropped")

    # ------------------------------------------------------------ handshakes

    async def _handshake_loop(self) -> None:
        """Fail waiting calls at once when a handshake with the coordinator fails for good."""
        monitors = [m for m in (self._dealer_handshakes, self._sub_handshakes) if m is not None]
        poller = zmq.asyncio.Poller()
        for monitor in monitors:
            poller.register(monitor.socket, zmq.POLLIN)
        while monitors:
            await poller.poll()
            for monitor in list(monitors):
                failure = monitor.poll()
                if failure is None or not failure.final:
                    continue
                monitors.remove(monitor)  # libzmq gave this connection up: said once
                poller.unregister(monitor.socket)
                self.stats[f"handshake_failed.{failure.kind}"] += 1
                log.warning("frontend %d: %s", self.client_index, failure.message)
                if monitor is self._dealer_handshakes:
                    for future in self._pending.values():
                        if not future.done():
                            future.set_exception(HandshakeFailed(failure))
                else:
                    self._publish_seen.set()  # wait_for() looks again and raises

    # ------------------------------------------------------------ readers

    async def _dealer_loop(self) -> None:
        dealer = self._dealer
        if dealer is None:
            return
        while True:
            frames = await dealer.recv_multipart()
            if len(frames) != 1:
                self.stats["bad_reply.frame_count"] += 1
                continue
            try:
                reply = fp.decode_reply(frames[0])
            except ProtocolError as exc:
                self.stats[f"bad_reply.{exc.reason}"] += 1
                log.warning("frontend %d: unreadable coordinator reply: %s",
                            self.client_index, exc)
                continue
            if isinstance(reply, fp.RankLost):
                await self._on_rank_lost(reply)
                continue
            self._on_reply(reply)

    async def _on_rank_lost(self, lost: fp.RankLost) -> None:
        """Fail what this client sent to a lost rank and has not seen finish (the ones the
        coordinator knew of came in `RequestsFailed` first); queued outputs are read first."""
        self.stats["ranks_lost"] += 1
        pull = self._pull
        for _ in range(OUTPUT_DRAIN_TURNS):
            # The output reader takes what is queued while this one yields.
            if pull is None or not int(pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                break
            await asyncio.sleep(0)
        failed = lost_requests(self.in_flight, lost)
        if failed is not None:
            self.stats["requests_failed"] += len(failed.request_ids)
            self._notice(failed)

    def _on_reply(self, reply: fp.FrontendReply) -> None:
        if isinstance(reply, fp.RequestsFailed):
            for request_id in reply.request_ids:
                self.in_flight.pop(request_id, None)
            self.stats["requests_failed"] += len(reply.request_ids)
            self._notice(reply)
            return
        if isinstance(reply, (fp.RankDrained, fp.ShuttingDown)):
            self._notice(reply)
            return
        if isinstance(reply, fp.RankLost):
            return  # handled by the reader, which can wait for the output socket
        future = self._pending.get(reply.call_id)
        if future is None:
            if isinstance(reply, fp.ErrorReply):
                # Call id 0: the coordinator could not read one of our messages.
                self._notice(reply)
            else:
                self.stats["late_replies"] += 1
            return
        if not future.done():
            future.set_result(reply)

    async def _pull_loop(self) -> None:
        pull = self._pull
        if pull is None:
            return
        while True:
            self._on_output(await pull.recv_multipart(copy=True))

    def _on_output(self, frames: list[bytes]) -> None:
        now = time.monotonic()
        head = frames[0]
        if head == vllm.ENGINE_CORE_DEAD:
            self._notice(EngineDead(now))
            return
        try:
            message = vllm.decode_engine_outputs(head)
        except ProtocolError as exc:
            self.stats[f"bad_output.{exc.reason}"] += 1
            return
        self.stats["outputs"] += 1
        if self.on_outputs is not None:
            try:
                self.on_outputs(message, now)
            except Exception:
                log.exception("on_outputs callback failed")
        ids = vllm.finished_request_ids(message)
        if message.outputs or ids:
            # Evidence that this rank is stepping, for the coordinator's hang watchdog.
            self._progress.add(message.engine_index)
        if not ids:
            return
        for request_id in ids:
            if self.in_flight.pop(request_id, None) is None \
                    and request_id in self._submitting:
                self._finished_early.add(request_id)
            self._finish(FinishedRequest(request_id, message.engine_index, now))
        self._to_report += ids
        self._report_due.set()

    def _finish(self, item: FinishedRequest) -> None:
        self.stats["finished"] += 1
        if self.on_finished is not None:
            try:
                self.on_finished(item)
            except Exception:
                log.exception("on_finished callback failed")
            return
        _put(self._finished_q, item, self.stats, "finished_dropped")

    async def _heartbeat_loop(self) -> None:
        """Keep the registration (a lease) alive; register again when it was lost."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.registered is None:
                continue
            progress = sorted(self._progress)[:fp.MAX_ABORT_IDS]
            self._progress.clear()
            try:
                reply = await self._call(heartbeat_frames(self.client_index, progress),
                                         "heartbeat", None, RegisterError)
            except CoordinatorTimeout:
                continue  # the coordinator is away; the lease question waits for it
            except RegisterError as exc:
                if exc.code != fp.ERR_NOT_REGISTERED:
                    log.warning("frontend %d: heartbeat refused: %s", self.client_index, exc)
                    continue
                self.stats["reregistered"] += 1
                log.info("frontend %d: the coordinator no longer holds our registration; "
                         "registering again", self.client_index)
                with contextlib.suppress(RegisterError, CoordinatorTimeout):
                    await self.register()
                continue
            if isinstance(reply, fp.Alive):
                self.stats["heartbeats"] += 1
                self.heartbeat_s = max(0.05, reply.interval_s)

    async def _report_loop(self) -> None:
        while True:
            await self._report_due.wait()
            # Let more finishes join this batch (one message, not one per request).
            await asyncio.sleep(self.finished_flush_s)
            self._report_due.clear()
            if not await self._flush_finished():
                # The coordinator is not taking messages (gone, or our queue to it is
                # full): keep the ids, bounded, and try again a little later.
                excess = len(self._to_report) - _MAX_UNREPORTED
                if excess > 0:
                    del self._to_report[:excess]
                    self.stats["finished_unreported_dropped"] += excess
                await asyncio.sleep(_REPORT_RETRY_S)
                self._report_due.set()

    async def _flush_finished(self) -> bool:
        """Send the pending finished ids; False if the socket would have blocked."""
        dealer = self._dealer
        while self._to_report and dealer is not None:
            batch = self._to_report[:_FINISHED_BATCH]
            try:
                await dealer.send_multipart([fp.encode(fp.Finished(batch))], flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            del self._to_report[:len(batch)]
            self.stats["finished_reported"] += len(batch)
        return True

    async def _publish_loop(self) -> None:
        sub = self._sub
        if sub is None:
            return
        await sub.send(vllm.SUBSCRIBE)
        while True:
            newest = await sub.recv_multipart()
            # Keep only the newest publish: older ones describe a past state.
            while True:
                try:
                    newest = await sub.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.stats["publishes_skipped"] += 1
            self._apply_publish(newest)

    def _apply_publish(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.stats["bad_publish.frame_count"] += 1
            return
        try:
            publish = vllm.decode_front_publish(frames[0])
        except ProtocolError as exc:
            self.stats[f"bad_publish.{exc.reason}"] += 1
            return
        self.stats["publishes"] += 1
        self._wave = publish.wave
        self._running = publish.running
        if publish.counts is not None:
            self._counts = [(int(r[0]), int(r[1]), float(r[2]) if len(r) > 2 else 0.0)
                            for r in publish.counts]
            self.stats["publishes_full"] += 1
        self._publish_seen.set()
        if self.on_publish is not None:
            try:
                self.on_publish(self)
            except Exception:
                log.exception("on_publish callback failed")


def _abort_builder(request_ids: list[str]) -> Callable[[int], list[bytes]]:
    def build(call_id: int) -> list[bytes]:
        return [fp.encode(fp.Abort(call_id, request_ids))]

    return build


def _expect(reply: fp.FrontendReply, kind: type[_T], what: str) -> _T:
    if not isinstance(reply, kind):
        raise FrontendError(f"{what}: the coordinator answered with {type(reply).__name__}")
    return reply


def _put(queue: asyncio.Queue[_T], item: _T, stats: Counter[str], key: str) -> None:
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        stats[key] += 1


def _take_all(queue: asyncio.Queue[_T]) -> list[_T]:
    items: list[_T] = []
    while True:
        try:
            items.append(queue.get_nowait())
        except asyncio.QueueEmpty:
            return items
