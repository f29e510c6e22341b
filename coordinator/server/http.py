"""Operators' HTTP endpoints: Prometheus metrics, health, readiness, state, flight recorder.

The coordinator's event loop never serves HTTP itself. About every 250 ms, and
on every wave or membership change, it builds an immutable `ObservedState`
(`coordinator.server.observe`) and hands it to `HttpEndpoints.update`, which
swaps one reference; `coordinator.server.metrics` renders it. A wsgiref server
in a daemon thread answers every request from whatever reference it reads, so a
slow scraper cannot stall the loop and the loop never waits for a lock. If the
loop stops publishing (blocked, or dead), the snapshot ages and `/healthz` says
so.

Endpoints:
  /metrics       Prometheus text (or OpenMetrics when asked), from a registry of
                 our own (never the process-global one)
  /healthz       200 while the loop published a snapshot within `stale_after_s`,
                 else 503 with a JSON reason
  /readyz        200 when healthy and the group serves: the start-up gate is open and
                 at least one rank takes requests (core.ranks.readiness)
  /state         JSON: membership, loads, wave, counters, watchdog
  /debug/waves   JSON: the flight recorder tail (`?n=` limits it), each event with its
                 age and its time of day (UTC)
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, Final, cast
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from coordinator.core.config import CoreConfig
from coordinator.core.observe.views import RankView
from coordinator.server.metrics import WAKE_LATENCY_BUCKETS, Published, SnapshotCollector
from coordinator.server.observe import ObservedState
from coordinator.server.process_metrics import register_process_metrics

__all__ = ["DEFAULT_METRICS_HOST", "ENDPOINTS", "HttpEndpoints", "ObservedState", "RankView",
           "add_observability_arguments"]

log = logging.getLogger("coordinator.http")

DEFAULT_METRICS_HOST: Final = "127.0.0.1"
DEFAULT_STALE_AFTER_S: Final = 2.0

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    """Requests go to the debug log, not stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s " + format, self.address_string(), *args)


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup of the host; skip it.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)
        self.setup_environ()


class _ThreadingServerV6(_ThreadingServer):
    address_family = socket.AF_INET6


class HttpEndpoints:
    """Serves the endpoints from the latest `ObservedState`, in a daemon thread."""

    def __init__(
        self,
        host: str = DEFAULT_METRICS_HOST,
        port: int = 0,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self.port = port
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._wall_clock = wall_clock  # for the time of day of recorded events
        self._published: Published | None = None
        # Histogram state is touched only by update() (the loop thread).
        self._latency_counts = [0] * (len(WAKE_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self._published, clock))
        register_process_metrics(self.registry)
        self._metrics_app = cast(WsgiApp, make_wsgi_app(self.registry))
        self._server: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None

    # ---- loop side -----------------------------------------------------------------------

    def update(self, snapshot: ObservedState) -> None:
        """Publish a new snapshot (loop thread). Its wake latencies are counted once, here."""
        for latency in snapshot.wake_latencies_s:
            self._latency_counts[bisect.bisect_left(WAKE_LATENCY_BUCKETS, latency)] += 1
            self._latency_sum += latency
        self._published = Published(snapshot, tuple(self._latency_counts), self._latency_sum)

    @property
    def snapshot(self) -> ObservedState | None:
        published = self._published
        return None if published is None else published.snapshot

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> int:
        """Bind and serve in a daemon thread; return the bound port (port 0: ephemeral)."""
        if self._server is not None:
            return self.port
        server_class = _ThreadingServerV6 if ":" in self.host else _ThreadingServer
        host = self.host.strip("[]")
        try:
            server = make_server(host, self.port, self.app, server_class=server_class,
                                 handler_class=_QuietHandler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve HTTP on {self.host}:{self.port}: "
                          f"{exc.strerror or exc}") from exc
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2},
            name="dp-coordinator-http", daemon=True,
        )
        self._thread.start()
        log.info("metrics and state on %s", self.url)
        return self.port

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def __enter__(self) -> HttpEndpoints:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the WSGI application (HTTP thread) ----------------------------------------------

    def app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if method not in ("GET", "HEAD"):
            return _json(start_response, "405 Method Not Allowed",
                         {"error": f"{method} is not allowed; use GET"},
                         extra=[("Allow", "GET, HEAD")], head=False)
        routes: dict[str, Callable[[dict[str, Any]], tuple[str, object]]] = {
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/state": self._state,
            "/debug/waves": self._debug_waves,
            "/": self._index,
        }
        handler = routes.get(path.rstrip("/") or "/")
        body: object
        if handler is None:
            status, body = "404 Not Found", {"error": f"no such endpoint: {path}",
                                             "endpoints": ENDPOINTS}
        else:
            status, body = handler(environ)
        return _json(start_response, status, body, head=method == "HEAD")

    def _age(self, snap: ObservedState) -> float:
        return max(0.0, self._clock() - snap.taken_at)

    def _health(self) -> tuple[bool, dict[str, object]]:
        snap = self.snapshot
        if snap is None:
            return False, {"status": "unavailable",
                           "reason": "the coordinator loop has not published its state yet"}
        age = self._age(snap)
        if age > self.stale_after_s:
            return False, {"status": "unavailable", "snapshot_age_s": round(age, 3),
                           "reason": f"the coordinator loop last published its state "
                           f"{age:.1f} s ago (limit {self.stale_after_s:g} s): the event "
                           "loop is blocked or stopped"}
        return True, {"status": "ok", "snapshot_age_s": round(age, 3)}

    def _healthz(self, environ: dict[str, Any]) -> tuple[str, object]:
        healthy, body = self._health()
        return ("200 OK" if healthy else "503 Service Unavailable"), body

    def _readyz(self, environ: dict[str, Any]) -> tuple[str, object]:
        healthy, body = self._health()
        snap = self.snapshot
        if not healthy or snap is None:
            return "503 Service Unavailable", body
        verdict = snap.readiness  # the core's rule: core.ranks.readiness
        out = {str(rank): state for rank, state in verdict.out.items()}
        if verdict.serves:
            return "200 OK", {"status": "ready", "ranks": len(snap.ranks),
                              "reason": verdict.reason, "ranks_out": out}
        return "503 Service Unavailable", {"status": "not_ready", "reason": verdict.reason,
                                           "ranks_out": out}

    def _state(self, environ: dict[str, Any]) -> tuple[str, object]:
        snap = self.snapshot
        if snap is None:
            return "503 Service Unavailable", self._health()[1]
        body: dict[str, object] = dict(snap.state_json)
        ours: dict[str, object] = {
            "wave": snap.wave,
            "running": snap.running,
            "lockstep": snap.lockstep,
            "all_ready": snap.all_ready,
            "waves_total": snap.waves_total,
            "seconds_running": snap.seconds_running,
            "seconds_paused": snap.seconds_paused,
            "ranks": [_rank_json(view) for view in snap.ranks],
            "counters": dict(snap.counters),
            "watchdog": list(snap.watchdog),
            "snapshot_age_s": round(self._age(snap), 3),
            "policy": snap.policy,
            "prefix": _prefix_json(snap),
        }
        body.update(ours)
        return "200 OK", body

    def _debug_waves(self, environ: dict[str, Any]) -> tuple[str, object]:
        snap = self.snapshot
        if snap is None:
            return "503 Service Unavailable", self._health()[1]
        events = snap.recorder_tail
        query = parse_qs(environ.get("QUERY_STRING", ""))
        limit = query.get("n", [""])[0]
        if limit:
            if not limit.isdigit():
                return "400 Bad Request", {"error": f"n must be a non-negative integer, "
                                           f"got {limit!r}"}
            events = events[len(events) - int(limit) :] if int(limit) else []
        now, wall_now = self._clock(), self._wall_clock()
        out = []
        for event in events:
            item = dict(event)
            at = item.get("at")
            if isinstance(at, (int, float)):
                item["age_s"] = round(now - at, 6)
                # `at` is the loop's monotonic clock; this is when that was, in UTC.
                item["time"] = datetime.fromtimestamp(wall_now - (now - at), timezone.utc
                                                      ).isoformat(timespec="milliseconds")
            out.append(item)
        return "200 OK", {"count": len(out), "events": out}

    def _index(self, environ: dict[str, Any]) -> tuple[str, object]:
        return "200 OK", {"service": "dp-coordinator", "endpoints": ENDPOINTS}


ENDPOINTS: Final = ["/metrics", "/healthz", "/readyz", "/state", "/debug/waves"]


def _rank_json(view: RankView) -> dict[str, object]:
    return {
        "rank": view.rank,
        "state": view.state,
        "waiting": view.waiting,
        "running": view.running,
        "kv_cache_usage": view.kv_cache_usage,
        "dispatched": view.dispatched,
        "report_age_s": view.report_age_s,
        "in_flight": view.in_flight,
    }


def _prefix_json(snap: ObservedState) -> dict[str, object] | None:
    view = snap.prefix
    if view is None:
        return None
    counters = snap.counters
    prompt = counters.get("route.prompt_tokens", 0)
    cached = counters.get("route.cached_tokens", 0)
    return {
        "block_size": view.block_size,
        "total_blocks": view.total_blocks,
        "distinct_blocks": view.distinct_blocks,
        "memory_bytes": view.memory_bytes,
        "pending_blocks": view.pending_blocks,
        "hit_ratio": round(cached / prompt, 4) if prompt else None,
        "ranks": [{"rank": rank, "blocks": view.blocks.get(rank, 0),
                   "stream": view.streams.get(rank, "off"),
                   "batches": view.batches.get(rank, 0),
                   "publisher": view.subscriptions.get(rank)}
                  for rank in (v.rank for v in snap.ranks)],
        "decisions": {key[len("route.decisions."):]: value for key, value in counters.items()
                      if key.startswith("route.decisions.")},
    }


def _json(
    start_response: StartResponse,
    status: str,
    body: object,
    *,
    head: bool,
    extra: Sequence[tuple[str, str]] = (),
) -> list[bytes]:
    data = json.dumps(body, default=str).encode() + b"\n"
    start_response(status, [
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(data))),
        ("Cache-Control", "no-store"),
        *extra,
    ])
    return [] if head else [data]


CORE_DEFAULTS = CoreConfig(rank_start=0, engines=1)


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags for metrics, the watchdog and the flight recorder."""
    group = parser.add_argument_group("observability")
    group.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve /metrics, /healthz, /readyz, /state and /debug/waves over "
                       "HTTP on PORT (0: any free port; default: off)")
    group.add_argument("--metrics-host", default=DEFAULT_METRICS_HOST, metavar="H",
                       help=f"address for the HTTP endpoints (default {DEFAULT_METRICS_HOST}); "
                       "they are read-only but reveal the group's state")
    group.add_argument("--watchdog-stall-s", type=float,
                       default=CORE_DEFAULTS.watchdog_stall_s, metavar="S",
                       help="alert when the group is believed running but no rank stepped "
                       "for S seconds, or ranks report different waves for S seconds; "
                       "0 disables (default 30)")
    group.add_argument("--no-watchdog-rewake", dest="watchdog_rewake", action="store_false",
                       help="when the watchdog fires, only report it; by default it also "
                       "broadcasts START_DP_WAVE [wave, nil] again, which running engines "
                       "ignore, so a false alarm costs nothing")
    group.add_argument("--recorder-size", type=int, default=CORE_DEFAULTS.recorder_size,
                       metavar="N",
                       help="wave and membership transitions kept for /debug/waves, SIGUSR1 "
                       "and watchdog alerts (default 1000)")
