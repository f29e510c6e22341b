"""Every rank of a simulated group as tasks in one process, with its collective hub."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import zmq.asyncio

from coordinator.sim.collective import CollectiveHang, CollectiveHub
from coordinator.sim.engine import SimConfig, SimEngine

__all__ = ["SimEngineGroup"]


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
