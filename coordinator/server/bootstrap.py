"""The KV bootstrap registry's HTTP endpoint (``--kv-bootstrap-port``): IO only.

Serves vLLM 0.33's Mooncake bootstrap API with the shapes of its own
``MooncakeBootstrapServer``: ``POST /register`` takes a
``RegisterWorkerPayload`` and answers ``{"status": "ok"}``, ``GET /query``
answers ``{dp_rank: {"engine_id": ..., "worker_addr": {tp_rank: {pp_rank:
addr}}}}``; plus ``GET /health``. Failures are 4xx with a ``detail``: 422 for
a body that is not a valid registration, 400 for a conflict (as vLLM's), 404
and 405 for other paths and methods, 413 and 431 for oversize requests.

Who holds each entry is the core's decision (``coordinator.core.bootstrap``).
When it asks for a probe, this module tries a TCP connection to each of the
old holder's side channels (bounded by ``--kv-bootstrap-probe-timeout-s``),
tells the core the outcome, and asks again. It runs on the coordinator's
event loop, so the core is never touched from another thread; a registration
waiting for its probe holds nothing else up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence

from coordinator.core.actions import Action
from coordinator.core.bootstrap.handlers import BootstrapHandlers
from coordinator.core.bootstrap.payload import PayloadError, decode_payload, split_tcp_address
from coordinator.core.bootstrap.registry import Conflict, ProbeNeeded, Registered
from coordinator.core.coordinator import CoordinatorCore
from coordinator.server.bootstrap_http import HttpServer, Request, Response
from coordinator.server.config import ServerConfig

log = logging.getLogger("coordinator.bootstrap")

DEFAULT_PROBE_TIMEOUT_S = 2.0
OK = Response(200, {"status": "ok"})


async def side_channel_answers(addresses: Sequence[str], timeout_s: float) -> bool:
    """Whether any of ``addresses`` (``tcp://host:port``) accepts a TCP connection in time."""

    async def one(addr: str) -> bool:
        target = split_tcp_address(addr)
        if target is None:
            return False
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout_s)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    if not addresses:
        return False
    return any(await asyncio.gather(*(one(addr) for addr in addresses)))


class BootstrapServer:
    """The registry's listening socket and routes; see the module docstring."""

    def __init__(self, core: CoordinatorCore, host: str, port: int, *,
                 probe_timeout_s: float, clock: Callable[[], float],
                 execute: Callable[[Sequence[Action]], None]) -> None:
        if core.bootstrap is None:
            raise ValueError("this core serves no KV bootstrap registry (no kv_bootstrap)")
        self._core = core
        self._handlers: BootstrapHandlers = core.bootstrap
        self.host = host
        self.port = port
        self.probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._execute = execute
        self._sock: socket.socket | None = None
        self._probes: dict[tuple[int, int, tuple[str, ...]], asyncio.Task[bool]] = {}

    def bind(self) -> str:
        """Bind the listening socket now (errors belong to start-up); return its URL."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self._sock = socket.create_server((self.host.strip("[]"), self.port),
                                              family=family)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve the KV bootstrap registry on "
                          f"{self.host}:{self.port}: {exc.strerror or exc}") from exc
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])
        return self.url

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def run(self) -> None:
        """Serve until cancelled; re-validate the entries a state file brought back."""
        if self._sock is None:
            raise RuntimeError("BootstrapServer.run() before bind()")
        server = HttpServer(self._sock, self.handle, self._handlers.refused)
        await server.start()
        log.info("KV bootstrap registry on %s (vLLM kv_connector_extra_config "
                 "bootstrap_server_address=\"%s:%d\")", self.url, self.host, self.port)
        checks = [asyncio.ensure_future(self._probe_and_tell(probe))
                  for probe in self._handlers.unverified()]
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()
            for task in [*checks, *self._probes.values()]:
                task.cancel()

    # ---- routes ------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        routes = {"/register": "POST", "/query": "GET", "/health": "GET"}
        method = routes.get(request.path)
        if method is None:
            self._handlers.refused("not_found")
            return Response(404, {"detail": "Not Found"})
        if request.method != method:
            self._handlers.refused("method_not_allowed")
            return Response(405, {"detail": "Method Not Allowed"})
        if request.path == "/register":
            return await self._register(request.body)
        if request.path == "/query":
            return Response(200, self._query())
        return OK

    def _query(self) -> dict[str, object]:
        return {str(dp): {"engine_id": engine_id,
                          "worker_addr": {str(tp): {str(pp): addr for pp, addr in by_pp.items()}
                                          for tp, by_pp in sorted(workers.items())}}
                for dp, (engine_id, workers) in self._handlers.query().items()}

    async def _register(self, body: bytes) -> Response:
        try:
            payload = decode_payload(body, self._handlers.registry.bounds)
        except PayloadError as exc:
            self._handlers.refused("bad_payload")
            return Response(422, {"detail": str(exc)})
        core, clock = self._core, self._clock
        decision, actions = core.bootstrap_register(payload, clock())
        self._execute(actions)
        if isinstance(decision, ProbeNeeded):
            await self._probe_and_tell(decision)
            decision, actions = core.bootstrap_register(payload, clock(), probed=True)
            self._execute(actions)
        if isinstance(decision, Conflict):
            return Response(400, {"detail": decision.detail})
        if not isinstance(decision, Registered):
            raise RuntimeError(f"the registry asked for a second probe: {decision!r}")
        return OK

    # ---- probes ------------------------------------------------------------------------

    async def _probe_and_tell(self, probe: ProbeNeeded) -> None:
        # Registrations that wait for the same probe share it.
        key = (probe.dp_rank, probe.generation, probe.addresses)
        task = self._probes.get(key)
        if task is None:
            task = asyncio.ensure_future(side_channel_answers(probe.addresses,
                                                              self.probe_timeout_s))
            self._probes[key] = task
            task.add_done_callback(lambda _: self._probes.pop(key, None))
            alive = await task
            self._execute(self._core.bootstrap_probe_answered(probe, alive, self._clock()))
        else:
            await task


def bootstrap_server(config: ServerConfig, core: CoordinatorCore, clock: Callable[[], float],
                     execute: Callable[[Sequence[Action]], None]) -> BootstrapServer | None:
    """The registry's server when ``--kv-bootstrap-port`` is given (not bound yet)."""
    if config.kv_bootstrap_port is None:
        return None
    return BootstrapServer(core, config.bootstrap_host(), config.kv_bootstrap_port,
                           probe_timeout_s=config.kv_bootstrap_probe_timeout_s, clock=clock,
                           execute=execute)
