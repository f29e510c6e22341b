"""The simulated engines' per-step collective: a hub and clients over real ipc sockets."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from coordinator.sim import CollectiveClient, CollectiveHang, CollectiveHub

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a short temp dir when tmp_path is too long for a socket path."""
    if len(str(tmp_path)) <= 90:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="dph-"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def start_hub(
    ctx: zmq.asyncio.Context, ipc_dir: Path, world_size: int, *, rank_start: int = 0
) -> CollectiveHub:
    hub = CollectiveHub(f"ipc://{ipc_dir}/hub", world_size, rank_start=rank_start, context=ctx)
    await hub.start()
    return hub


def clients(
    ctx: zmq.asyncio.Context, hub: CollectiveHub, ranks: range, timeout_s: float = 5.0
) -> list[CollectiveClient]:
    return [
        CollectiveClient(hub.address, rank, timeout_s=timeout_s, query_timeout_s=0.5, context=ctx)
        for rank in ranks
    ]


async def test_every_rank_gets_the_sum_of_every_round(
    ctx: zmq.asyncio.Context, ipc_dir: Path
) -> None:
    hub = await start_hub(ctx, ipc_dir, 4)
    group = clients(ctx, hub, range(4))
    rng = random.Random(7)
    try:
        for seq in range(1, 31):
            values = [rng.randint(0, 1) for _ in group]
            # Contributions arrive in a different order every round.
            order = list(range(4))
            rng.shuffle(order)
            tasks = {}
            for i in order:
                tasks[i] = asyncio.ensure_future(
                    group[i].all_reduce(seq, values[i], wave=0, step=seq)
                )
                await asyncio.sleep(0)
            results = [await tasks[i] for i in range(4)]
            assert results == [sum(values)] * 4, (seq, values, results)
        assert hub.completed == 30
        assert hub.pending() == {}
    finally:
        for client in group:
            client.close()
        await hub.close()


async def test_ranks_can_be_a_window_of_global_ranks(
    ctx: zmq.asyncio.Context, ipc_dir: Path
) -> None:
    hub = await start_hub(ctx, ipc_dir, 2, rank_start=4)
    group = clients(ctx, hub, range(4, 6))
    try:
        totals = await asyncio.gather(group[0].all_reduce(1, 3), group[1].all_reduce(1, 4))
        assert totals == [7, 7]
    finally:
        for client in group:
            client.close()
        await hub.close()


async def test_a_missing_rank_is_named_within_the_timeout(
    ctx: zmq.asyncio.Context, ipc_dir: Path
) -> None:
    hub = await start_hub(ctx, ipc_dir, 3)
    timeout = 0.3
    c0, c1, c2 = clients(ctx, hub, range(3), timeout_s=timeout)
    try:
        # One round with everyone, so the hang is in the second collective.
        assert await asyncio.gather(
            c0.all_reduce(1, 1), c1.all_reduce(1, 0), c2.all_reduce(1, 0)
        ) == [1, 1, 1]
        started = time.monotonic()
        results = await asyncio.gather(
            c0.all_reduce(2, 1, wave=5, step=2),
            c2.all_reduce(2, 0, wave=5, step=2),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - started
        for rank, result in zip((0, 2), results, strict=True):
            assert isinstance(result, CollectiveHang), result
            assert result.rank == rank
            assert result.seq == 2
            assert (result.wave, result.step) == (5, 2)
            assert result.missing == (1,)
            assert result.arrived == (0, 2)
            assert result.waited_s >= timeout
            assert "missing ranks [1]" in str(result)
        # The timeout, plus one query round trip, not the query's own timeout.
        assert timeout <= elapsed < timeout + 0.4
        assert hub.pending() == {2: [0, 2]}
    finally:
        for client in (c0, c1, c2):
            client.close()
        await hub.close()


async def test_a_late_rank_completes_the_collective_after_a_hang(
    ctx: zmq.asyncio.Context, ipc_dir: Path
) -> None:
    hub = await start_hub(ctx, ipc_dir, 2)
    c0, c1 = clients(ctx, hub, range(2), timeout_s=0.2)
    try:
        with pytest.raises(CollectiveHang) as caught:
            await c0.all_reduce(1, 1)
        assert caught.value.missing == (1,)
        waiter = asyncio.ensure_future(c0.wait_result(1, timeout_s=5.0))
        assert await c1.all_reduce(1, 1) == 2
        assert await waiter == 2
    finally:
        c0.close()
        c1.close()
        await hub.close()


async def test_without_a_hub_the_hang_says_the_missing_ranks_are_unknown(
    ctx: zmq.asyncio.Context, ipc_dir: Path
) -> None:
    client = CollectiveClient(
        f"ipc://{ipc_dir}/nobody", 0, timeout_s=0.1, query_timeout_s=0.1, context=ctx
    )
    try:
        with pytest.raises(CollectiveHang) as caught:
            await client.all_reduce(1, 1)
        assert caught.value.arrived is None
        assert caught.value.missing == ()
        assert "did not answer" in str(caught.value)
    finally:
        client.close()


async def test_the_hub_drops_junk_and_foreign_ranks_and_keeps_serving(
    ctx: zmq.asyncio.Context, ipc_dir: Path
) -> None:
    hub = await start_hub(ctx, ipc_dir, 2)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(hub.address)
    c0, c1 = clients(ctx, hub, range(2))
    try:
        await raw.send(b"\xc1 not msgpack")
        await raw.send_multipart([b"two", b"frames"])
        # A well-formed contribution from a rank outside the group.
        await raw.send(msgspec.msgpack.encode(["contribute", 1, 9, 100, 0, 1]))
        assert await asyncio.gather(c0.all_reduce(1, 1), c1.all_reduce(1, 1)) == [2, 2]
        assert hub.dropped == 3
    finally:
        raw.close(linger=0)
        c0.close()
        c1.close()
        await hub.close()
