"""The per-step collective of simulated lockstep engines: a hub and its clients.

Real lockstep engines meet in collectives (the MoE all-to-all, and vLLM's
all-reduce of "has unfinished requests") on every step. Here every running rank
sends `(seq, has_unfinished)` to a `CollectiveHub` (a ZMQ ROUTER that a rank or
the group runner binds) after each step, real or dummy, and waits for the sum.
`seq` counts the collectives a rank has entered, so ranks that stepped the same
number of times meet in the same collective. A rank that never woke up never
enters it, and its peers block there, exactly as GPUs would. The wait is
bounded: when it runs out, the waiting rank asks the hub which ranks have
arrived and raises a `CollectiveHang` naming the missing ones.

The hub's messages are this module's own (tagged msgspec arrays); nothing else
speaks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import zmq
import zmq.asyncio

from coordinator._zmq import COLLECTIVE, bind, connect

__all__ = ["CollectiveClient", "CollectiveHang", "CollectiveHub"]

logger = logging.getLogger("coordinator.sim")


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
        sock, self.address = bind(self._ctx, zmq.ROUTER, self.requested_address, COLLECTIVE)
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
        self._sock: zmq.asyncio.Socket | None = connect(ctx, zmq.DEALER, address, COLLECTIVE)

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
