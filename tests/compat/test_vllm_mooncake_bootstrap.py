"""vLLM 0.33's own Mooncake bootstrap code against the coordinator's registry.

From the pinned wheel (``tools/vllm_wheel.py``) run unmodified:
``mooncake_utils`` (``RegisterWorkerPayload`` and the reference
``MooncakeBootstrapServer``) and ``mooncake_connector``'s
``register_worker_with_bootstrap`` (a prefill worker's registration, as it
posts it) and ``_connect_to_prefiller_bootstrap`` (a decoder's ``/query`` and
how it reads the reply). Their web dependencies (pydantic, fastapi, uvicorn,
httpx) are installed for these tests only, into the git-ignored
``.cache/mooncake-web``; without a package index the tests skip and say so.

The coordinator is the real process (``serve --kv-bootstrap-port``); side
channels are real ROUTER sockets on loopback TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib
import json
import logging
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from coordinator.launch import CoordinatorHandle, launch
from tools import vllm_wheel

MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake"
WEB_PACKAGES = ("pydantic", "fastapi", "uvicorn", "httpx")
# What vLLM 0.33.0's metadata asks for (fastapi[standard]<0.137.0,>=0.133.0, pydantic>=2.12.0).
WEB_REQUIREMENTS = ("pydantic>=2.12.0", "fastapi>=0.133.0,<0.137.0", "starlette>=1.0.1",
                    "uvicorn", "httpx")
WEB_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "mooncake-web"

Ctx = zmq.Context[zmq.Socket[bytes]]


def web_packages() -> None:
    """Make vLLM's web dependencies importable, installing them into WEB_CACHE once."""
    if str(WEB_CACHE) not in sys.path:
        sys.path.append(str(WEB_CACHE))  # appended: never shadows what the venv has
    try:
        for name in WEB_PACKAGES:
            importlib.import_module(name)
        return
    except ImportError:
        pass
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(WEB_CACHE),
         *WEB_REQUIREMENTS], capture_output=True, text=True, timeout=600, check=False)
    if result.returncode != 0:
        pytest.skip("cannot install vLLM's web dependencies (pydantic, fastapi, uvicorn, "
                    f"httpx) into {WEB_CACHE}: is the package index reachable? "
                    f"{result.stderr.strip()[-300:]}")
    importlib.invalidate_caches()
    for name in WEB_PACKAGES:
        importlib.import_module(name)


def forget_web_packages(before: set[str]) -> None:
    """Drop what ``web_packages`` imported: other tests expect pydantic and fastapi stubbed
    by ``tools.vllm_wheel`` (it stubs them only when they are not already imported)."""
    for name in set(sys.modules) - before:
        module = sys.modules.get(name)
        if str(getattr(module, "__file__", "") or "").startswith(str(WEB_CACHE)):
            del sys.modules[name]
    with contextlib.suppress(ValueError):
        sys.path.remove(str(WEB_CACHE))


@pytest.fixture(scope="module")
def mooncake() -> Iterator[types.SimpleNamespace]:
    before = set(sys.modules)
    try:
        yield from _mooncake()
    finally:
        forget_web_packages(before)


def _mooncake() -> Iterator[types.SimpleNamespace]:
    web_packages()
    import httpx
    # Held for the module: the connector imports vLLM's network helpers inside a function.
    modules_cm = vllm_wheel.vllm_modules(
        f"{MOONCAKE}.mooncake_utils", f"{MOONCAKE}.mooncake_connector",
        real=("vllm.utils.network_utils",),
        # The web packages run for real, submodules imported later included.
        heavy=vllm_wheel.HEAVY_PACKAGES - {"pydantic", "pydantic_core", "fastapi",
                                           "starlette", "uvicorn"},
        stand_ins={"vllm.logger": {"init_logger": logging.getLogger},
                   "huggingface_hub.utils": {"httpx": httpx},
                   "vllm.distributed.kv_transfer.kv_connector.utils": {"EngineId": str}})
    try:
        modules = modules_cm.__enter__()
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_wheel.VLLM_VERSION} wheel unavailable: {exc}")
    try:
        connector = modules[f"{MOONCAKE}.mooncake_connector"]
        # The one setting the two coroutines read from vllm.envs (its default).
        connector.envs = types.SimpleNamespace(VLLM_MOONCAKE_CONNECTOR_TIMEOUT=30.0)
        yield types.SimpleNamespace(utils=modules[f"{MOONCAKE}.mooncake_utils"],
                                    connector=connector)
    finally:
        modules_cm.__exit__(None, None, None)


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorHandle]:
    handle = launch(engines=2, addr_file=str(tmp_path / "addresses.json"),
                    extra_args=["--kv-bootstrap-port", "0", "--kv-bootstrap-tp-size", "2"],
                    timeout=30.0)
    yield handle
    handle.shutdown()


def host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


class PrefillWorker:
    """What ``register_worker_with_bootstrap`` reads of its worker, with a real side
    channel (a ROUTER socket bound to a random port, as the connector binds it)."""

    def __init__(self, ctx: Ctx, bootstrap: str, engine_id: str, dp: int, tp: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.side_channel_port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.hostname = "127.0.0.1"
        self.engine_id, self.dp_rank, self.tp_rank, self.pp_rank = engine_id, dp, tp, 0
        extra = {"bootstrap_server_address": bootstrap}
        self.vllm_config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
            get_from_extra_config=lambda key, default: extra.get(key, default)))

    @property
    def addr(self) -> str:
        return f"tcp://127.0.0.1:{self.side_channel_port}"


def register_with_vllm(mooncake: types.SimpleNamespace, worker: PrefillWorker) -> None:
    asyncio.run(mooncake.connector.MooncakeConnectorWorker.register_worker_with_bootstrap(
        worker))


def query_with_vllm(mooncake: types.SimpleNamespace, url: str) -> types.SimpleNamespace:
    """A decoder's bootstrap query, read by vLLM's code into its own tables."""
    decoder = types.SimpleNamespace(_remote_agents={}, _tp_size={},
                                    _pending_bootstrap_queries={})

    async def run() -> None:
        decoder._pending_bootstrap_queries[url] = asyncio.Event()
        await mooncake.connector.MooncakeConnectorWorker._connect_to_prefiller_bootstrap(
            decoder, url)

    asyncio.run(run())
    return decoder


def test_vllms_prefill_workers_register_and_its_decoder_reads_the_query(
        mooncake: types.SimpleNamespace, coordinator: CoordinatorHandle, ctx: Ctx) -> None:
    url = coordinator.addresses["kv_bootstrap"]
    host, port = host_port(url)
    workers = [PrefillWorker(ctx, f"{host}:{port}", f"engine-{dp}", dp, tp)
               for dp in range(2) for tp in range(2)]
    try:
        for worker in workers:
            register_with_vllm(mooncake, worker)
        register_with_vllm(mooncake, workers[0])  # an identical retry is ok
        decoder = query_with_vllm(mooncake, url)
        assert decoder._remote_agents == {
            f"engine-{dp}": {tp: {0: workers[2 * dp + tp].addr} for tp in range(2)}
            for dp in range(2)}
        assert decoder._tp_size == {"engine-0": 2, "engine-1": 2}
    finally:
        for worker in workers:
            worker.sock.close()


def test_vllms_restarted_engine_registers_again_where_its_own_server_refuses_it(
        mooncake: types.SimpleNamespace, coordinator: CoordinatorHandle, ctx: Ctx) -> None:
    reference = mooncake.utils.MooncakeBootstrapServer("127.0.0.1", 0)
    reference.start()
    workers: list[PrefillWorker] = []
    try:
        for url in (coordinator.addresses["kv_bootstrap"], f"http://127.0.0.1:{reference.port}"):
            host, port = host_port(url)
            old = [PrefillWorker(ctx, f"{host}:{port}", "engine-old", 0, tp) for tp in range(2)]
            for worker in old:
                register_with_vllm(mooncake, worker)
                worker.sock.close()  # the engine dies: its side channels close
            new = [PrefillWorker(ctx, f"{host}:{port}", "engine-new", 0, tp) for tp in range(2)]
            workers += new
            if url == coordinator.addresses["kv_bootstrap"]:
                for worker in new:
                    register_with_vllm(mooncake, worker)
                decoder = query_with_vllm(mooncake, url)
                assert decoder._remote_agents == {
                    "engine-new": {tp: {0: new[tp].addr} for tp in range(2)}}
            else:
                # vLLM's own registry: the error this project exists to end.
                with pytest.raises(Exception) as info:
                    register_with_vllm(mooncake, new[0])
                assert "400" in str(info.value)
    finally:
        reference.shutdown()
        for worker in workers:
            worker.sock.close()


def http_request(url: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def test_the_same_requests_get_the_reference_servers_status_codes_and_shapes(
        mooncake: types.SimpleNamespace, coordinator: CoordinatorHandle, ctx: Ctx) -> None:
    reference = mooncake.utils.MooncakeBootstrapServer("127.0.0.1", 0)
    reference.start()
    sockets = [ctx.socket(zmq.ROUTER) for _ in range(3)]
    try:
        addrs = [f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
                 for sock in sockets]

        def payload(engine: str, dp: int, tp: int, addr: str) -> bytes:
            # Built and dumped by vLLM's own model, as its connector does.
            model = mooncake.utils.RegisterWorkerPayload(engine_id=engine, dp_rank=dp,
                                                          tp_rank=tp, pp_rank=0, addr=addr)
            return json.dumps(model.model_dump()).encode()

        json_headers = {"content-type": "application/json"}
        steps: list[tuple[str, str, bytes | None]] = [
            ("POST", "/register", payload("engine-a", 0, 0, addrs[0])),
            ("POST", "/register", payload("engine-a", 0, 1, addrs[1])),
            ("POST", "/register", payload("engine-a", 0, 1, addrs[1])),  # identical retry
            ("GET", "/query", None),
            ("POST", "/register", payload("engine-b", 0, 0, addrs[2])),  # holder is live
            ("POST", "/register", payload("engine-a", 0, 1, addrs[2])),  # slot held, live
            ("GET", "/query", None),
            ("POST", "/register", b"{not json"),
            ("POST", "/register", b'{"engine_id": "x", "dp_rank": 0}'),
            ("POST", "/register", b'{"engine_id": "x", "dp_rank": "zero", "tp_rank": 0, '
                                  b'"pp_rank": 0, "addr": "tcp://h:1"}'),
            ("GET", "/register", None),
            ("POST", "/query", None),
            ("GET", "/nowhere", None),
            ("HEAD", "/query", None),
            ("PUT", "/register", payload("engine-a", 0, 0, addrs[0])),
        ]
        for method, path, body in steps:
            ours = http_request(coordinator.addresses["kv_bootstrap"], method, path, body,
                                json_headers)
            theirs = http_request(f"http://127.0.0.1:{reference.port}", method, path, body,
                                  json_headers)
            assert ours[0] == theirs[0], (method, path, body, ours, theirs)
            if method == "HEAD":
                continue  # no body to compare
            if ours[0] == 200 or path == "/nowhere" or method != {"/register": "POST",
                                                                  "/query": "GET"}[path]:
                assert ours[1] == theirs[1], (method, path, ours, theirs)
            else:  # a refusal: both explain themselves in "detail"
                assert isinstance(ours[1]["detail"], str) and ours[1]["detail"]
                assert "detail" in theirs[1]
    finally:
        reference.shutdown()
        for sock in sockets:
            sock.close(linger=0)
