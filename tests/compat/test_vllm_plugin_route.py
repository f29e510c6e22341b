"""The plugin route against vLLM 0.33's own, unmodified ``vllm/v1/engine/core_client.py``.

The module comes from the pinned wheel (``tools.vllm_wheel``) with its heavy
imports stubbed; its ``DPLBAsyncMPClient`` is the load-balancing client of
vLLM's API servers. One is built without its constructor (which would start
engines) and given what ``add_request_async`` touches: its input ROUTER, with
one DEALER per engine rank, vLLM's own msgpack encoder, its load table. Then
``coordinator.vllm_plugin.patch_client`` wraps it as the plugin does, and each
request goes through vLLM's own ``add_request_async`` and
``get_core_engine_for_request``: the test sees which engine's DEALER the ADD
reaches.

* A real coordinator process (``--policy prefix``), fed a cached prefix on one
  rank by a publisher, answers the route call: vLLM sends to that rank.
* A coordinator too slow for the deadline, and one that is not there, leave
  the choice to vLLM's own code, and the fallback is counted.

The routed case uses a wide deadline, so that a loaded test machine cannot
turn it into a fallback; the fallback cases use the real default of 2 ms.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import textwrap
import time
import types
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from coordinator import vllm_plugin
from coordinator.launch import launch
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.kv_events import BlockStored
from tests.integration.kv_publishers import bind_publishers
from tools.vllm_wheel import COORDINATOR_REAL, WheelUnavailable, vllm_modules

pytestmark = pytest.mark.timeout(90)

STEP = 5.0
RANKS = 4
BLOCK = 16


@pytest.fixture(scope="module")
def vllm_client() -> types.ModuleType:
    """vLLM's own core_client module (and its real EngineCoreRequest and encoder)."""
    try:
        with vllm_modules("vllm.v1.engine.core_client",
                          real=(*COORDINATOR_REAL, "vllm.v1.pool.late_interaction")) as mods:
            return mods["vllm.v1.engine.core_client"]
    except WheelUnavailable as exc:
        pytest.skip(f"vLLM 0.33.0 wheel unavailable: {exc}")


class Engines:
    """vLLM's client with its engine DEALERs, built around vLLM's own class."""

    def __init__(self, module: types.ModuleType, ctx: zmq.asyncio.Context, address: str) -> None:
        self.module = module
        cls = module.DPLBAsyncMPClient
        client = object.__new__(cls)
        client.client_index = 0
        client.client_count = 1
        client.current_wave = 0
        client.reqs_in_flight = {}
        client.streaming_reqs = set()
        client.engine_inflight = Counter()
        client.core_engines = [rank.to_bytes(2, "little") for rank in range(RANKS)]
        client.lb_engines = [[0, 0, 0.0] for _ in range(RANKS)]
        client.eng_start_index = 0
        client.engine_ranks_managed = list(range(RANKS))
        client.encoder = module.MsgpackEncoder()
        client.resources = types.SimpleNamespace(
            stats_update_task=object(), output_queue_task=object(), engine_dead=False)
        client.input_socket = ctx.socket(zmq.ROUTER)
        client.input_socket.setsockopt(zmq.LINGER, 0)
        client.input_socket.bind(address)
        self.client = client
        self.dealers: list[zmq.asyncio.Socket] = []
        for rank in range(RANKS):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
            dealer.connect(address)
            self.dealers.append(dealer)

    async def greet(self) -> None:
        """Each engine's first message, so that vLLM's ROUTER can address it."""
        for dealer in self.dealers:
            await dealer.send(b"ready")
        seen = set()
        while len(seen) < RANKS:
            assert await self.client.input_socket.poll(int(STEP * 1000))
            identity, _ = await self.client.input_socket.recv_multipart()
            seen.add(identity)

    def request(self, request_id: str, tokens: list[int]) -> Any:
        return self.module.EngineCoreRequest(
            request_id=request_id, prompt_token_ids=tokens, mm_features=None,
            sampling_params=None, pooling_params=None, arrival_time=time.time(),
            lora_request=None, cache_salt=None, data_parallel_rank=None)

    async def send(self, request: Any) -> int:
        """vLLM's add_request_async; returns the rank whose engine got the ADD."""
        await self.client.add_request_async(request)
        for rank, dealer in enumerate(self.dealers):
            if await dealer.poll(10):
                frames = await dealer.recv_multipart()
                assert frames[0] == b"\x00"  # ADD
                return rank
        raise AssertionError("no engine got the ADD")

    def close(self) -> None:
        for dealer in self.dealers:
            dealer.close(0)
        self.client.input_socket.close(0)


@pytest.fixture
async def engines(vllm_client: types.ModuleType, tmp_path: Path) -> AsyncIterator[Engines]:
    ctx = zmq.asyncio.Context()
    made = Engines(vllm_client, ctx, f"ipc://{tmp_path}/inputs")
    try:
        await made.greet()
        yield made
    finally:
        made.close()
        ctx.term()


def wrap(module: types.ModuleType, client: vllm_plugin.RouteClient) -> None:
    cls = module.DPLBAsyncMPClient
    if hasattr(cls.add_request_async, "__wrapped__"):
        cls.add_request_async = cls.add_request_async.__wrapped__
    assert vllm_plugin.patch_client(module, lambda: client)
    assert not vllm_plugin.patch_client(module, lambda: client)  # once only


async def test_the_route_call_sets_the_rank_vllm_sends_to(engines: Engines,
                                                          tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    publishers, live, _ = bind_publishers(ctx, RANKS)
    handle = launch(engines=RANKS, addr_file=str(tmp_path / "addresses.json"), timeout=20.0,
                    extra_args=["--policy", "prefix", "--kv-events-endpoint", f"tcp://*:{live}",
                                "--kv-block-size", str(BLOCK)])
    client = vllm_plugin.RouteClient(handle.addresses["frontend"], deadline_s=STEP)
    try:
        for publisher in publishers:
            await publisher.wait_subscribed()
        prompt = list(range(7000, 7000 + 4 * BLOCK))
        publishers[2].publish(BlockStored([1, 2, 3, 4], None, prompt, BLOCK, None, "GPU", None))
        wrap(engines.module, client)
        # The index applies the batch soon after it arrives; until then, load decides.
        deadline = time.monotonic() + STEP
        while True:
            request = engines.request(f"r{time.monotonic_ns()}", [*prompt, 1])
            rank = await engines.send(request)
            if rank == 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert rank == 2 and request.data_parallel_rank == 2
        stats = ctx.socket(zmq.PUSH)  # the engines' stats, as they send them in this route
        stats.setsockopt(zmq.LINGER, 0)
        stats.connect(handle.addresses["back_output"])
        for turn in range(3):
            for rank in range(RANKS):  # idle again: each request finished at once
                await stats.send(vllm.encode_engine_outputs(vllm.EngineCoreOutputs(
                    engine_index=rank, scheduler_stats=vllm.SchedulerStats(
                        num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                        step_counter=turn + 1, current_wave=0))))
            await wait_reports(handle.addresses["frontend"], ctx, RANKS * (turn + 1))
            request = engines.request(f"turn-{turn}", [*prompt, 2 + turn])
            assert await engines.send(request) == 2
        stats.close(0)
        # vLLM's own load table was not touched: the coordinator chose.
        assert engines.client.lb_engines == [[0, 0, 0.0]] * RANKS
        assert client.outcomes["routed"] >= 4 and client.outcomes["timeout"] == 0
        # Requests that name their rank are left to vLLM, and not asked about.
        asked = sum(client.outcomes.values())
        pinned = engines.request("pinned", prompt)
        pinned.data_parallel_rank = 3
        assert await engines.send(pinned) == 3
        assert sum(client.outcomes.values()) == asked
    finally:
        client.close()
        for publisher in publishers:
            publisher.close()
        ctx.term()
        assert handle.shutdown(timeout=5.0) == 0


async def wait_reports(address: str, ctx: zmq.asyncio.Context, at_least: int) -> None:
    """Until the coordinator counted ``at_least`` stats reports (bounded)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        deadline = time.monotonic() + STEP
        while True:
            await sock.send(fp.encode(fp.QueryState(1)))
            assert await sock.poll(int(STEP * 1000))
            reply = fp.decode_reply(await sock.recv())
            assert isinstance(reply, fp.StateReply)
            reports = reply.state.counters.get("stats.reports", 0)
            if reports >= at_least:
                return
            assert time.monotonic() < deadline, f"{reports} stats reports, not {at_least}"
            await asyncio.sleep(0.02)
    finally:
        sock.close(0)


class SlowCoordinator:
    """A frontend socket that answers every route call, but only after ``delay_s``."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, delay_s: float) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.delay_s = delay_s
        self.calls = 0
        self.task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, header = await self.sock.recv_multipart()
            message, _ = fp.decode_request([header])
            assert isinstance(message, fp.Route)
            self.calls += 1
            await asyncio.sleep(self.delay_s)
            await self.sock.send_multipart(
                [identity, fp.encode(fp.Routed(message.call_id, message.request_id, 3, "x"))])

    def close(self) -> None:
        self.task.cancel()
        self.sock.close(0)


async def test_a_slow_coordinator_leaves_the_choice_to_vllm_and_is_counted(
    engines: Engines, tmp_path: Path,
) -> None:
    ctx = zmq.asyncio.Context()
    # The answers come far past the deadline, and the deadline is long enough for the
    # first call to connect on a loaded machine: each call is a timeout, never a race.
    slow = SlowCoordinator(ctx, f"ipc://{tmp_path}/slow", delay_s=2.0)
    client = vllm_plugin.RouteClient(f"ipc://{tmp_path}/slow", deadline_s=0.5)
    try:
        wrap(engines.module, client)
        ranks = [await engines.send(engines.request(f"s{i}", [1, 2, 3])) for i in range(3)]
        # vLLM's own rule: its load table, each pick bumping the chosen engine.
        assert ranks == [0, 1, 2]
        assert [row[0] for row in engines.client.lb_engines] == [1, 1, 1, 0]
        assert client.outcomes["timeout"] == 3 and client.outcomes["routed"] == 0
        # The late answers arrive and are dropped.
        give_up = time.monotonic() + 30.0
        while (slow.calls < 3 or client._pending) and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        assert slow.calls == 3 and not client._pending
    finally:
        client.close()
        slow.close()
        ctx.term()


async def test_no_coordinator_leaves_the_choice_to_vllm(engines: Engines,
                                                        tmp_path: Path) -> None:
    client = vllm_plugin.RouteClient(f"ipc://{tmp_path}/nobody-here")
    unset = vllm_plugin.RouteClient(None)
    try:
        wrap(engines.module, client)
        assert [await engines.send(engines.request(f"d{i}", [1, 2])) for i in range(3)] == [
            0, 1, 2]
        assert client.outcomes == {"unavailable": 3}
        # The first call waited for a connection within its deadline; the next ones
        # did not wait at all, as the coordinator had just been found unreachable.
        assert client._down_until > time.monotonic()
        wrap(engines.module, unset)
        assert await engines.send(engines.request("d3", [1, 2])) == 3
        assert unset.outcomes == {"unavailable": 1}
    finally:
        client.close()
        unset.close()


# ---- installing the route ---------------------------------------------------------------------


def test_prompt_keys_carry_what_the_engine_hashes() -> None:
    position = types.SimpleNamespace(offset=3, length=5)
    request = types.SimpleNamespace(
        prompt_token_ids=[1, 2, 3], prompt_embeds=None, cache_salt="s", session_id="chat",
        lora_request=types.SimpleNamespace(lora_name="adapter"),
        mm_features=[types.SimpleNamespace(identifier="img", mm_position=position)])
    assert vllm_plugin.prompt_keys(request) == fp.PromptKeys(
        [1, 2, 3], "adapter", "s", [fp.MultiModalItem("img", 3, 5)], "chat")
    request.prompt_embeds = object()
    assert vllm_plugin.prompt_keys(request) is None


STANDIN_CLIENT = """
    class DPAsyncMPClient:
        async def add_request_async(self, request):
            self.sent.append(request.data_parallel_rank)

    class DPLBAsyncMPClient(DPAsyncMPClient):
        pass
    """


@pytest.fixture
def standin_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "site"
    files = {"vllm/__init__.py": "__version__ = '0.33.0'\n", "vllm/v1/__init__.py": "",
             "vllm/v1/engine/__init__.py": "",
             "vllm/v1/engine/coordinator.py": "class DPCoordinator:\n    pass\n",
             "vllm/v1/engine/core_client.py": textwrap.dedent(STANDIN_CLIENT)}
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    monkeypatch.setenv("DP_COORDINATOR_REPLACE", "1")
    monkeypatch.setenv("DP_COORDINATOR_ROUTE", "1")
    yield root
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path
                        if type(f).__name__ != "_PatchAfterImport"]


def test_register_wraps_the_client_once_it_is_imported(standin_vllm: Path) -> None:
    vllm_plugin.register()
    assert "vllm.v1.engine.core_client" not in sys.modules
    module = importlib.import_module("vllm.v1.engine.core_client")
    assert module.DPLBAsyncMPClient.add_request_async.__dp_coordinator_route__
    assert not hasattr(module.DPAsyncMPClient.add_request_async, "__dp_coordinator_route__")
    vllm_plugin.register()  # registering again wraps nothing twice
    assert not hasattr(module.DPLBAsyncMPClient.add_request_async.__wrapped__,
                       "__wrapped__")


def test_register_wraps_a_client_already_imported(standin_vllm: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("vllm.v1.engine.core_client")
    vllm_plugin.register()
    assert module.DPLBAsyncMPClient.add_request_async.__dp_coordinator_route__


def test_without_the_route_flag_the_client_is_left_alone(standin_vllm: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DP_COORDINATOR_ROUTE")
    vllm_plugin.register()
    module = importlib.import_module("vllm.v1.engine.core_client")
    assert not hasattr(module.DPLBAsyncMPClient.add_request_async, "__dp_coordinator_route__")


@pytest.mark.parametrize(("value", "seconds"), [
    ("", 0.002), ("5", 0.005), ("0.5", 0.0005), ("0", 0.002), ("x", 0.002), ("99999", 0.002),
])
def test_the_deadline_setting(value: str, seconds: float,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP_COORDINATOR_ROUTE_DEADLINE_MS", value)
    assert vllm_plugin._route_deadline_s() == pytest.approx(seconds)
