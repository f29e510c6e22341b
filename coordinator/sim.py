"""Simulated lockstep data-parallel engines, for the demo, tests and benchmarks.

Each `SimEngine` is an `EngineAgent` plus a step loop that behaves like vLLM
0.33's `DPEngineCoreProc` wherever the coordinator can tell the difference:

* a waiting queue and a running set capped at `max_batch`; a request runs for
  its `decode_steps` steps, then the frontend that sent it gets an
  `EngineCoreOutputs` with `finished_requests=[request_id]` on its output socket;
* each loop iteration drains the input, publishes stats, runs one step and
  publishes stats again; stats go out only when `(running, waiting)` changed;
* while the group is running, an engine with no local work runs dummy steps;
* waves: an engine that gets a request adopts a newer stamped wave, and if it
  was idle it marks itself running *before* it sends `start_wave(current)`;
  `START_DP_WAVE [w, exclude]` wakes an engine that is not `exclude` when
  `w >= current`; when the global "anything unfinished" flag turns false, rank 0
  sends `wave_complete(current)` and every rank moves to the next wave with its
  step counter reset; rank 0 also reports `start_wave` when it starts running
  without having received a request itself (the "mirror" edge).

The collective
--------------
Real lockstep engines meet in collectives (the MoE all-to-all, and vLLM's
all-reduce of "has unfinished requests") on every step. Here every running rank
sends `(seq, has_unfinished)` to a `CollectiveHub` (a ZMQ ROUTER that a rank or
the group runner binds) after each step, real or dummy, and waits for the sum.
`seq` counts the collectives a rank has entered, so ranks that stepped the same
number of times meet in the same collective. An engine that never woke up never
enters it, and its peers block there, exactly as GPUs would. The wait is
bounded (`collective_timeout_s`): when it runs out, the waiting rank asks the hub
which ranks have arrived, and records a `CollectiveHang` naming the missing
ones (in `SimEngine.hangs`, and at ERROR in the log). With `on_hang="fail"` the
engine then dies like a vLLM engine whose collective timed out (frontends get
ENGINE_CORE_DEAD); with `on_hang="wait"` it records one hang per timeout period
and keeps waiting, so a late wake still completes the collective.

vLLM only honours the reduced flag on step 1 and then every `dp_sync_interval`
steps (16); between those steps the group keeps running. The same rule applies
here (`SimConfig.dp_sync_interval`).

Fault injection: `SimEngine.freeze()` stops the step loop (peers then block in
the collective); `ignore_start_wave = True` makes an engine drop START_DP_WAVE,
which plants the classic never-woken-peer hang.

Requests: the ADD payload is one frame holding a `SimRequest` (`encode_sim_request`).

Command line: `python -m coordinator.sim --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import msgspec
import zmq
import zmq.asyncio

from coordinator.engine import (
    AbortRequests,
    AddRequest,
    CurveClientKeys,
    EngineAgent,
    EngineRefused,
    EngineStartupError,
    InboundRequest,
    StartDpWave,
    UtilityCall,
)
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.vllm import EngineCoreOutputs

__all__ = [
    "CollectiveClient",
    "CollectiveHang",
    "CollectiveHub",
    "SimConfig",
    "SimEngine",
    "SimEngineGroup",
    "SimRequest",
    "decode_sim_request",
    "encode_sim_request",
    "main",
    "sim_config_hash",
]

logger = logging.getLogger(__name__)

HangPolicy = Literal["fail", "wait"]


# ---------------------------------------------------------------- requests


class SimRequest(msgspec.Struct, array_like=True, frozen=True):
    """The ADD payload a simulated engine understands."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    client_index: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    current_wave: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
    decode_steps: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
    #: Sender's `time.monotonic_ns()` at submission, for latency measurement.
    submitted_ns: int | None = None


_sim_request_encoder = msgspec.msgpack.Encoder()
_sim_request_decoder = msgspec.msgpack.Decoder(SimRequest)


def encode_sim_request(request: SimRequest) -> bytes:
    return _sim_request_encoder.encode(request)


def decode_sim_request(buf: bytes) -> SimRequest:
    """Decode an ADD payload frame; raises ProtocolError on anything else."""
    try:
        return _sim_request_decoder.decode(buf)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad SimRequest: {exc}", reason="bad_value") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable SimRequest: {exc}", reason="decode") from exc


def sim_config_hash(world_size: int) -> str:
    """The `parallel_config_hash` simulated engines send: equal for one group size."""
    return hashlib.sha256(f"coordinator.sim dp_size={world_size}".encode()).hexdigest()


# ---------------------------------------------------------------- the collective


class _HubMessage(msgspec.Struct, array_like=True, tag_field="kind"):
    pass


class _Contribute(_HubMessage, tag="contribute"):
    seq: int
    rank: int
    value: int
    wave: int
    step: int


class _Query(_HubMessage, tag="query"):
    seq: int
    rank: int


class _Result(_HubMessage, tag="result"):
    seq: int
    total: int


class _Arrivals(_HubMessage, tag="arrivals"):
    seq: int
    ranks: list[int]
    missing: list[int]


_HubInbound = _Contribute | _Query
_HubOutbound = _Result | _Arrivals
_hub_encoder = msgspec.msgpack.Encoder()
_hub_inbound_decoder = msgspec.msgpack.Decoder(_HubInbound)
_hub_outbound_decoder = msgspec.msgpack.Decoder(_HubOutbound)


class CollectiveHang(Exception):
    """A rank waited `waited_s` in collective `seq` and some ranks never came."""

    def __init__(
        self,
        *,
        rank: int,
        seq: int,
        wave: int,
        step: int,
        waited_s: float,
        missing: tuple[int, ...],
        arrived: tuple[int, ...] | None,
    ) -> None:
        self.rank = rank
        self.seq = seq
        self.wave = wave
        self.step = step
        self.waited_s = waited_s
        self.missing = missing
        #: Ranks the hub had seen in this collective; None if the hub did not answer.
        self.arrived = arrived
        if arrived is None:
            who = "the collective hub did not answer, so the missing ranks are unknown"
        else:
            who = f"missing ranks {list(missing)} never joined (arrived: {list(arrived)})"
        super().__init__(
            f"rank {rank} blocked {waited_s:.1f} s in collective #{seq} "
            f"(wave {wave}, step {step}): {who}"
        )


class CollectiveHub:
    """Meeting point for one group's per-step collective (a ZMQ ROUTER).

    Ranks `rank_start .. rank_start + world_size - 1` each send one contribution
    per collective; when all have arrived, every one of them gets the sum. The hub
    also answers "who has arrived in collective `seq`?" for hang reports.
    """

    def __init__(
        self,
        address: str,
        world_size: int,
        *,
        rank_start: int = 0,
        context: zmq.asyncio.Context | None = None,
        max_pending: int = 4096,
    ) -> None:
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        self.requested_address = address
        self.world_size = world_size
        self.rank_start = rank_start
        self.max_pending = max_pending
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        # seq -> rank -> (peer identity, value)
        self._pending: dict[int, dict[int, tuple[bytes, int]]] = {}
        self.completed = 0
        self.dropped = 0
        self.address = address

    async def start(self) -> str:
        """Bind and serve; returns the bound endpoint (resolves `tcp://...:0`)."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(self.requested_address)
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.address = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="collective-hub")
        return self.address

    @property
    def ranks(self) -> range:
        return range(self.rank_start, self.rank_start + self.world_size)

    def pending(self) -> dict[int, list[int]]:
        """Open collectives: seq -> ranks that have arrived."""
        return {seq: sorted(ranks) for seq, ranks in self._pending.items()}

    async def _serve(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 2:
                self._drop(f"{len(frames)} frames")
                continue
            identity, payload = frames
            try:
                message = _hub_inbound_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._drop(str(exc))
                continue
            if not self.rank_start <= message.rank < self.rank_start + self.world_size:
                self._drop(f"rank {message.rank} outside the group")
                continue
            if isinstance(message, _Query):
                arrived = sorted(self._pending.get(message.seq, {}))
                missing = [r for r in self.ranks if r not in arrived]
                reply = _hub_encoder.encode(
                    _Arrivals(seq=message.seq, ranks=arrived, missing=missing)
                )
                await sock.send_multipart([identity, reply])
                continue
            await self._contribute(sock, identity, message)

    async def _contribute(
        self, sock: zmq.asyncio.Socket, identity: bytes, message: _Contribute
    ) -> None:
        entries = self._pending.setdefault(message.seq, {})
        entries[message.rank] = (identity, message.value)
        if len(entries) < self.world_size:
            if len(self._pending) > self.max_pending:
                oldest = min(self._pending)
                logger.error(
                    "collective hub: dropping open collective #%d (ranks %s) to bound memory",
                    oldest,
                    sorted(self._pending[oldest]),
                )
                del self._pending[oldest]
            return
        del self._pending[message.seq]
        total = sum(value for _, value in entries.values())
        reply = _hub_encoder.encode(_Result(seq=message.seq, total=total))
        for peer, _ in entries.values():
            await sock.send_multipart([peer, reply])
        self.completed += 1

    def _drop(self, detail: str) -> None:
        self.dropped += 1
        if self.dropped <= 10:
            logger.warning("collective hub: dropped bad message: %s", detail)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class CollectiveClient:
    """One rank's side of the collective: `all_reduce` sends a value, waits for the sum."""

    def __init__(
        self,
        address: str,
        rank: int,
        *,
        timeout_s: float = 10.0,
        query_timeout_s: float = 1.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self.rank = rank
        self.timeout_s = timeout_s
        self.query_timeout_s = query_timeout_s
        ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.connect(address)

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            raise RuntimeError("collective client is closed")
        return self._sock

    async def all_reduce(
        self, seq: int, value: int, *, wave: int = 0, step: int = 0, timeout_s: float | None = None
    ) -> int:
        """Contribute `value` to collective `seq`; the sum over all ranks.

        Raises CollectiveHang if the sum does not come within the timeout.
        """
        message = _Contribute(seq=seq, rank=self.rank, value=value, wave=wave, step=step)
        await self._socket().send(_hub_encoder.encode(message))
        return await self.wait_result(seq, wave=wave, step=step, timeout_s=timeout_s)

    async def wait_result(
        self,
        seq: int,
        *,
        wave: int = 0,
        step: int = 0,
        timeout_s: float | None = None,
        already_waited_s: float = 0.0,
    ) -> int:
        """Keep waiting for collective `seq` (after a CollectiveHang, for instance)."""
        loop = asyncio.get_running_loop()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        started = loop.time()
        deadline = started + timeout
        while True:
            message = await self._recv_until(deadline)
            if message is None:
                break
            if isinstance(message, _Result) and message.seq == seq:
                return message.total
        # Out of time: ask the hub who has arrived, so the hang names the culprits.
        await self._socket().send(_hub_encoder.encode(_Query(seq=seq, rank=self.rank)))
        arrived: tuple[int, ...] | None = None
        missing: tuple[int, ...] = ()
        query_deadline = loop.time() + self.query_timeout_s
        while True:
            message = await self._recv_until(query_deadline)
            if message is None:
                break
            if message.seq != seq:
                continue
            if isinstance(message, _Result):
                return message.total
            arrived = tuple(message.ranks)
            missing = tuple(message.missing)
            break
        raise CollectiveHang(
            rank=self.rank,
            seq=seq,
            wave=wave,
            step=step,
            waited_s=already_waited_s + (loop.time() - started),
            missing=missing,
            arrived=arrived,
        )

    async def _recv_until(self, deadline: float) -> _Result | _Arrivals | None:
        sock = self._socket()
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            events = await sock.poll(timeout=max(1, int(remaining * 1000)))
            if not events:
                return None
            payload = await sock.recv()
            try:
                return _hub_outbound_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                logger.warning("rank %d: undecodable reply from the collective hub", self.rank)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


# ---------------------------------------------------------------- the engine


@dataclass
class SimConfig:
    """How a simulated engine behaves. Ranks of one group must agree on the lockstep knobs."""

    world_size: int = 2
    rank_start: int = 0
    step_time_s: float = 0.005
    max_batch: int = 64
    #: Honour the reduced "unfinished" flag on step 1 and every N steps (vLLM: 16).
    dp_sync_interval: int = 16
    collective_timeout_s: float = 10.0
    on_hang: HangPolicy = "fail"
    #: False: a dense engine (no waves, no collective), like vLLM's EngineCoreProc.
    lockstep: bool = True
    #: False: send no load stats (vLLM engines in external-LB mode).
    publish_stats: bool = True
    # Agent options.
    vllm_shaped: bool = False
    #: HELLO's engine_id; None: a fresh random one. A group appends "-<rank>".
    engine_id: str | None = None
    parallel_config_hash: str | None = None
    heartbeat_interval_s: float | None = 2.0
    handshake_timeout_s: float = 60.0
    ready_timeout_s: float = 120.0
    accept_timeout_s: float = 30.0
    local: bool = False
    headless: bool = True
    #: CURVE key files (this engine's NAME.key_secret, the coordinator's NAME.key).
    curve_secret_key: str | None = None
    curve_server_key: str | None = None

    def config_hash(self) -> str:
        if self.parallel_config_hash is not None:
            return self.parallel_config_hash
        return sim_config_hash(self.world_size)

    @property
    def group_ranks(self) -> range:
        return range(self.rank_start, self.rank_start + self.world_size)


@dataclass
class _Active:
    request: SimRequest
    remaining: int


@dataclass
class SimCounters:
    """What an engine did; for tests and reports."""

    steps: int = 0
    dummy_steps: int = 0
    collectives: int = 0
    added: int = 0
    finished: int = 0
    aborted: int = 0
    dropped: int = 0
    start_waves_sent: list[int] = field(default_factory=list)
    wave_completes_sent: list[int] = field(default_factory=list)
    wakes_applied: list[int] = field(default_factory=list)


class SimEngine:
    """One simulated DP rank: an EngineAgent and a vLLM-like step loop.

    `start()` runs the agent handshake (which completes only when every rank of
    the group has subscribed at the coordinator) and launches the loop; `stop()`
    ends it. State is exposed read-only for tests: `current_wave`,
    `engines_running`, `step_counter`, `num_waiting`, `num_running`, `counters`,
    `hangs`, `failed`.
    """

    def __init__(
        self,
        rank: int,
        handshake_address: str,
        *,
        config: SimConfig | None = None,
        collective_address: str | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.rank = rank
        self.config = cfg = config if config is not None else SimConfig()
        if rank not in cfg.group_ranks:
            raise ValueError(f"rank {rank} is outside the group {cfg.group_ranks}")
        if cfg.lockstep and collective_address is None:
            raise ValueError("a lockstep engine needs a collective_address")
        if cfg.max_batch < 1 or cfg.dp_sync_interval < 1:
            raise ValueError("max_batch and dp_sync_interval must be at least 1")
        self.agent = EngineAgent(
            handshake_address,
            rank,
            local=cfg.local,
            headless=cfg.headless,
            engine_id=cfg.engine_id,
            parallel_config_hash=cfg.config_hash(),
            vllm_shaped=cfg.vllm_shaped,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            handshake_timeout_s=cfg.handshake_timeout_s,
            ready_timeout_s=cfg.ready_timeout_s,
            accept_timeout_s=cfg.accept_timeout_s,
            context=context,
            curve_secret_key=cfg.curve_secret_key,
            curve_server_key=cfg.curve_server_key,
        )
        self._collective_address = collective_address
        self._collective: CollectiveClient | None = None
        self._context = context

        self.current_wave = 0
        self.engines_running = False
        self.step_counter = 0
        #: When True, START_DP_WAVE is dropped (fault injection: a never-woken peer).
        self.ignore_start_wave = False
        self.hangs: list[CollectiveHang] = []
        self.failed: BaseException | None = None
        self.counters = SimCounters()

        self._waiting: deque[_Active] = deque()
        self._running: dict[str, _Active] = {}
        self._held: set[str] = set()  # ids waiting or running
        self._last_counts = (0, 0)
        self._seq = 0
        self._unfrozen = asyncio.Event()
        self._unfrozen.set()
        self._task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------ control

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def frozen(self) -> bool:
        return not self._unfrozen.is_set()

    @property
    def done(self) -> asyncio.Event:
        """Set once the step loop has ended (stopped or failed)."""
        return self._stopped

    def freeze(self, *, silence: bool = False) -> None:
        """Stop stepping (and handling input) until `unfreeze()`.

        With `silence`, heartbeats stop too, so the coordinator's lease can lapse.
        """
        self._unfrozen.clear()
        if silence:
            self.agent.heartbeats_enabled = False

    def unfreeze(self) -> None:
        self._unfrozen.set()
        self.agent.heartbeats_enabled = True

    async def start(self) -> None:
        """Join the coordinator, then run the step loop in a task."""
        if self.config.lockstep and self._collective_address is not None:
            self._collective = CollectiveClient(
                self._collective_address,
                self.rank,
                timeout_s=self.config.collective_timeout_s,
                context=self._context,
            )
        try:
            await self.agent.start()
        except BaseException:
            self._close_collective()
            raise
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"sim-engine-{self.rank}"
        )

    async def stop(self, linger_s: float = 0.5) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._stopped.set()
        self._close_collective()
        await self.agent.close(linger_s=linger_s)

    def _close_collective(self) -> None:
        if self._collective is not None:
            self._collective.close()
            self._collective = None

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        try:
            if self.config.lockstep:
                await self._lockstep_loop()
            else:
                await self._dense_loop()
        except asyncio.CancelledError:
            raise
        except CollectiveHang as hang:
            self.failed = hang
            logger.error("rank %d: engine dies after a collective hang: %s", self.rank, hang)
            await self._die()
        except Exception as exc:
            self.failed = exc
            logger.exception("rank %d: engine loop failed", self.rank)
            await self._die()
        finally:
            self._stopped.set()

    async def _die(self) -> None:
        """What a dying vLLM engine does: tell the frontends, then drop every socket."""
        with contextlib.suppress(Exception):
            self.agent.send_engine_dead()
        self._close_collective()
        await self.agent.close(linger_s=0.5)

    def _has_local_work(self) -> bool:
        return bool(self._waiting or self._running)

    async def _lockstep_loop(self) -> None:
        while True:
            await self._unfrozen.wait()
            was_running = self.engines_running
            await self._process_input()
            self._maybe_publish_counts()
            executed = await self._step()
            self._maybe_publish_counts()

            local_unfinished = self._has_local_work()
            if not executed:
                if not local_unfinished and not self.engines_running:
                    continue
                await self._dummy_step()
            self.engines_running = await self._global_unfinished(local_unfinished)

            leader = self.rank == self.config.rank_start
            if not self.engines_running:
                # Rank 0 speaks for the group; without a coordinator every rank
                # tells its own frontend, as vLLM does.
                if leader or not self.agent.has_coordinator:
                    self._send_wave_complete(self.current_wave)
                self.current_wave += 1
                self.step_counter = 0
            elif not was_running and leader and self.agent.has_coordinator:
                # Rank 0 reports the edge itself, so the coordinator's running
                # flag is an observation even when the wake did not come from it.
                self._send_start_wave(self.current_wave)

    async def _dense_loop(self) -> None:
        while True:
            await self._unfrozen.wait()
            await self._process_input()
            self._maybe_publish_counts()
            await self._step()
            self._maybe_publish_counts()

    def _has_work(self) -> bool:
        return self.engines_running or self._has_local_work()

    async def _process_input(self) -> None:
        while not self._has_work():
            request = await self.agent.recv_request()
            await self._unfrozen.wait()
            self._handle(request)
        while (queued := self.agent.get_request_nowait()) is not None:
            self._handle(queued)

    async def _step(self) -> bool:
        while self._waiting and len(self._running) < self.config.max_batch:
            active = self._waiting.popleft()
            self._running[active.request.request_id] = active
        if not self._running:
            return False
        await asyncio.sleep(self.config.step_time_s)
        self.counters.steps += 1
        finished: dict[int, list[str]] = {}
        for request_id, active in list(self._running.items()):
            active.remaining -= 1
            if active.remaining <= 0:
                del self._running[request_id]
                self._held.discard(request_id)
                finished.setdefault(active.request.client_index, []).append(request_id)
        for client_index, request_ids in finished.items():
            self.counters.finished += len(request_ids)
            self._send_finished(client_index, request_ids)
        return True

    async def _dummy_step(self) -> None:
        await asyncio.sleep(self.config.step_time_s)
        self.counters.dummy_steps += 1

    async def _global_unfinished(self, local_unfinished: bool) -> bool:
        """The per-step collective; the reduced flag counts on sync steps only."""
        self.step_counter += 1
        total = await self._all_reduce(int(local_unfinished))
        interval = self.config.dp_sync_interval
        if self.step_counter != 1 and self.step_counter % interval != 0:
            return True
        return total > 0

    async def _all_reduce(self, value: int) -> int:
        client = self._collective
        if client is None:
            raise RuntimeError("lockstep engine has no collective client")
        self._seq += 1
        self.counters.collectives += 1
        seq, wave, step = self._seq, self.current_wave, self.step_counter
        try:
            return await client.all_reduce(seq, value, wave=wave, step=step)
        except CollectiveHang as hang:
            recorded = self._record_hang(hang)
        while self.config.on_hang == "wait":
            try:
                return await client.wait_result(
                    seq, wave=wave, step=step, already_waited_s=recorded.waited_s
                )
            except CollectiveHang as hang:
                recorded = self._record_hang(hang)
        raise recorded

    def _record_hang(self, hang: CollectiveHang) -> CollectiveHang:
        self.hangs.append(hang)
        logger.error("COLLECTIVE HANG: %s", hang)
        return hang

    # ------------------------------------------------------------ requests

    def _handle(self, request: InboundRequest) -> None:
        if isinstance(request, AddRequest):
            self._on_add(request)
        elif isinstance(request, AbortRequests):
            self._on_abort(request.request_ids)
        elif isinstance(request, StartDpWave):
            self._on_start_dp_wave(request.wave, request.exclude)
        elif isinstance(request, UtilityCall):
            self._on_utility(request)

    def _on_add(self, request: AddRequest) -> None:
        try:
            sim = decode_sim_request(request.frames[0])
        except ProtocolError as exc:
            self.counters.dropped += 1
            logger.warning("rank %d: dropped an ADD this engine cannot run: %s", self.rank, exc)
            return
        if sim.request_id in self._held:
            logger.warning("rank %d: duplicate request id %r ignored", self.rank, sim.request_id)
            return
        self._held.add(sim.request_id)
        self._waiting.append(_Active(sim, sim.decode_steps))
        self.counters.added += 1
        if not (self.config.lockstep and self.agent.has_coordinator):
            return
        if sim.current_wave > self.current_wave:
            self.current_wave = sim.current_wave
        if not self.engines_running:
            # Running first: this engine is the one left out of the wake it triggers.
            self.engines_running = True
            self._send_start_wave(self.current_wave)

    def _on_abort(self, request_ids: list[str]) -> None:
        gone: dict[int, list[str]] = {}
        wanted = self._held.intersection(request_ids)
        if not wanted:
            return
        self._held -= wanted
        for request_id in wanted:
            active = self._running.pop(request_id, None)
            if active is not None:
                gone.setdefault(active.request.client_index, []).append(request_id)
        kept: deque[_Active] = deque()
        for active in self._waiting:
            if active.request.request_id in wanted:
                gone.setdefault(active.request.client_index, []).append(active.request.request_id)
            else:
                kept.append(active)
        self._waiting = kept
        for client_index, ids in gone.items():
            self.counters.aborted += len(ids)
            self._send_finished(client_index, ids)

    def _on_start_dp_wave(self, wave: int, exclude: int | None) -> None:
        if not self.config.lockstep:
            logger.error("rank %d: dense engine got START_DP_WAVE; ignored", self.rank)
            return
        if self.ignore_start_wave:
            logger.info("rank %d: ignoring START_DP_WAVE [%d, %s]", self.rank, wave, exclude)
            return
        if exclude != self.rank and wave >= self.current_wave:
            self.current_wave = wave
            if not self.engines_running:
                self.engines_running = True
                self.counters.wakes_applied.append(wave)

    def _on_utility(self, call: UtilityCall) -> None:
        # Shaped like vLLM's UtilityOutput array: [call_id, failure_message, result].
        failure = f"simulated engine has no utility method {call.method!r}"
        with contextlib.suppress(IndexError):
            self.agent.send_output(
                call.client_index, EngineCoreOutputs(utility_output=[call.call_id, failure, None])
            )

    # ------------------------------------------------------------ outbound

    def _maybe_publish_counts(self) -> None:
        if not (self.config.publish_stats and self.agent.has_coordinator):
            return
        counts = (len(self._running), len(self._waiting))
        if counts == self._last_counts:
            return
        self._last_counts = counts
        kv = min(1.0, len(self._running) / self.config.max_batch)
        lockstep = self.config.lockstep
        self.agent.send_stats(
            waiting=counts[1],
            running=counts[0],
            kv_cache_usage=kv,
            step_counter=self.step_counter if lockstep else 0,
            current_wave=self.current_wave if lockstep else 0,
        )

    def _send_start_wave(self, wave: int) -> None:
        self.counters.start_waves_sent.append(wave)
        self.agent.send_start_wave(wave)

    def _send_wave_complete(self, wave: int) -> None:
        self.counters.wave_completes_sent.append(wave)
        if self.agent.has_coordinator:
            self.agent.send_wave_complete(wave)
        elif self.agent.num_outputs:
            # Without a coordinator vLLM tells its own frontend (client 0) instead.
            self.agent.send_output(0, EngineCoreOutputs(wave_complete=wave))

    def _send_finished(self, client_index: int, request_ids: list[str]) -> None:
        try:
            self.agent.send_output(client_index, EngineCoreOutputs(finished_requests=request_ids))
        except IndexError as exc:
            logger.warning("rank %d: finished requests not reported: %s", self.rank, exc)

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly report of what this engine did."""
        c = self.counters
        return {
            "rank": self.rank,
            "wave": self.current_wave,
            "running": self.engines_running,
            "steps": c.steps,
            "dummy_steps": c.dummy_steps,
            "collectives": c.collectives,
            "added": c.added,
            "finished": c.finished,
            "aborted": c.aborted,
            "dropped": c.dropped,
            "start_waves_sent": c.start_waves_sent[-20:],
            "wave_completes_sent": c.wave_completes_sent[-20:],
            "hang_count": len(self.hangs),
            "hangs": [str(h) for h in self.hangs[-10:]],
            "failed": None if self.failed is None else str(self.failed),
        }


# ---------------------------------------------------------------- a group in one process


class SimEngineGroup:
    """`engines` simulated ranks as tasks in this process, sharing one collective hub."""

    def __init__(
        self,
        handshake_address: str,
        engines: int,
        *,
        config: SimConfig | None = None,
        collective_address: str = "tcp://127.0.0.1:0",
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        base = config if config is not None else SimConfig()
        self.config = replace(base, world_size=engines)
        self.handshake_address = handshake_address
        self._collective_address = collective_address
        self._context = context
        self.hub: CollectiveHub | None = None
        self.engines: list[SimEngine] = []

    async def start(self) -> None:
        """Start the hub and every engine; all handshakes run concurrently."""
        collective: str | None = None
        if self.config.lockstep:
            self.hub = CollectiveHub(
                self._collective_address,
                self.config.world_size,
                rank_start=self.config.rank_start,
                context=self._context,
            )
            collective = await self.hub.start()
        self.engines = [
            SimEngine(
                rank,
                self.handshake_address,
                config=self._rank_config(rank),
                collective_address=collective,
                context=self._context,
            )
            for rank in self.config.group_ranks
        ]
        loop = asyncio.get_running_loop()
        starts = [loop.create_task(engine.start()) for engine in self.engines]
        # One engine failing to join means the others would wait out the
        # coordinator's READY gate for nothing: stop them all at once.
        done, pending = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        errors = [t.exception() for t in done if not t.cancelled()]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.stop()
            raise error

    def _rank_config(self, rank: int) -> SimConfig:
        if self.config.engine_id is None:
            return self.config
        return replace(self.config, engine_id=f"{self.config.engine_id}-{rank}")

    def engine(self, rank: int) -> SimEngine:
        return self.engines[rank - self.config.rank_start]

    @property
    def hangs(self) -> list[CollectiveHang]:
        return [hang for engine in self.engines for hang in engine.hangs]

    async def stop(self) -> None:
        await asyncio.gather(*(engine.stop() for engine in self.engines), return_exceptions=True)
        if self.hub is not None:
            await self.hub.close()
            self.hub = None


# ---------------------------------------------------------------- command line

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_REFUSED = 2
EXIT_HANG = 3
EXIT_STARTUP = 4

_EPILOG = """\
Exit status: 0 after SIGTERM/SIGINT, 2 if the coordinator refused an engine,
3 if an engine died of a collective hang (--on-hang fail), 4 if startup failed
or timed out, 1 otherwise. On exit one JSON line per engine is printed to
stdout with what it did (steps, waves sent, hangs).

Examples:
  python -m coordinator.sim group --engines 2 --addr-file /tmp/coord.json
  python -m coordinator.sim hub --engines 2 --bind ipc:///tmp/sim-hub
  python -m coordinator.sim engine --rank 1 --engines 2 --addr-file /tmp/coord.json \\
      --collective ipc:///tmp/sim-hub
"""


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--addr-file",
        help="the coordinator's JSON address file (its 'handshake' key is used); "
        "waited for if it does not exist yet",
    )
    where.add_argument("--handshake", help="the coordinator's handshake address")
    p.add_argument("--engines", type=int, required=True, help="DP group size (world size)")
    p.add_argument("--rank-start", type=int, default=0, help="first global rank of the group")
    p.add_argument("--step-ms", type=float, default=5.0, help="time per step, ms (default 5)")
    p.add_argument("--max-batch", type=int, default=64, help="max running requests per engine")
    p.add_argument(
        "--sync-interval",
        type=int,
        default=16,
        help="honour the reduced unfinished flag every N steps, as vLLM's dp_sync_interval",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=10.0,
        help="seconds a rank waits in a collective before recording a hang (default 10)",
    )
    p.add_argument(
        "--on-hang",
        choices=["fail", "wait"],
        default="fail",
        help="after a collective hang: die like a timed-out vLLM engine, or keep waiting",
    )
    p.add_argument("--dense", action="store_true", help="no waves, no collective (non-MoE)")
    p.add_argument("--no-stats", action="store_true", help="send no load stats (external LB)")
    p.add_argument(
        "--vllm-shaped",
        action="store_true",
        help="send exactly vLLM 0.33's handshake bytes and do not wait for ACCEPTED",
    )
    p.add_argument("--config-hash", help="parallel_config_hash sent in READY")
    p.add_argument(
        "--heartbeat",
        type=float,
        default=2.0,
        help="seconds of coordinator silence before a heartbeat; 0 disables",
    )
    p.add_argument("--ready-timeout", type=float, default=120.0, help="startup wait, seconds")
    p.add_argument(
        "--wait-addr-file", type=float, default=30.0, help="seconds to wait for --addr-file"
    )
    p.add_argument(
        "--ignore-start-wave",
        type=int,
        action="append",
        default=[],
        metavar="RANK",
        help="fault injection: this rank drops START_DP_WAVE (repeatable)",
    )
    p.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this engine's secret key file (NAME.key_secret): CURVE to a coordinator on tcp",
    )
    p.add_argument(
        "--curve-server-key",
        metavar="FILE",
        help="the coordinator's public key file (NAME.key); needs --curve-secret-key",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.sim",
        description="Simulated lockstep DP engines that speak vLLM 0.33's engine wire "
        "protocol to a coordinator. Lockstep ranks meet in a per-step collective "
        "at a hub; a rank that is never woken makes its peers block there, and the "
        "block is reported as a collective hang.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    group = sub.add_parser(
        "group",
        help="run every rank of a group in this process, with its collective hub",
        description="Run --engines simulated ranks as tasks in one process; the "
        "collective hub runs here too.",
    )
    _add_engine_options(group)
    group.add_argument(
        "--collective",
        default="tcp://127.0.0.1:0",
        help="address the hub binds (default: a free TCP port on 127.0.0.1)",
    )

    engine = sub.add_parser(
        "engine",
        help="run one rank (so a test can kill -9 it alone)",
        description="Run one simulated rank. All ranks of a lockstep group must use the "
        "same --collective address; exactly one process binds it: a 'hub' process, or "
        "one engine given --host-collective.",
    )
    _add_engine_options(engine)
    engine.add_argument("--rank", type=int, required=True, help="this engine's global rank")
    engine.add_argument("--collective", help="collective hub address (required unless --dense)")
    engine.add_argument(
        "--host-collective", action="store_true", help="bind the collective hub in this process"
    )
    engine.add_argument("--engine-id", help="engine_id sent in HELLO (default: random)")

    hub = sub.add_parser(
        "hub",
        help="run only the collective hub of a group",
        description="Bind the per-step collective hub for a group of simulated engines.",
    )
    hub.add_argument("--bind", required=True, help="address to bind, e.g. ipc:///tmp/hub")
    hub.add_argument("--engines", type=int, required=True, help="DP group size")
    hub.add_argument("--rank-start", type=int, default=0)
    hub.add_argument("--log-level", default="INFO")
    hub.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    return parser


def _config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        world_size=args.engines,
        rank_start=args.rank_start,
        step_time_s=args.step_ms / 1000.0,
        max_batch=args.max_batch,
        dp_sync_interval=args.sync_interval,
        collective_timeout_s=args.collective_timeout,
        on_hang=args.on_hang,
        lockstep=not args.dense,
        publish_stats=not args.no_stats,
        vllm_shaped=args.vllm_shaped,
        engine_id=getattr(args, "engine_id", None),
        parallel_config_hash=args.config_hash,
        heartbeat_interval_s=args.heartbeat if args.heartbeat > 0 else None,
        ready_timeout_s=args.ready_timeout,
        curve_secret_key=args.curve_secret_key,
        curve_server_key=args.curve_server_key,
    )


async def _handshake_address(args: argparse.Namespace) -> str:
    if args.handshake:
        return str(args.handshake)
    path = str(args.addr_file)
    deadline = time.monotonic() + args.wait_addr_file
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                return str(json.load(f)["handshake"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            if time.monotonic() >= deadline:
                raise EngineStartupError(
                    f"no usable address file at {path} after {args.wait_addr_file:g} s"
                ) from None
            await asyncio.sleep(0.05)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def _until_stop_or_failure(stop: asyncio.Event, engines: Sequence[SimEngine]) -> None:
    waiters = [asyncio.ensure_future(stop.wait())]
    waiters += [asyncio.ensure_future(engine.done.wait()) for engine in engines]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _exit_status(engines: Sequence[SimEngine]) -> int:
    for engine in engines:
        print(json.dumps(engine.summary()), flush=True)
    failures = [engine.failed for engine in engines if engine.failed is not None]
    if any(isinstance(f, CollectiveHang) for f in failures):
        return EXIT_HANG
    return EXIT_ERROR if failures else EXIT_OK


async def _run_group(args: argparse.Namespace) -> int:
    stop = _stop_event()
    group = SimEngineGroup(
        await _handshake_address(args),
        args.engines,
        config=_config_from_args(args),
        collective_address=args.collective,
    )
    await group.start()
    for rank in args.ignore_start_wave:
        group.engine(rank).ignore_start_wave = True
    try:
        await _until_stop_or_failure(stop, group.engines)
    finally:
        await group.stop()
    return _exit_status(group.engines)


async def _run_engine(args: argparse.Namespace) -> int:
    config = _config_from_args(args)
    stop = _stop_event()
    hub: CollectiveHub | None = None
    collective = args.collective
    if config.lockstep and args.host_collective:
        hub = CollectiveHub(collective, config.world_size, rank_start=config.rank_start)
        collective = await hub.start()
    engine = SimEngine(
        args.rank, await _handshake_address(args), config=config, collective_address=collective
    )
    engine.ignore_start_wave = args.rank in args.ignore_start_wave
    try:
        await engine.start()
        await _until_stop_or_failure(stop, [engine])
    finally:
        await engine.stop()
        if hub is not None:
            await hub.close()
    return _exit_status([engine])


async def _run_hub(args: argparse.Namespace) -> int:
    stop = _stop_event()
    hub = CollectiveHub(args.bind, args.engines, rank_start=args.rank_start)
    address = await hub.start()
    print(json.dumps({"collective": address}), flush=True)
    try:
        await stop.wait()
    finally:
        await hub.close()
    return EXIT_OK


async def _dispatch(args: argparse.Namespace) -> int:
    try:
        if args.command == "group":
            return await _run_group(args)
        if args.command == "engine":
            return await _run_engine(args)
        return await _run_hub(args)
    except EngineRefused as exc:
        logger.error("%s", exc)
        return EXIT_REFUSED
    except EngineStartupError as exc:
        logger.error("%s", exc)
        return EXIT_STARTUP


def _run_loop(main: Any, loop_kind: str) -> int:
    use_uvloop = loop_kind == "uvloop"
    if loop_kind == "auto":
        use_uvloop = importlib.util.find_spec("uvloop") is not None
    loop: asyncio.AbstractEventLoop
    if use_uvloop:
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return int(loop.run_until_complete(main))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "engine" and not args.dense and not args.collective:
        parser.error("engine: --collective is required for a lockstep engine (or use --dense)")
    if args.command in ("group", "engine"):
        try:
            CurveClientKeys.from_options(args.curve_secret_key, args.curve_server_key)
        except ValueError as exc:
            parser.error(str(exc))
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [sim {os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return _run_loop(_dispatch(args), args.loop)


if __name__ == "__main__":
    raise SystemExit(main())
