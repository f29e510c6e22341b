"""A simulated engine's KV event publisher, on vLLM 0.33's endpoints and bytes.

Like vLLM's `ZmqEventPublisher`, one per DP rank:

* a PUB socket on the configured `endpoint` offset by the rank
  (`coordinator.protocol.kv_events.offset_endpoint`, vLLM's rule), bound when
  the endpoint has a wildcard host or is ipc/inproc and connected otherwise;
  every batch goes out as `[topic, seq (8 bytes big-endian), payload]`, `seq`
  counting from 0 for this publisher, the payload a msgpack `KVEventBatch`
  `[ts, events, data_parallel_rank]`;
* with a `replay_endpoint` (offset the same way, always bound), a ROUTER
  that answers `[identity, b"", start_seq]` with every buffered batch whose
  seq is at least `start_seq`, as `[identity, b"", topic, seq, payload]`, and
  then the end marker `[identity, b"", b"", END_SEQ, b""]`. The last
  `buffer_steps` batches are kept.

Differences, all on purpose: sends never block the engine (a PUB drops at
its high-water mark, as vLLM's does; replay answers are queued up to twice
the buffer, as vLLM's), a replay request that is not three frames with an
8-byte start is dropped and counted (vLLM logs it), and `tcp://*:0` is
refused (vLLM then binds the node's address with a port the OS picks; give a
fixed port). `config` is the `KVEventsConfig` map a vLLM engine puts in its
ready greeting (`kv_events_config`): the resolved endpoints, so whoever reads
the greeting learns where this rank publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.kv_events import (
    KVEvent,
    KVEventBatch,
    decode_replay_request,
    encode_kv_batch,
    encode_replay_batch,
    encode_replay_end,
    encode_seq,
    offset_endpoint,
    publisher_binds,
)

__all__ = ["KVEventPublisher", "KVEventsConfig", "resolve_endpoints"]

logger = logging.getLogger("coordinator.sim")


class KVEventsConfig(msgspec.Struct):
    """vLLM 0.33's `KVEventsConfig` as it travels in the ready greeting: a map of 8 keys."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def resolve_endpoints(
    endpoint: str, replay_endpoint: str | None, rank: int
) -> tuple[str, str | None]:
    """Rank ``rank``'s live and replay endpoints; ValueError for ones it cannot use."""
    for name, value in (("endpoint", endpoint), ("replay endpoint", replay_endpoint)):
        if value is not None and value.startswith("tcp://") and value.endswith(":0"):
            raise ValueError(
                f"KV events {name} {value!r}: port 0 is not supported by the simulated "
                f"engines; give a fixed port (ranks add their rank to it)"
            )
    # vLLM's rule, which refuses endpoints it cannot offset for this rank.
    live = offset_endpoint(endpoint, rank)
    return live, None if replay_endpoint is None else offset_endpoint(replay_endpoint, rank)


class KVEventPublisher:
    """One rank's live stream and replay buffer; `publish` is a plain call."""

    def __init__(
        self,
        endpoint: str,
        rank: int,
        *,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be at least 1, got {buffer_steps}")
        self.rank = rank
        self.endpoint, self.replay_endpoint = resolve_endpoints(endpoint, replay_endpoint, rank)
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.topic = topic
        self._topic = topic.encode()
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.published = 0
        self.replays = 0
        self.bad_replay_requests = 0

    @property
    def config(self) -> KVEventsConfig:
        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            buffer_steps=self.buffer_steps,
            hwm=self.hwm,
            topic=self.topic,
        )

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def start(self) -> None:
        """Open the sockets (bind or connect as vLLM's publisher does) and serve replays."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        try:
            if publisher_binds(self.endpoint):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        if self.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
            try:
                replay.bind(self.replay_endpoint)
            except zmq.ZMQError:
                replay.close(linger=0)
                pub.close(linger=0)
                self._pub = None
                raise
            self._replay = replay
            self._task = asyncio.get_running_loop().create_task(
                self._serve_replay(replay), name=f"kv-replay-{self.rank}"
            )

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts,
            events=list(events),
            data_parallel_rank=self.rank,
        )
        payload = encode_kv_batch(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart(
                    [self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK
                )
        self.published += 1
        return seq

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                identity, start = decode_replay_request(frames)
            except ProtocolError as exc:
                self.bad_replay_requests += 1
                if self.bad_replay_requests <= 10:
                    logger.warning("rank %d: bad KV replay request: %s", self.rank, exc)
                continue
            self.replays += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart(
                        [identity, *encode_replay_batch(seq, payload, self._topic)]
                    )
            await sock.send_multipart([identity, *encode_replay_end()])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
