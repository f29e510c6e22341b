"""Each supported vLLM release's own code against the coordinator process.

Parametrised by `vllm_version` (`--vllm-versions` / DP_VLLM_VERSIONS; by
default 0.29.0 and 0.33.0, `make compat-matrix` runs all five). Every module
named here runs unmodified from that release's pinned wheel
(tools/vllm_wheel.py); only heavy imports are stubbed.

* Engine start-up: the release's `EngineCoreReadyResponse` greeting and its
  `EngineCoreOutputs`/`SchedulerStats` reports, encoded by its own
  `MsgpackEncoder`, bring a group up; its `vllm_version` shows in `state`.
* API-server client: the release's `DPLBAsyncMPClient`, stats task running
  against front_publish, reads the 3-wide rows and routes requests.
* The pre-0.33 wake: a lockstep group whose engines behave as that release's
  do (tests/compat/lockstep_group.py), driven by that release's client, never
  hangs on a first request after a pause; with the wake ignored, releases
  before 0.33 do hang (so the test can see a hang).
* KV events: the release's `KVEventBatch` of `BlockStored`/`BlockRemoved`/
  `AllBlocksCleared` decodes with the coordinator's decoder.

Each test prints the figure it was tested with (requests, pauses, the slowest
first request after a pause); docs/vllm.md's support table quotes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from coordinator.protocol import kv_events as kv
from tests.compat.lockstep_group import (
    LockstepGroup,
    build_client,
    close_client,
    engines_wake_themselves,
    new_request,
)
from tests.conftest import CoordinatorFactory
from tests.vllm_peers import RawEngine, RawFrontend, wait_until
from tools import vllm_wheel

pytestmark = pytest.mark.timeout(180)

SIZE = 2
PAUSES = 4
"""First requests after a pause, per release (the group pauses after each)."""
STEP = 20.0
"""Bound on any one wait (a loaded machine never gets near it)."""
HANG_WINDOW_S = 3.0
"""With the wake ignored, a pre-0.33 group must still be blocked this long after."""

CLIENT_REAL = (*vllm_wheel.COORDINATOR_REAL, "vllm.v1.pool.late_interaction")
CLIENT_MODULES = ("vllm.v1.engine.core_client", "vllm.v1.engine", "vllm.v1.metrics.stats",
                  "vllm.v1.serial_utils")


@pytest.fixture(scope="module")
def release(vllm_version: str) -> dict[str, types.ModuleType]:
    """The release's client, engine structs, stats and encoder (downloaded on first use)."""
    try:
        return vllm_wheel.load(*CLIENT_MODULES, real=CLIENT_REAL, version=vllm_version)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_version} wheel unavailable: {exc}")


async def until(predicate: Callable[[], Any], what: str, timeout: float = STEP) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)
    return value


class Stand:
    """A coordinator process, a lockstep group of the release and its client."""

    def __init__(self, version: str, vllm: dict[str, types.ModuleType],
                 coordinator: CoordinatorFactory, tmp_path: Path, extra: list[str]) -> None:
        self.version = version
        self.vllm = vllm
        self.handle = coordinator(SIZE, extra_args=["--heartbeat-s", "0.5", *extra])
        self.ctx = zmq.asyncio.Context()
        inputs = f"ipc://{tmp_path}/client-inputs"
        self.client = build_client(version, vllm, self.ctx, inputs,
                                   self.handle.addresses["front_publish"], SIZE)
        self.group = LockstepGroup(version, vllm, SIZE, self.ctx)
        self.inputs = inputs

    async def start(self) -> None:
        await self.group.connect(self.inputs, self.handle.addresses, STEP)
        first_rows = self.client.lb_engines
        self.client._ensure_stats_update_task()
        # The client has heard the coordinator once its rows are replaced by a publish.
        await until(lambda: self.client.lb_engines is not first_rows, "the client's first rows")

    async def paused(self) -> int:
        """Wait until the group is paused and the client knows it; return the wave."""
        def both() -> int | None:
            wave = self.group.paused_at()
            if (wave is not None and not self.client.engines_running
                    and self.client.current_wave == wave):
                return wave + 1  # truthy for wave 0
            return None

        return int(await until(both, "a pause the client has heard of")) - 1

    async def close(self) -> None:
        close_client(self.client)
        await self.group.close()
        await asyncio.sleep(0)
        self.ctx.destroy(linger=0)


@pytest.fixture
async def stand_factory(release: dict[str, types.ModuleType], vllm_version: str,
                        coordinator: CoordinatorFactory, tmp_path: Path
                        ) -> AsyncIterator[Callable[..., Any]]:
    made: list[Stand] = []

    async def make(*extra: str) -> Stand:
        stand = Stand(vllm_version, release, coordinator, tmp_path, list(extra))
        made.append(stand)
        await stand.start()
        return stand

    yield make
    for stand in made:
        await stand.close()


async def test_a_lockstep_group_never_hangs_on_a_first_request_after_a_pause(
        stand_factory: Callable[..., Any], vllm_version: str) -> None:
    stand: Stand = await stand_factory()
    after_pause: list[float] = []
    waves = []
    for turn in range(PAUSES):
        waves.append(await stand.paused())
        request_id = f"first-after-pause-{turn}"
        started = time.monotonic()
        await stand.client.add_request_async(new_request(stand.vllm, request_id))
        await until(lambda: request_id in stand.group.finished,  # noqa: B023
                    f"request {turn} to finish (a hang if never)")
        after_pause.append(stand.group.finished[request_id] - started)
    waves.append(await stand.paused())
    assert waves == list(range(PAUSES + 1))  # one wave per request, each completed
    sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        counters = RawFrontend(sync_ctx, stand.handle.addresses).counters()
    finally:
        sync_ctx.destroy(linger=0)
    wakes = counters.get("legacy.first_requests", 0)
    if engines_wake_themselves(vllm_version):
        assert wakes == 0  # 0.33's client sends none; its engines start the wave
    else:
        assert wakes == PAUSES  # every first request came with the client's wake
    print(f"vLLM {vllm_version}: {PAUSES} first requests after a pause, {SIZE} lockstep "
          f"ranks; slowest {max(after_pause) * 1000:.0f} ms, frontend wakes {wakes}")


async def test_with_the_wake_ignored_only_033_groups_wake(
        stand_factory: Callable[..., Any], vllm_version: str) -> None:
    """The control: what the group does without the coordinator's side of the wake."""
    stand: Stand = await stand_factory("--frontend-wake", "ignore")
    await stand.paused()
    await stand.client.add_request_async(new_request(stand.vllm, "alone"))
    if engines_wake_themselves(vllm_version):
        await until(lambda: "alone" in stand.group.finished, "the 0.33 group's own wake")
        return
    await asyncio.sleep(HANG_WINDOW_S)
    assert "alone" not in stand.group.finished, "a pre-0.33 group woke without the wake"
    assert stand.group.blocked_steps > 0  # a rank held the request, waiting for the others
    print(f"vLLM {vllm_version}: with --frontend-wake ignore the request was still blocked "
          f"after {HANG_WINDOW_S:.0f} s ({stand.group.blocked_steps} blocked polls)")


async def test_the_release_client_reads_rows_and_routes_by_them(
        stand_factory: Callable[..., Any], vllm_version: str) -> None:
    """The client's stats task unpacks every row as 3 values and picks the least loaded."""
    stand: Stand = await stand_factory()
    await stand.paused()
    # Rank 1 reports a queue of its own (as a busy engine would); the client sees it.
    rank1 = stand.group.engines[1]
    stats = stand.group.stats_cls(num_running_reqs=0, num_waiting_reqs=5, kv_cache_usage=0.25,
                                  step_counter=1, current_wave=rank1.wave)
    await stand.group._report(rank1, scheduler_stats=stats)
    rows = await until(lambda: (r := stand.client.lb_engines)[1][0] == 5 and r,
                       "rank 1's queue in the client's rows")
    assert [len(row) for row in rows] == [3] * SIZE and rows[1][2] == 0.25
    chosen = stand.client.get_core_engine_for_request(new_request(stand.vllm, "pick"))
    assert chosen == (0).to_bytes(2, "little")
    print(f"vLLM {vllm_version}: client rows {rows}, routed to rank 0")


def test_the_release_greeting_and_version_show_in_state(
        release: dict[str, types.ModuleType], vllm_version: str,
        coordinator: CoordinatorFactory) -> None:
    """Engine start-up: vLLM's handshake, then the release's own `EngineCoreReadyResponse`
    (encoded by its `MsgpackEncoder`) as each rank's greeting; the version reaches `state`."""
    ready = release["vllm.v1.engine"].EngineCoreReadyResponse
    encoder = release["vllm.v1.serial_utils"].MsgpackEncoder()
    handle = coordinator(SIZE)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        engines = [RawEngine(ctx, handle.addresses, rank, dp_size=SIZE) for rank in range(SIZE)]
        fields: dict[str, Any] = {}
        for engine in engines:
            engine.hello()
            engine.connect_plane()
            engine.subscribe()
            fields = {f.name: None for f in dataclasses.fields(ready)}
            fields.update(vllm_version=vllm_version, data_parallel_rank=engine.rank,
                          data_parallel_size=SIZE, max_model_len=4096, block_size=16)
            engine.greet(bytes(encoder.encode(ready(**fields))[0]))
        for engine in engines:
            assert engine.expect_publish(STEP) == [b"READY"]
            assert engine.ready("cfg-hash-1", timeout=STEP) is None
        front = RawFrontend(ctx, handle.addresses)
        rows = wait_until(
            lambda: (r := front.state()["engines"]) and all(e[9] == vllm_version for e in r)
            and r, timeout=STEP, what="every rank's version in the state")
        assert [row[1] for row in rows] == ["ready"] * SIZE
        print(f"vLLM {vllm_version}: {SIZE} ranks through the handshake, greetings of "
              f"{len(fields)} keys accepted, state rows {[[*row[:2], row[9]] for row in rows]}")
    finally:
        ctx.destroy(linger=0)


def test_the_release_kv_events_decode(vllm_version: str) -> None:
    from tests.compat.vllm_stand_ins import KV_STAND_INS

    try:
        mods = vllm_wheel.load("vllm.distributed.kv_events", stand_ins=KV_STAND_INS,
                               version=vllm_version)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_version} wheel unavailable: {exc}")
    events = mods["vllm.distributed.kv_events"]
    stored = kv_fields(events.BlockStored, block_hashes=[11, 12], parent_block_hash=None,
                       token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU")
    removed = kv_fields(events.BlockRemoved, block_hashes=[12], medium="GPU")
    batch = events.KVEventBatch(ts=1.5, events=[stored, removed, events.AllBlocksCleared()],
                                data_parallel_rank=0)
    import msgspec

    decoded = kv.decode_kv_batch(msgspec.msgpack.encode(batch))
    assert decoded.unknown_events == 0
    kinds = [type(event).__name__ for event in decoded.batch.events]
    assert kinds == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert decoded.batch.events[0].block_hashes == [11, 12]
    assert decoded.batch.events[0].token_ids == list(range(32))
    print(f"vLLM {vllm_version}: KVEventBatch of 3 events decoded ({', '.join(kinds)})")


def kv_fields(cls: Any, **given: Any) -> Any:
    """`cls(**given)` with only the fields this release's struct has (others defaulted)."""
    import msgspec

    values = {}
    for field in msgspec.structs.fields(cls):
        if field.name in given:
            values[field.name] = given[field.name]
        elif field.required:
            values[field.name] = None  # a field this test does not know of: absent
    return cls(**values)
