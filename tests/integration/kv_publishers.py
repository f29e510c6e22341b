"""Stand-ins for vLLM 0.33's KV event publishers, one per rank, for tests.

Each speaks this project's encoders, which produce the bytes vLLM's
``ZmqEventPublisher`` sends (checked against vLLM's own code in
``tests/compat``): an XPUB on the rank's offset port (an XPUB, unlike vLLM's
PUB, shows when the coordinator's subscription arrived, so nothing is lost to
a slow join) and a replay ROUTER that answers from a buffer of every batch. A
batch can be kept out of the live stream while staying in the buffer.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import zmq
import zmq.asyncio

from coordinator.protocol.kv_events import (
    KVEventBatch,
    decode_replay_request,
    encode_kv_batch,
    encode_kv_frames,
    encode_replay_batch,
    encode_replay_end,
)

STEP = 5.0


class Publisher:
    """One rank's KV event publisher: live XPUB, replay ROUTER, a buffer of every batch."""

    def __init__(self, ctx: zmq.asyncio.Context, rank: int, live_port: int,
                 replay_port: int) -> None:
        self.rank = rank
        self.live = ctx.socket(zmq.XPUB)
        self.live.setsockopt(zmq.LINGER, 0)
        self.live.bind(f"tcp://127.0.0.1:{live_port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.replays_served: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def wait_subscribed(self) -> None:
        assert await self.live.poll(int(STEP * 1000)), f"rank {self.rank} never subscribed"
        assert (await self.live.recv())[:1] == b"\x01"

    def publish(self, *events: Any, deliver: bool = True) -> int:
        seq = len(self.buffer)
        batch = KVEventBatch(time.time(), list(events), self.rank)
        self.buffer.append((seq, encode_kv_batch(batch)))
        if deliver:
            self.live.send_multipart(encode_kv_frames(seq, batch))
        return seq

    def serve_replays(self) -> None:
        self._task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, start = decode_replay_request(await self.replay.recv_multipart())
            self.replays_served.append(start)
            for seq, payload in self.buffer:
                if seq >= start:
                    await self.replay.send_multipart([identity, *encode_replay_batch(seq,
                                                                                     payload)])
            await self.replay.send_multipart([identity, *encode_replay_end()])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.live.close(0)
        self.replay.close(0)



def bind_publishers(ctx: zmq.asyncio.Context, count: int) -> tuple[list[Publisher], int, int]:
    """``count`` publishers on consecutive free loopback ports: (publishers, live base,
    replay base), each serving replays."""
    for _ in range(50):
        live, replay = random.randrange(20000, 60000, 2), random.randrange(20000, 60000, 2)
        made: list[Publisher] = []
        try:
            for rank in range(count):
                made.append(Publisher(ctx, rank, live + rank, replay + rank))
        except zmq.ZMQError:
            for publisher in made:
                publisher.close()
            continue
        for publisher in made:
            publisher.serve_replays()
        return made, live, replay
    raise AssertionError("no free ports for the publishers")
