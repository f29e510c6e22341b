"""Engine-side agent: the sockets a vLLM 0.33 DP engine opens, driven from asyncio.

`EngineAgent` does, byte for byte, what a vLLM 0.33 engine does on its ZeroMQ
sockets, so anything written on top of it (the simulated engines in
`coordinator.sim`, or a real engine loop) looks like a vLLM engine to the
coordinator and to frontends.

Startup, in the order a vLLM engine does it:

1. A DEALER whose identity is the rank as two little-endian bytes connects to
   the handshake address and sends HELLO (`{"status": "HELLO", "local": ...,
   "headless": ...}`; unless `vllm_shaped`, also `engine_id` and
   `protocol_version`).
2. The reply is the INIT map (addresses and `parallel_config`), or an ERROR map,
   which raises `EngineRefused`.
3. A DEALER with the same identity connects to every `inputs` address, an XSUB
   connects to `coordinator_input` and subscribes with the single frame
   `b"\\x01"`, and the ready greeting (`EngineReadyResponse`) goes out on every
   input DEALER: that greeting is what lets a ROUTER learn the engine's identity.
4. The agent waits for `b"READY"` on the XSUB: the coordinator sends it once
   every rank of the group has subscribed. A timeout raises
   `EngineStartupTimeout`.
5. READY goes out on the handshake socket (with `parallel_config_hash` when one
   is configured). Unless `vllm_shaped`, the agent then waits for
   `{"status": "ACCEPTED"}`; an ERROR reply raises `EngineRefused`. Stock vLLM
   engines never read a reply to READY, which is why the wait is optional.

PUSH sockets connect to `coordinator_output` (stats and wave messages) and to
every `outputs` entry (per-frontend outputs, by client index).

CURVE: with `curve_secret_key` (this engine's `NAME.key_secret`) and
`curve_server_key` (the coordinator's `NAME.key`), every socket that connects
to the coordinator over TCP is a CURVE client: the handshake DEALER, the input
DEALER for the coordinator's dispatch socket (the first `inputs` entry: the
coordinator lists it first in INIT), the XSUB on `coordinator_input` and the
PUSH on `coordinator_output`. Sockets to frontends stay plain, since the
frontends own them, and so do ipc connections, which the coordinator never
encrypts (ipc is guarded by file permissions). During start-up a socket monitor
watches the handshake DEALER and the XSUB: a coordinator that refuses our key,
requires keys we lack or has none while we use some fails `start()` at once with
`EngineHandshakeFailed`, which says so, instead of a timeout; a CURVE handshake
the coordinator keeps dropping (a wrong server key) is named at the timeout.

After startup, requests arrive on every input DEALER and, for START_DP_WAVE, on
the XSUB. `coordinator.protocol.engine_input` decodes them into small records
(`StartDpWave`, `AddRequest`, `AbortRequests`, `UtilityCall`), which are
queued; `recv_request()` takes the next one and `get_request_nowait()` drains
without waiting. Extra `READY` frames (sent to
everyone when a late engine subscribes) are skipped. A frame with an unknown type
byte or an undecodable payload is logged and dropped; a vLLM engine's input
thread would die on it, this agent keeps going.

Sends never block: the PUSH sockets have no high-water mark (as in vLLM; the
`ENGINE` role of `coordinator._zmq`), so
every `send_*` method is a plain call. When the agent has sent nothing to the
coordinator for `heartbeat_interval_s`, it sends an `EngineCoreOutputs` that
carries only `engine_index` (and the timestamp every vLLM output carries), which
keeps the coordinator's lease for this rank alive without meaning anything else.

One agent belongs to one event loop and is not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from coordinator._zmq import (
    ENGINE,
    CurveClientKeys,
    HandshakeFailure,
    HandshakeMonitor,
    connect,
    connect_monitored,
)
from coordinator.protocol.engine_input import (
    AbortRequests,
    AddRequest,
    InboundRequest,
    StartDpWave,
    UtilityCall,
    parse_engine_input,
)
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import rank_to_identity
from coordinator.protocol.version import PROTOCOL_VERSION
from coordinator.protocol.vllm import (
    ENGINE_CORE_DEAD,
    READY,
    SUBSCRIBE,
    EngineCoreOutputs,
    EngineHandshakeMetadata,
    EngineReadyResponse,
    EngineZmqAddresses,
    HandshakeAccepted,
    HandshakeError,
    HandshakeMessage,
    SchedulerStats,
    decode_handshake_reply,
    encode_engine_outputs,
    encode_handshake,
    encode_ready_response,
)

__all__ = [
    "FROM_COORDINATOR",
    "PROTOCOL_VERSION",
    "AbortRequests",
    "AddRequest",
    "CurveClientKeys",
    "EngineAgent",
    "EngineHandshakeFailed",
    "EngineRefused",
    "EngineStartupError",
    "EngineStartupTimeout",
    "InboundRequest",
    "StartDpWave",
    "UtilityCall",
]

logger = logging.getLogger(__name__)

#: `source` of a request that arrived on the coordinator's publish socket (XSUB).
FROM_COORDINATOR = -1

# vLLM lets queued outputs drain for 4 s when an engine shuts down.
_PUSH_LINGER_MS = 4000
# vLLM's handshake DEALER lingers 5 s so READY reaches the launcher after close.
_HANDSHAKE_LINGER_MS = 5000
# Bad frames are logged this many times, then once per this many drops.
_LOG_FIRST_DROPS = 10
_LOG_EVERY_DROPS = 1000


# ---------------------------------------------------------------- errors


class EngineStartupError(RuntimeError):
    """The engine could not join its coordinator."""


class EngineStartupTimeout(EngineStartupError):
    """A startup step got no answer in time; `stage` says which one.

    `handshake_failure`: why the last handshake with the coordinator failed, if
    one did (a server key that is not the coordinator's, most often); the
    message ends with it.
    """

    def __init__(self, stage: str, message: str,
                 handshake_failure: HandshakeFailure | None = None) -> None:
        if handshake_failure is not None:
            message = f"{message} Its last handshake failed: {handshake_failure.message}"
        super().__init__(message)
        self.stage = stage
        self.handshake_failure = handshake_failure


class EngineHandshakeFailed(EngineStartupError):
    """A connection to the coordinator failed its ZMTP handshake (CURVE keys, mostly).

    `failure` says why; `stage` is the start-up step that was waiting, as for
    `EngineStartupTimeout`.
    """

    def __init__(self, stage: str, failure: HandshakeFailure, rank: int) -> None:
        super().__init__(f"rank {rank}: {failure.message}")
        self.stage = stage
        self.failure = failure


class EngineRefused(EngineStartupError):
    """The coordinator answered HELLO or READY with an ERROR map."""

    def __init__(self, reason: str, *, stage: str) -> None:
        super().__init__(f"coordinator refused {stage}: {reason}")
        self.reason = reason
        self.stage = stage


def default_ready_response(rank: int, dp_size: int) -> EngineReadyResponse:
    """A plausible greeting for an engine that has no real model behind it."""
    return EngineReadyResponse(
        max_model_len=4096,
        num_gpu_blocks=1024,
        block_size=16,
        dp_stats_address=None,
        dtype="bfloat16",
        vllm_version="0.33.0",
        world_size=1,
        data_parallel_size=dp_size,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        data_parallel_rank=rank,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        instance_id=uuid.uuid4().hex,
        supports_lora=False,
        max_loras=0,
    )


# ---------------------------------------------------------------- the agent


class EngineAgent:
    """One DP rank's sockets: handshake, requests in, stats/waves/outputs out.

    Parameters:
        handshake_address: the coordinator's `handshake` ROUTER.
        rank: global DP rank; also the ZMQ identity (2 bytes, little-endian).
        local, headless: reported in HELLO and READY, as vLLM engines do.
        engine_id: sent in HELLO unless `vllm_shaped`; None generates a random one,
            so a restarted process is a new incarnation.
        parallel_config_hash: sent in READY when set (vLLM sends one when dp > 1).
        vllm_shaped: send exactly vLLM 0.33's handshake bytes (no engine_id, no
            protocol_version) and do not wait for a reply to READY.
        ready_response: the greeting sent on every input socket; by default a
            made-up one, completed with the coordinator addresses from INIT.
        heartbeat_interval_s: send an empty `EngineCoreOutputs` to the coordinator
            after this long without other coordinator traffic; None disables.
        handshake_timeout_s: wait for the INIT reply to HELLO.
        ready_timeout_s: wait for the coordinator's `READY` on its publish socket.
        accept_timeout_s: wait for the reply to READY (not in `vllm_shaped` mode).
        context: a zmq.asyncio.Context to use; by default the agent owns one.
        curve_secret_key: path of this engine's secret key file (`NAME.key_secret`
            from `dp-coordinator keygen`); with `curve_server_key`, sockets to the
            coordinator over TCP use CURVE. Give both or neither.
        curve_server_key: path of the coordinator's public key file (`NAME.key`).
    """

    def __init__(
        self,
        handshake_address: str,
        rank: int,
        *,
        local: bool = False,
        headless: bool = True,
        engine_id: str | None = None,
        parallel_config_hash: str | None = None,
        vllm_shaped: bool = False,
        ready_response: EngineReadyResponse | None = None,
        heartbeat_interval_s: float | None = 2.0,
        handshake_timeout_s: float = 60.0,
        ready_timeout_s: float = 120.0,
        accept_timeout_s: float = 30.0,
        context: zmq.asyncio.Context | None = None,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
    ) -> None:
        self.handshake_address = handshake_address
        self.curve = CurveClientKeys.from_options(curve_secret_key, curve_server_key)
        self.rank = rank
        self.identity = rank_to_identity(rank)
        self.local = local
        self.headless = headless
        self.vllm_shaped = vllm_shaped
        self.engine_id: str | None = None
        if not vllm_shaped:
            self.engine_id = engine_id if engine_id is not None else uuid.uuid4().hex
        self.parallel_config_hash = parallel_config_hash
        self.heartbeat_interval_s = heartbeat_interval_s
        self.handshake_timeout_s = handshake_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.accept_timeout_s = accept_timeout_s
        self._ready_response = ready_response

        # An own context is made in start(), so an agent never started holds nothing.
        self._owns_context = context is None
        self._ctx: zmq.asyncio.Context | None = context

        #: Filled from INIT by `start()`.
        self.addresses: EngineZmqAddresses | None = None
        self.parallel_config: dict[str, Any] = {}

        #: When False, due heartbeats are skipped (fault injection: a silent engine).
        self.heartbeats_enabled = True
        #: Count of dropped inbound messages, by ProtocolError reason token.
        self.drops: Counter[str] = Counter()
        self.heartbeats_sent = 0

        self._handshake: zmq.asyncio.Socket | None = None
        self._handshake_monitors: list[HandshakeMonitor] = []
        self._inputs: list[zmq.asyncio.Socket] = []
        self._coord_sub: zmq.asyncio.Socket | None = None
        self._coord_push: zmq.asyncio.Socket | None = None
        self._output_pushes: list[zmq.asyncio.Socket] = []
        self._queue: asyncio.Queue[InboundRequest] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_coord_send = time.monotonic()
        self._started = False
        self._closed = False

    # ------------------------------------------------------------ properties

    @property
    def started(self) -> bool:
        return self._started

    @property
    def has_coordinator(self) -> bool:
        """True when INIT gave a coordinator output address (vLLM's definition)."""
        return self._coord_push is not None

    @property
    def num_outputs(self) -> int:
        return len(self._output_pushes)

    @property
    def pending_requests(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------ startup

    async def start(self) -> None:
        """Run the whole startup handshake; raise EngineStartupError on failure."""
        if self._started or self._closed:
            raise RuntimeError("EngineAgent.start() may be called once")
        try:
            await self._start()
        except BaseException:
            await self.close(linger_s=0.0)
            raise
        self._started = True

    async def _start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        ctx = self._ctx
        self._handshake, monitor = connect_monitored(
            ctx,
            zmq.DEALER,
            self.handshake_address,
            ENGINE,
            identity=self.identity,
            linger_ms=_HANDSHAKE_LINGER_MS if self.vllm_shaped else 0,
            curve=self.curve,
        )
        self._handshake_monitors.append(monitor)
        hello = HandshakeMessage(
            status="HELLO",
            local=self.local,
            headless=self.headless,
            engine_id=self.engine_id,
            protocol_version=None if self.vllm_shaped else PROTOCOL_VERSION,
        )
        await self._handshake.send(encode_handshake(hello))
        reply = await self._handshake_reply("init", self.handshake_timeout_s)
        if isinstance(reply, HandshakeError):
            raise EngineRefused(reply.reason, stage="HELLO")
        if not isinstance(reply, EngineHandshakeMetadata):
            raise EngineStartupError(f"expected INIT in reply to HELLO, got {reply!r}")
        self.addresses = addresses = reply.addresses
        self.parallel_config = dict(reply.parallel_config)
        logger.debug("rank %d: INIT %s", self.rank, addresses)

        # Outputs first, so nothing sent right after startup can find them missing.
        if addresses.coordinator_output is not None:
            self._coord_push = connect(
                ctx,
                zmq.PUSH,
                addresses.coordinator_output,
                ENGINE,
                linger_ms=_PUSH_LINGER_MS,
                curve=self.curve,
            )
        self._output_pushes = [
            connect(ctx, zmq.PUSH, address, ENGINE, linger_ms=_PUSH_LINGER_MS)
            for address in addresses.outputs
        ]

        # The coordinator's dispatch socket comes first in INIT's inputs; the
        # others are frontends' own sockets.
        self._inputs = [
            connect(
                ctx,
                zmq.DEALER,
                address,
                ENGINE,
                identity=self.identity,
                curve=self.curve if index == 0 else None,
            )
            for index, address in enumerate(addresses.inputs)
        ]
        if addresses.coordinator_input is not None:
            # vLLM sets the identity on this XSUB too; it has no effect there.
            self._coord_sub, monitor = connect_monitored(
                ctx,
                zmq.XSUB,
                addresses.coordinator_input,
                ENGINE,
                identity=self.identity,
                curve=self.curve,
            )
            self._handshake_monitors.append(monitor)
            await self._coord_sub.send(SUBSCRIBE)

        greeting = encode_ready_response(self._make_ready_response(addresses))
        for sock in self._inputs:
            await sock.send(greeting)

        early: list[list[bytes]] = []
        if self._coord_sub is not None:
            await self._wait_coordinator_ready(self._coord_sub, addresses, early)

        for index, sock in enumerate(self._inputs):
            self._spawn(self._read_loop(sock, index), f"engine-{self.rank}-input-{index}")
        if self._coord_sub is not None:
            for frames in early:
                self._accept(frames, FROM_COORDINATOR)
            self._spawn(
                self._read_loop(self._coord_sub, FROM_COORDINATOR),
                f"engine-{self.rank}-coordinator-input",
            )

        ready = HandshakeMessage(
            status="READY",
            local=self.local,
            headless=self.headless,
            parallel_config_hash=self.parallel_config_hash,
        )
        await self._handshake.send(encode_handshake(ready))
        if not self.vllm_shaped:
            reply = await self._handshake_reply("accept", self.accept_timeout_s)
            if isinstance(reply, HandshakeError):
                raise EngineRefused(reply.reason, stage="READY")
            if not isinstance(reply, HandshakeAccepted):
                raise EngineStartupError(f"expected ACCEPTED in reply to READY, got {reply!r}")
        # Like vLLM, the handshake socket is done once READY is out.
        self._close_handshake_monitors()
        self._handshake.close()
        self._handshake = None

        self._last_coord_send = time.monotonic()
        if self._coord_push is not None and self.heartbeat_interval_s is not None:
            self._spawn(self._heartbeat_loop(self.heartbeat_interval_s), f"engine-{self.rank}-hb")
        logger.info(
            "rank %d joined: %d input(s), %d output(s), coordinator %s",
            self.rank,
            len(self._inputs),
            len(self._output_pushes),
            "yes" if self._coord_push is not None else "no",
        )

    def _make_ready_response(self, addresses: EngineZmqAddresses) -> EngineReadyResponse:
        base = self._ready_response
        if base is None:
            dp_size = self.parallel_config.get("data_parallel_size", self.rank + 1)
            base = default_ready_response(
                self.rank, dp_size if isinstance(dp_size, int) else self.rank + 1
            )
        return msgspec.structs.replace(
            base,
            data_parallel_rank=self.rank,
            dp_stats_address=addresses.frontend_stats_publish_address,
            coordinator_input_address=addresses.coordinator_input,
            coordinator_output_address=addresses.coordinator_output,
        )

    async def _handshake_reply(
        self, stage: str, timeout_s: float
    ) -> EngineHandshakeMetadata | HandshakeError | HandshakeAccepted:
        sock = self._handshake
        if sock is None:
            raise EngineStartupError("handshake socket is closed")
        if not await self._readable(sock, timeout_s, stage):
            what = "INIT reply to HELLO" if stage == "init" else "reply to READY"
            raise EngineStartupTimeout(
                stage,
                f"rank {self.rank}: no {what} from {self.handshake_address} within "
                f"{timeout_s:g} s; is the coordinator running and reachable there?",
                self._handshake_failure(),
            )
        frames = await sock.recv_multipart()
        if len(frames) != 1:
            raise EngineStartupError(
                f"handshake reply has {len(frames)} frames, expected 1 ({stage})"
            )
        try:
            return decode_handshake_reply(frames[0])
        except ProtocolError as exc:
            raise EngineStartupError(f"undecodable handshake reply ({stage}): {exc}") from exc

    async def _wait_coordinator_ready(
        self,
        sock: zmq.asyncio.Socket,
        addresses: EngineZmqAddresses,
        early: list[list[bytes]],
    ) -> None:
        """Block until READY arrives on the XSUB; keep anything else for later.

        vLLM asserts that READY is the first message; a START_DP_WAVE overtaking it
        (possible for late joiners) is kept and handled after startup instead.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._readable(sock, remaining, "coordinator_ready"):
                dp_size = self.parallel_config.get("data_parallel_size")
                group = f"all {dp_size} ranks" if isinstance(dp_size, int) else "every rank"
                raise EngineStartupTimeout(
                    "coordinator_ready",
                    f"rank {self.rank}: no READY from the coordinator on "
                    f"{addresses.coordinator_input} within {self.ready_timeout_s:g} s; the "
                    f"coordinator releases engines only once {group} of the group have "
                    f"subscribed there, so check that the other engines are running.",
                    self._handshake_failure(),
                )
            frames = await sock.recv_multipart()
            if frames and frames[0] == READY:
                return
            logger.warning(
                "rank %d: message before READY on the coordinator socket; kept for later",
                self.rank,
            )
            early.append(frames)

    async def _readable(self, sock: zmq.asyncio.Socket, timeout_s: float, stage: str) -> bool:
        """Wait up to `timeout_s` for a message on `sock`; False when none came.

        Raises EngineHandshakeFailed as soon as a connection to the coordinator
        failed for good.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        for monitor in self._handshake_monitors:
            poller.register(monitor.socket, zmq.POLLIN)
        while True:
            remaining = deadline - loop.time()
            ready = {}
            if remaining > 0:
                ready = dict(await poller.poll(max(1, int(remaining * 1000))))
            failure = self._handshake_failure()
            if failure is not None and failure.final:
                raise EngineHandshakeFailed(stage, failure, self.rank)
            if sock in ready:
                return True
            if not ready:
                return False

    def _handshake_failure(self) -> HandshakeFailure | None:
        """The first failure of the start-up sockets' latest handshakes (final ones first)."""
        failures = [f for m in self._handshake_monitors if (f := m.poll()) is not None]
        return min(failures, key=lambda f: not f.final, default=None)

    def _close_handshake_monitors(self) -> None:
        monitors, self._handshake_monitors = self._handshake_monitors, []
        for monitor in monitors:
            monitor.close()

    def _spawn(self, coro: Any, name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    # ------------------------------------------------------------ inbound

    async def _read_loop(self, sock: zmq.asyncio.Socket, source: int) -> None:
        while True:
            frames = await sock.recv_multipart()
            self._accept(frames, source)

    def _accept(self, frames: Sequence[bytes], source: int) -> None:
        try:
            request = parse_engine_input(frames, source)
        except ProtocolError as exc:
            self._drop(exc.reason, f"{exc} (source {source})")
            return
        if request is not None:
            self._queue.put_nowait(request)

    def _drop(self, reason: str, detail: str) -> None:
        self.drops[reason] += 1
        total = sum(self.drops.values())
        if total <= _LOG_FIRST_DROPS or total % _LOG_EVERY_DROPS == 0:
            logger.warning(
                "rank %d: dropped bad inbound message (%s, %d dropped so far): %s",
                self.rank,
                reason,
                total,
                detail,
            )

    async def recv_request(self, timeout_s: float | None = None) -> InboundRequest:
        """The next request; raises asyncio.TimeoutError after `timeout_s` if given."""
        if timeout_s is None:
            return await self._queue.get()
        return await asyncio.wait_for(self._queue.get(), timeout_s)

    def get_request_nowait(self) -> InboundRequest | None:
        """The next request if one is queued, else None."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    # ------------------------------------------------------------ outbound

    def _send_to_coordinator(self, message: EngineCoreOutputs) -> None:
        if self._coord_push is None:
            raise RuntimeError(
                f"rank {self.rank} has no coordinator output address (INIT gave none)"
            )
        message.engine_index = self.rank
        if message.timestamp == 0.0:
            message.timestamp = time.monotonic()
        self._send_now(self._coord_push, encode_engine_outputs(message))
        self._last_coord_send = time.monotonic()

    @staticmethod
    def _send_now(sock: zmq.asyncio.Socket, data: bytes) -> None:
        # With SNDHWM=0 a connected PUSH never refuses a frame, so the send
        # completes at once; a failure would surface here, not in a lost future.
        done = sock.send(data, flags=zmq.NOBLOCK)
        if isinstance(done, asyncio.Future) and done.done():
            error = done.exception()
            if error is not None:
                raise error

    def send_stats(
        self,
        waiting: int,
        running: int,
        kv_cache_usage: float,
        step_counter: int = 0,
        current_wave: int = 0,
    ) -> None:
        """Report load to the coordinator (a full 18-key SchedulerStats map)."""
        stats = SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            kv_cache_usage=kv_cache_usage,
            step_counter=step_counter,
            current_wave=current_wave,
        )
        self._send_to_coordinator(EngineCoreOutputs(scheduler_stats=stats))

    def send_wave_complete(self, wave: int) -> None:
        """Tell the coordinator wave `wave` has ended and the group is paused (rank 0)."""
        self._send_to_coordinator(EngineCoreOutputs(wave_complete=wave))

    def send_start_wave(self, wave: int) -> None:
        """Tell the coordinator this engine started wave `wave`; it wakes the others."""
        self._send_to_coordinator(EngineCoreOutputs(start_wave=wave))

    def send_heartbeat(self) -> None:
        """An output with nothing but engine_index: keeps the coordinator's lease alive."""
        self._send_to_coordinator(EngineCoreOutputs())
        self.heartbeats_sent += 1

    def send_output(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        """Send outputs to frontend `client_index` (-1: to the coordinator, as vLLM)."""
        if client_index == -1:
            self._send_to_coordinator(outputs)
            return
        if not 0 <= client_index < len(self._output_pushes):
            raise IndexError(
                f"rank {self.rank}: no output socket for client index {client_index} "
                f"(INIT listed {len(self._output_pushes)})"
            )
        outputs.engine_index = self.rank
        if outputs.timestamp == 0.0:
            outputs.timestamp = time.monotonic()
        self._send_now(self._output_pushes[client_index], encode_engine_outputs(outputs))

    def send_engine_dead(self) -> None:
        """Send the raw ENGINE_CORE_DEAD frame to every frontend output (not the coordinator)."""
        for sock in self._output_pushes:
            self._send_now(sock, ENGINE_CORE_DEAD)

    async def _heartbeat_loop(self, interval_s: float) -> None:
        while True:
            delay = self._last_coord_send + interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            if self.heartbeats_enabled:
                self.send_heartbeat()
            else:
                self._last_coord_send = time.monotonic()

    # ------------------------------------------------------------ shutdown

    async def close(self, linger_s: float = 1.0) -> None:
        """Stop reading, close every socket (letting queued sends drain for `linger_s`)."""
        if self._closed:
            return
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        linger_ms = max(0, int(linger_s * 1000))
        self._close_handshake_monitors()
        sockets: list[zmq.asyncio.Socket] = [*self._inputs, *self._output_pushes]
        for maybe in (self._handshake, self._coord_sub, self._coord_push):
            if maybe is not None:
                sockets.append(maybe)
        for sock in sockets:
            sock.close(linger=linger_ms)
        self._inputs = []
        self._output_pushes = []
        self._handshake = self._coord_sub = self._coord_push = None
        if self._owns_context and self._ctx is not None:
            # term() waits for lingering sends; keep it off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, self._ctx.term)
            self._ctx = None
