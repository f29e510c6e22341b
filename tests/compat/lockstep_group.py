"""A lockstep (MoE) group of engines that behave as a given vLLM release's do, and that
release's own API-server client, `DPLBAsyncMPClient`, built around them.

The engines are simulated, but their wave rules are each release's (its
`DPEngineCoreProc`: `add_request`, `START_DP_WAVE`, the busy loop's mirror
`start_wave` and `wave_complete`), and every message they send the coordinator
is encoded by that release's own `EngineCoreOutputs`, `SchedulerStats` and
`MsgpackEncoder`. The difference that matters, by release:

* 0.29-0.32: a paused engine that gets a request stamped with its own current
  wave sends nothing; the API server's client sends `[engine, wave]` up
  front_publish instead (its FIRST_REQ path), and the coordinator must wake
  the others.
* 0.33: that engine sends `start_wave` itself; the client sends no wake.

Lockstep is modelled as the collective it is: a step runs only when every rank
is in the loop (running, or holding a request). A rank holding a request
while another is paused is blocked, which is the hang the test looks for.

The client is vLLM's class without its constructor (which would start
engines); it is given exactly what `add_request_async`, its engine choice and
its stats task read, and its stats task runs for real against the
coordinator's front_publish: it reads the 3-wide rows and the wave, and (before
0.33) sends the first-request wake.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections import Counter
from typing import Any

import msgspec
import zmq
import zmq.asyncio

START_DP_WAVE = b"\x02"
READY = b"READY"
STEPS_PER_REQUEST = 3


def release(version: str) -> tuple[int, int]:
    major, minor, *_ = version.split(".")
    return int(major), int(minor)


def engines_wake_themselves(version: str) -> bool:
    """From 0.33 on, a paused engine given a request of its own wave sends start_wave."""
    return release(version) >= (0, 33)


class Engine:
    """One rank's wave state and sockets."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.identity = rank.to_bytes(2, "little")
        self.wave = 0
        self.running = False
        self.requests: list[list[Any]] = []  # [request id, steps left]
        self.step_counter = 0
        self.last_counts: tuple[int, int] | None = None
        self.inputs: zmq.asyncio.Socket | None = None
        self.sub: zmq.asyncio.Socket | None = None
        self.push: zmq.asyncio.Socket | None = None

    @property
    def in_loop(self) -> bool:
        return self.running or bool(self.requests)


class LockstepGroup:
    """`size` ranks of release `version`, connected to a coordinator and a client's ROUTER."""

    def __init__(self, version: str, vllm: dict[str, types.ModuleType], size: int,
                 ctx: zmq.asyncio.Context) -> None:
        self.version = version
        engine_mod = vllm["vllm.v1.engine"]
        self.outputs_cls = engine_mod.EngineCoreOutputs
        self.stats_cls = vllm["vllm.v1.metrics.stats"].SchedulerStats
        self.encoder = vllm["vllm.v1.serial_utils"].MsgpackEncoder()
        self.wave_field = engine_mod.EngineCoreRequest.__struct_fields__.index("current_wave")
        self.id_field = engine_mod.EngineCoreRequest.__struct_fields__.index("request_id")
        self.ctx = ctx
        self.engines = [Engine(rank) for rank in range(size)]
        self.finished: dict[str, float] = {}
        self.sent_start_waves: list[int] = []
        self.blocked_steps = 0
        self._task: asyncio.Task[None] | None = None

    # -- set-up --

    async def connect(self, client_inputs: str, addresses: dict[str, str],
                      timeout: float) -> None:
        for engine in self.engines:
            engine.inputs = self._socket(zmq.DEALER, client_inputs, engine.identity)
            engine.sub = self._socket(zmq.XSUB, addresses["back_publish"], engine.identity)
            engine.push = self._socket(zmq.PUSH, addresses["back_output"], None)
            await engine.sub.send(b"\x01")
        for engine in self.engines:
            assert engine.sub is not None
            assert await engine.sub.poll(int(timeout * 1000)), f"rank {engine.rank}: no READY"
            assert await engine.sub.recv_multipart() == [READY]
            assert engine.inputs is not None
            await engine.inputs.send(b"")  # so that the client's ROUTER can address it
        self._task = asyncio.ensure_future(self._run())

    def _socket(self, kind: int, address: str, ident: bytes | None) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if ident is not None:
            sock.setsockopt(zmq.IDENTITY, ident)
        sock.connect(address)
        return sock

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with_exc = await asyncio.gather(self._task, return_exceptions=True)
            for exc in with_exc:
                if exc is not None and not isinstance(exc, asyncio.CancelledError):
                    raise exc
        for engine in self.engines:
            for sock in (engine.inputs, engine.sub, engine.push):
                if sock is not None:
                    sock.close(0)

    # -- what a release's engine does --

    async def _report(self, engine: Engine, **fields: Any) -> None:
        assert engine.push is not None
        outputs = self.outputs_cls(engine_index=engine.rank, **fields)
        await engine.push.send_multipart(self.encoder.encode(outputs))

    async def _publish_counts(self, engine: Engine) -> None:
        counts = (sum(1 for _ in engine.requests), 0)
        if counts != engine.last_counts:
            engine.last_counts = counts
            stats = self.stats_cls(num_running_reqs=counts[0], num_waiting_reqs=counts[1],
                                   kv_cache_usage=0.0, step_counter=engine.step_counter,
                                   current_wave=engine.wave)
            await self._report(engine, scheduler_stats=stats)

    async def _start_wave(self, engine: Engine) -> None:
        self.sent_start_waves.append(engine.wave)
        await self._report(engine, start_wave=engine.wave)

    async def _add_request(self, engine: Engine, payload: bytes) -> None:
        fields = msgspec.msgpack.decode(payload)
        request_wave = fields[self.wave_field]
        engine.requests.append([fields[self.id_field], STEPS_PER_REQUEST])
        if engines_wake_themselves(self.version):
            if request_wave > engine.wave:
                engine.wave = request_wave
            if not engine.running:
                engine.running = True
                await self._start_wave(engine)
        elif request_wave != engine.wave:
            if request_wave > engine.wave:
                engine.wave = request_wave
            elif not engine.running:
                engine.running = True
                await self._start_wave(engine)

    def _start_dp_wave(self, engine: Engine, payload: bytes) -> None:
        new_wave, exclude = msgspec.msgpack.decode(payload)
        if exclude != engine.rank and new_wave >= engine.wave:
            engine.wave = new_wave
            engine.running = True

    async def _inbound(self, engine: Engine) -> None:
        assert engine.inputs is not None and engine.sub is not None
        while await engine.inputs.poll(0):
            frames = await engine.inputs.recv_multipart()
            if frames[0] == b"\x00":  # ADD
                await self._add_request(engine, frames[1])
        while await engine.sub.poll(0):
            frames = await engine.sub.recv_multipart()
            if frames[0] == START_DP_WAVE:
                self._start_dp_wave(engine, frames[1])

    async def _run(self) -> None:
        while True:
            was_running = [engine.running for engine in self.engines]
            for engine in self.engines:
                await self._inbound(engine)
            if not any(engine.in_loop for engine in self.engines):
                await asyncio.sleep(0.005)
                continue
            if not all(engine.in_loop for engine in self.engines):
                # Some rank is in its first collective and some rank is not: blocked.
                self.blocked_steps += 1
                await asyncio.sleep(0.005)
                continue
            for engine in self.engines:
                if engine.requests:
                    engine.requests[0][1] -= 1
                    if engine.requests[0][1] == 0:
                        self.finished[engine.requests.pop(0)[0]] = time.monotonic()
                engine.step_counter += 1
                await self._publish_counts(engine)
            if any(engine.requests for engine in self.engines):
                for engine in self.engines:
                    engine.running = True
                if not was_running[0]:  # rank 0's mirror of the wave's start
                    await self._start_wave(self.engines[0])
            else:
                await self._report(self.engines[0], wave_complete=self.engines[0].wave)
                for engine in self.engines:
                    engine.running = False
                    engine.wave += 1
                    engine.step_counter = 0
            await asyncio.sleep(0.002)

    def paused_at(self) -> int | None:
        """The wave every rank waits in, if all are paused with nothing to do."""
        waves = {engine.wave for engine in self.engines}
        if len(waves) == 1 and not any(engine.in_loop for engine in self.engines):
            return waves.pop()
        return None


def build_client(version: str, vllm: dict[str, types.ModuleType], ctx: zmq.asyncio.Context,
                 inputs: str, front_publish: str, size: int) -> Any:
    """That release's `DPLBAsyncMPClient`, its input ROUTER bound at `inputs`."""
    module = vllm["vllm.v1.engine.core_client"]
    client = object.__new__(module.DPLBAsyncMPClient)
    client.ctx = ctx
    client.client_index = 0
    client.client_count = 1
    client.current_wave = 0
    client.engines_running = False
    client.reqs_in_flight = {}
    client.streaming_reqs = set()
    client.engine_inflight = Counter()
    client.core_engines = [rank.to_bytes(2, "little") for rank in range(size)]
    client.core_engine = client.core_engines[0]
    client.lb_engines = [[0, 0, 0.0] for _ in range(size)]
    client.eng_start_index = 0
    client.engine_ranks_managed = list(range(size))
    client.stats_update_address = front_publish
    client.encoder = vllm["vllm.v1.serial_utils"].MsgpackEncoder()
    client.resources = types.SimpleNamespace(
        stats_update_task=None, output_queue_task=object(), engine_dead=False,
        stats_update_socket=None, first_req_send_socket=None, first_req_rcv_socket=None,
        scale_send_socket=None, scale_rcv_socket=None)
    client.input_socket = ctx.socket(zmq.ROUTER)
    client.input_socket.setsockopt(zmq.LINGER, 0)
    client.input_socket.bind(inputs)
    make_zmq_socket = module.make_zmq_socket
    inproc = module.get_open_zmq_inproc_path
    # The in-process PAIR the release's stats task reads: FIRST_REQ before 0.33.
    name = "scale" if engines_wake_themselves(version) else "first_req"
    address = inproc()
    setattr(client, f"{name}_sock_addr", address)
    sock = make_zmq_socket(ctx, address, zmq.PAIR, bind=True)
    setattr(client, f"{name}_send_socket", sock)
    setattr(client.resources, f"{name}_send_socket", sock)
    return client


def close_client(client: Any) -> None:
    task = client.resources.stats_update_task
    if task is not None:
        task.cancel()
    for sock in (client.input_socket, client.resources.first_req_send_socket,
                 client.resources.scale_send_socket):
        if sock is not None:
            sock.close(0)


def new_request(vllm: dict[str, types.ModuleType], request_id: str) -> Any:
    return vllm["vllm.v1.engine"].EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], mm_features=None,
        sampling_params=None, pooling_params=None, arrival_time=time.time(),
        lora_request=None, cache_salt=None, data_parallel_rank=None)
