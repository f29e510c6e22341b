"""vLLM general plugin: make vLLM's launcher start dp-coordinator instead of its own,
and (optionally) let vLLM's API servers ask it for each request's rank.

Registered under the entry point group ``vllm.general_plugins`` as
``dp_coordinator``. vLLM calls `register` in every process it starts (the
launcher, API servers, engine cores, workers), usually several times. It does
nothing unless ``DP_COORDINATOR_REPLACE=1`` is set; then, for a targeted vLLM
version, it rebinds the name ``DPCoordinator`` to
`coordinator.vllm_compat.DPCoordinatorProcess`:

* in ``vllm.v1.engine.coordinator``, where the class is defined, so a module
  that imports the name later gets ours;
* in ``vllm.v1.engine.utils`` if that module is already imported: it copied the
  name at import time, and its ``launch_core_engines`` is the only place vLLM
  0.33 constructs a coordinator.

``vllm.v1.engine.core_client`` and ``vllm.v1.utils`` name the class only in
type annotations and are left alone.

The route. With ``DP_COORDINATOR_ROUTE=1`` as well, the plugin also wraps
``DPLBAsyncMPClient.add_request_async`` in ``vllm.v1.engine.core_client`` (at
once if that module is loaded, else right after it loads): the load-balancing
client of vLLM's API servers. ``add_request_async`` is the last point before
vLLM's own choice (``get_core_engine_for_request``, which honours a request's
``data_parallel_rank``) where the client may wait. The wrapper asks the
coordinator's ``frontend`` socket (``DP_COORDINATOR_ROUTE_ADDRESS``, which the
drop-in sets for the processes vLLM starts after it) for the rank of each new
request with a ``route`` call carrying the prompt's tokens and cache keys, and
sets ``data_parallel_rank`` from the answer. No answer within the deadline
(``DP_COORDINATOR_ROUTE_DEADLINE_MS``, default 2), no coordinator, or a refusal
leaves the request to vLLM's own choice; every outcome is counted
(``RouteClient.outcomes``, and ``dp_coordinator_route_client_total{outcome}``
in the API server's own Prometheus metrics). Requests that already name a
rank, continue a streaming session, or carry pooling parameters are left
alone.

Targeted versions: vLLM 0.29.x to 0.33.x releases (``0.M.N``, with an
optional ``.postN`` or ``+local`` suffix). For each of 0.29.0 to 0.33.0 the
compat suite runs that release's own launcher module (``vllm.v1.engine.utils``)
and coordinator module with this plugin, builds the coordinator through the
patched name with that launcher's call shape, and runs engines and an API
server's stats subscription against it (tests/compat/test_dropin_versions.py);
the wire of each release is checked in tests/compat/test_vllm_versions.py.
Anything else (older or newer minor versions, release candidates, ``.dev``
builds of the main branch) is refused with a warning that says why, and vLLM
is left untouched: a launcher this project has not run may use the
coordinator differently.

This module imports nothing from vLLM (and nothing heavy) at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "CLIENT_MODULE",
    "ENABLE_ENV",
    "ENTRY_POINT_NAME",
    "PATCHED_MODULES",
    "ROUTE_ADDRESS_ENV",
    "ROUTE_DEADLINE_ENV",
    "ROUTE_ENV",
    "TARGETED_RELEASES",
    "RouteClient",
    "is_targeted_version",
    "patch_client",
    "prompt_keys",
    "refusal_reason",
    "register",
    "route_enabled",
    "targeted_range",
]

log = logging.getLogger("coordinator.vllm_plugin")

ENABLE_ENV: Final = "DP_COORDINATOR_REPLACE"
ENTRY_POINT_NAME: Final = "dp_coordinator"
"""The plugin's name; list it in VLLM_PLUGINS if that variable restricts plugins."""

TARGETED_RELEASES: Final = frozenset({(0, 29), (0, 30), (0, 31), (0, 32), (0, 33)})
"""(major, minor) of the vLLM releases this plugin patches: those whose own launcher
the drop-in suite passes against (0.29.0 to 0.33.0)."""

DEFINING_MODULE: Final = "vllm.v1.engine.coordinator"
LAUNCHER_MODULE: Final = "vllm.v1.engine.utils"
PATCHED_MODULES: Final = (DEFINING_MODULE, LAUNCHER_MODULE)
CLASS_NAME: Final = "DPCoordinator"

ROUTE_ENV: Final = "DP_COORDINATOR_ROUTE"
ROUTE_ADDRESS_ENV: Final = "DP_COORDINATOR_ROUTE_ADDRESS"
"""The coordinator's ``frontend`` address, for the API servers' route calls."""
ROUTE_DEADLINE_ENV: Final = "DP_COORDINATOR_ROUTE_DEADLINE_MS"
DEFAULT_ROUTE_DEADLINE_S: Final = 0.002
CLIENT_MODULE: Final = "vllm.v1.engine.core_client"
ROUTED_CLASS: Final = "DPLBAsyncMPClient"
ROUTE_OUTCOMES: Final = ("routed", "timeout", "unavailable", "refused", "error")

_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")
_TRUE = frozenset({"1", "true", "yes", "on"})


def is_targeted_version(version: object) -> bool:
    """True for a final vLLM release whose (major, minor) is in `TARGETED_RELEASES`."""
    if not isinstance(version, str):
        return False
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return False
    return (int(match.group(1)), int(match.group(2))) in TARGETED_RELEASES


def targeted_range() -> str:
    """The targeted releases as text, e.g. ``0.29.x to 0.33.x``."""
    ordered = sorted(TARGETED_RELEASES)
    return f"{ordered[0][0]}.{ordered[0][1]}.x to {ordered[-1][0]}.{ordered[-1][1]}.x"


def refusal_reason(version: object) -> str:
    """Why the plugin leaves vLLM `version` alone (for a version it does not target)."""
    head = f"vLLM {version} is not a version dp-coordinator targets ({targeted_range()})"
    if not isinstance(version, str):
        return f"{head}: vLLM reports no version string"
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return (f"{head}: not a final release (release candidates and development builds "
                f"may change the launcher at any commit)")
    release = (int(match.group(1)), int(match.group(2)))
    if release < min(TARGETED_RELEASES):
        return (f"{head}: older than any release whose own launcher the drop-in suite "
                f"was run against")
    return (f"{head}: newer than the last release checked; its launcher may use the "
            f"coordinator differently")


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in _TRUE


def route_enabled() -> bool:
    """True when both DP_COORDINATOR_REPLACE and DP_COORDINATOR_ROUTE are set."""
    return _enabled() and os.environ.get(ROUTE_ENV, "").strip().lower() in _TRUE


def register() -> None:
    """The plugin entry point vLLM calls; a no-op unless DP_COORDINATOR_REPLACE=1."""
    if not _enabled():
        return
    try:
        import vllm
    except ImportError:
        log.warning("%s is set but vLLM is not importable here; nothing to replace",
                    ENABLE_ENV)
        return
    version = getattr(vllm, "__version__", None)
    if not is_targeted_version(version):
        log.warning("%s=1 ignored: %s; vLLM keeps its own DP coordinator", ENABLE_ENV,
                    refusal_reason(version))
        return
    try:
        defining = importlib.import_module(DEFINING_MODULE)
    except Exception as exc:  # a broken vLLM install must not break vLLM further
        log.warning("%s=1 ignored: cannot import %s (%s); vLLM keeps its own DP coordinator",
                    ENABLE_ENV, DEFINING_MODULE, exc)
        return
    original = getattr(defining, CLASS_NAME, None)
    if original is None:
        log.warning("%s=1 ignored: %s has no %s; vLLM keeps its own DP coordinator",
                    ENABLE_ENV, DEFINING_MODULE, CLASS_NAME)
        return

    from coordinator.vllm_compat import DPCoordinatorProcess

    patched = []
    for name in PATCHED_MODULES:
        module = sys.modules.get(name)
        if module is None or getattr(module, CLASS_NAME, None) is DPCoordinatorProcess:
            continue
        if getattr(module, CLASS_NAME, None) is None:
            continue  # partly imported, or a layout we do not know: leave it alone
        setattr(module, CLASS_NAME, DPCoordinatorProcess)
        patched.append(name)
    if patched:
        log.info("vLLM %s will run dp-coordinator as its DP coordinator (patched %s.%s)",
                 version, " and ".join(patched), CLASS_NAME)
    if route_enabled():
        _route_when_loaded()


# ---- the route ---------------------------------------------------------------------------


def _route_deadline_s() -> float:
    text = os.environ.get(ROUTE_DEADLINE_ENV, "").strip()
    if not text:
        return DEFAULT_ROUTE_DEADLINE_S
    try:
        value = float(text) / 1000.0
    except ValueError:
        value = -1.0
    if not 0 < value <= 10.0:
        log.warning("%s=%r is not a number of milliseconds in (0, 10000]; using %g ms",
                    ROUTE_DEADLINE_ENV, text, DEFAULT_ROUTE_DEADLINE_S * 1000)
        return DEFAULT_ROUTE_DEADLINE_S
    return value


def prompt_keys(request: Any) -> Any:
    """The ``PromptKeys`` of a vLLM ``EngineCoreRequest``: its tokens and cache keys.

    None when the coordinator could not match it anyway (no token ids, or prompt
    embeddings, which the engine hashes itself).
    """
    from coordinator.protocol import frontend as fp

    tokens = getattr(request, "prompt_token_ids", None)
    if tokens is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    items = None
    features = getattr(request, "mm_features", None)
    if features:
        items = [fp.MultiModalItem(str(f.identifier), int(f.mm_position.offset),
                                   int(f.mm_position.length)) for f in features]
    return fp.PromptKeys(list(tokens), lora.lora_name if lora is not None else None,
                         getattr(request, "cache_salt", None), items,
                         getattr(request, "session_id", None))


class RouteClient:
    """Asks the coordinator for a request's rank within a deadline; None means vLLM decides.

    One DEALER to the coordinator's ``frontend`` socket, made on first use in the
    running event loop. ``ZMQ_IMMEDIATE`` makes a send fail while no connection
    is up: the call then waits for one within its deadline (the first calls of a
    new process), and after a call that found none, the next ones for
    ``RETRY_AFTER_S`` fail at once (a dead coordinator costs one deadline a
    second, not one per request). Answers that come after the deadline are
    dropped when they arrive. ``outcomes``
    counts every call: routed, timeout, unavailable (no address, no connection,
    queue full), refused (the coordinator could not choose), error.
    """

    SUMMARY_EVERY_S = 60.0
    RETRY_AFTER_S = 1.0
    """After a call found no connection, later calls fail at once for this long."""

    def __init__(self, address: str | None, *, deadline_s: float = DEFAULT_ROUTE_DEADLINE_S,
                 on_outcome: Callable[[str], None] | None = None) -> None:
        self.address = address
        self.deadline_s = deadline_s
        self.outcomes: Counter[str] = Counter()
        self._on_outcome = on_outcome
        self._ctx: Any = None
        self._sock: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        self._warned: set[str] = set()
        self._last_summary = time.monotonic()
        self._down_until = 0.0

    def _count(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if self._on_outcome is not None:
            self._on_outcome(outcome)
        if outcome == "routed":
            return
        now = time.monotonic()
        if outcome not in self._warned:
            self._warned.add(outcome)
            log.warning("dp-coordinator route: %s%s; vLLM chooses the rank itself for such "
                        "requests (counted in dp_coordinator_route_client_total)", outcome,
                        f" ({detail})" if detail else "")
        elif now - self._last_summary >= self.SUMMARY_EVERY_S:
            self._last_summary = now
            log.warning("dp-coordinator route outcomes so far: %s", dict(self.outcomes))

    def _connect(self) -> bool:
        loop = asyncio.get_running_loop()
        if self._sock is not None and self._loop is loop:
            return True
        self.close()
        if not self.address:
            return False
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 1000),
                              (zmq.RCVHWM, 1000), (zmq.MAXMSGSIZE, 1 << 20)):
            sock.setsockopt(option, value)
        if self.address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(self.address)
        self._sock, self._loop = sock, loop
        self._reader = loop.create_task(self._read())
        return True

    async def _read(self) -> None:
        from coordinator.protocol import frontend as fp
        from coordinator.protocol.errors import ProtocolError

        sock = self._sock
        while True:
            frames = await sock.recv_multipart()
            try:
                reply = fp.decode_reply(frames[0])
            except ProtocolError:
                continue
            future = self._pending.pop(getattr(reply, "call_id", -1), None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def _send(self, header: bytes, started: float) -> bool:
        """Send now; without a connection, wait for one within the deadline, unless the
        coordinator was found unreachable less than ``RETRY_AFTER_S`` ago."""
        import zmq

        for attempt in range(2):
            sent = self._sock.send(header, zmq.NOBLOCK)
            # An asyncio socket reports a NOBLOCK send that could not go out on its future.
            if not (sent.done() and isinstance(sent.exception(), zmq.Again)):
                return True
            if attempt or started < self._down_until:
                break
            wait_ms = int(max(0.0, self.deadline_s - (time.monotonic() - started)) * 1000)
            if not await self._sock.poll(max(1, wait_ms), zmq.POLLOUT):
                break
        self._down_until = time.monotonic() + self.RETRY_AFTER_S
        return False

    async def route(self, request_id: str, ranks: Sequence[int] | None,
                    prompt: Any) -> int | None:
        """The rank the coordinator chose, or None (vLLM's own choice); counted either way."""

        from coordinator.protocol import frontend as fp

        try:
            if not self._connect():
                self._count("unavailable", f"{ROUTE_ADDRESS_ENV} is not set")
                return None
            self._next_call += 1
            call_id = self._next_call
            header = fp.encode(fp.Route(call_id, request_id,
                                        None if ranks is None else list(ranks), prompt))
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._pending[call_id] = future
            started = time.monotonic()
            if not await self._send(header, started):
                self._pending.pop(call_id, None)
                self._count("unavailable", f"no connection to {self.address}")
                return None
            try:
                remaining = max(0.0, self.deadline_s - (time.monotonic() - started))
                reply = await asyncio.wait_for(future, remaining)
            except asyncio.TimeoutError:
                self._pending.pop(call_id, None)
                self._count("timeout", f"no answer within {self.deadline_s * 1000:g} ms")
                return None
        except Exception as exc:  # a broken route must never break vLLM's request path
            self._count("error", repr(exc))
            return None
        if isinstance(reply, fp.Routed):
            self._count("routed")
            return int(reply.rank)
        self._count("refused", getattr(reply, "message", ""))
        return None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._loop = None


_client: RouteClient | None = None
_metric: Any = None


def _count_metric(outcome: str) -> None:
    global _metric
    if _metric is None:
        try:
            from prometheus_client import Counter as PromCounter

            _metric = PromCounter("dp_coordinator_route_client",
                                  "Route calls of this API server to dp-coordinator, by "
                                  "outcome (all but routed left the choice to vLLM)",
                                  ["outcome"])
        except Exception:  # already registered by another copy, or no prometheus_client
            _metric = False
    if _metric:
        _metric.labels(outcome).inc()


def _shared_client() -> RouteClient:
    global _client
    if _client is None:
        _client = RouteClient(os.environ.get(ROUTE_ADDRESS_ENV) or None,
                              deadline_s=_route_deadline_s(), on_outcome=_count_metric)
    return _client


def patch_client(module: types.ModuleType,
                 client: Callable[[], RouteClient] = _shared_client) -> bool:
    """Wrap ``DPLBAsyncMPClient.add_request_async`` in ``module`` to ask ``client()`` first.

    Returns False if the module has no such class or it is wrapped already.
    """
    cls = getattr(module, ROUTED_CLASS, None)
    original = getattr(cls, "add_request_async", None)
    if cls is None or original is None or getattr(original, "__dp_coordinator_route__", False):
        return False

    async def add_request_async(self: Any, request: Any) -> Any:
        if (getattr(request, "data_parallel_rank", 0) is None
                and getattr(request, "pooling_params", None) is None
                and request.request_id not in getattr(self, "reqs_in_flight", {})):
            managed = list(self.engine_ranks_managed)
            rank = await client().route(request.request_id, managed, prompt_keys(request))
            if rank is not None and managed and managed[0] <= rank <= managed[-1]:
                # vLLM's index into the engines this client manages.
                request.data_parallel_rank = rank - managed[0]
        return await original(self, request)

    add_request_async.__dp_coordinator_route__ = True  # type: ignore[attr-defined]
    add_request_async.__wrapped__ = original  # type: ignore[attr-defined]
    add_request_async.__doc__ = original.__doc__
    cls.add_request_async = add_request_async
    log.info("vLLM's API server asks dp-coordinator for each request's rank (%s.%s)",
             module.__name__, ROUTED_CLASS)
    return True


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``patch_client`` right after vLLM's client module executes."""

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != CLIENT_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = (
                find(fullname, path, target) if find is not None else None)
            if spec is not None and spec.loader is not None:
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self._loader is None:
            raise RuntimeError('internal invariant broken: self._loader is not None')
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        if self._loader is None:
            raise RuntimeError('internal invariant broken: self._loader is not None')
        self._loader.exec_module(module)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        try:
            patch_client(module)
        except Exception as exc:  # never break vLLM's import
            log.warning("dp-coordinator route not installed: %s", exc)


def _route_when_loaded() -> None:
    module = sys.modules.get(CLIENT_MODULE)
    if module is not None:
        patch_client(module)
    elif not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
