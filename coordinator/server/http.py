"""Operators' HTTP endpoints: Prometheus metrics, health, readiness, state, flight recorder.

The coordinator's event loop never serves HTTP itself. About every 250 ms, and
on every wave or membership change, it builds an immutable `ObservedState` and
hands it to `HttpEndpoints.update`, which swaps one reference. A wsgiref server
in a daemon thread answers every request from whatever reference it reads, so a
slow scraper cannot stall the loop and the loop never waits for a lock. If the
loop stops publishing (blocked, or dead), the snapshot ages and `/healthz` says
so.

Endpoints:
  /metrics       Prometheus text (or OpenMetrics when asked), from a registry of
                 our own (never the process-global one)
  /healthz       200 while the loop published a snapshot within `stale_after_s`,
                 else 503 with a JSON reason
  /readyz        200 when healthy and every rank of the group is ready
  /state         JSON: membership, loads, wave, counters, watchdog
  /debug/waves   JSON: the flight recorder tail (`?n=` limits it)
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import math
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from coordinator.core.balancer import balance_ratio

log = logging.getLogger("coordinator.http")

DEFAULT_METRICS_HOST: Final = "127.0.0.1"
DEFAULT_STALE_AFTER_S: Final = 2.0
PREFIX: Final = "dp_coordinator"

# States a rank row can be in (membership's RankState values plus "absent").
RANK_STATES: Final = ("absent", "handshaking", "ready", "draining", "cordoned", "dead")
WATCHDOG_KINDS: Final = ("no_progress", "wave_split")

# From the coordinator's first wake of a paused group to an engine reporting the
# wave started: one network round trip plus a scheduler step when healthy.
WAKE_LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# Counter keys the server keeps (see CoordinatorServer.counters) that metrics single out.
COUNTER_START_BROADCASTS: Final = "waves.start_broadcasts"
COUNTER_LEASE_DEAD: Final = "lease.dead"

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


@dataclass(frozen=True)
class RankView:
    """One rank as the loop saw it when the snapshot was taken."""

    rank: int
    state: str
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    dispatched: int = 0
    """Requests dispatched to this rank since the coordinator started."""
    report_age_s: float | None = None
    """Seconds since this rank's last stats report (None: never reported)."""
    in_flight: int = 0


@dataclass(frozen=True)
class ObservedState:
    """Everything the HTTP thread may show, taken at one moment by the loop.

    Build a new one each time, with new lists and dicts: the HTTP thread reads it
    without a lock, so nothing in it may change after `update` is called.
    """

    taken_at: float
    """`time.monotonic()` when the loop took the snapshot."""
    wave: int
    running: bool
    lockstep: bool
    ranks: list[RankView]
    counters: dict[str, int] = field(default_factory=dict)
    waves_total: int = 0
    seconds_running: float = 0.0
    seconds_paused: float = 0.0
    wake_latencies_s: list[float] = field(default_factory=list)
    """Wake latencies measured since the previous snapshot (each is counted once)."""
    watchdog: list[dict[str, object]] = field(default_factory=list)
    """Active watchdog alerts (`WatchdogAlert.as_dict()`)."""
    recorder_tail: list[dict[str, object]] = field(default_factory=list)
    """Flight recorder tail (`FlightRecorder.as_json()`), oldest first."""
    all_ready: bool = False
    state_json: dict[str, object] = field(default_factory=dict)
    """Extra JSON for /state (membership, leases, frontends...), merged under ours."""


def split_counter(key: str, prefix: str) -> tuple[str, str] | None:
    """``"<prefix>.<socket>.<reason>"`` -> ``(socket, reason)``; None for other keys."""
    if not key.startswith(prefix + "."):
        return None
    parts = key[len(prefix) + 1 :].split(".", 1)
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]


def handshake_outcomes(counters: Mapping[str, int]) -> dict[tuple[str, str], int]:
    """Handshakes by ``(step, outcome)``: accepted per step, replaced, refused (any step)."""
    out: dict[tuple[str, str], int] = {}
    for key, value in counters.items():
        if key.startswith("handshake."):
            rest = key[len("handshake.") :].split(".", 1)
            label = (rest[0], rest[1]) if len(rest) == 2 else ("any", rest[0])
        elif key.startswith("refused.handshake."):
            label = ("any", "refused")
        else:
            continue
        out[label] = out.get(label, 0) + value
    return out


@dataclass(frozen=True)
class _Published:
    """What the HTTP thread reads: a snapshot and the histogram accumulated up to it."""

    snapshot: ObservedState
    latency_buckets: tuple[int, ...]  # per bucket, not cumulative; last is +Inf
    latency_sum: float


class SnapshotCollector:
    """A prometheus-client collector that renders the latest published snapshot."""

    def __init__(self, read: Callable[[], _Published | None], clock: Callable[[], float]) -> None:
        self._read = read
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        published = self._read()
        if published is None:
            return
        yield from _rank_metrics(published.snapshot)
        yield from _group_metrics(published, self._clock())
        yield from _counter_metrics(published.snapshot.counters)


def _name(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


def _rank_metrics(snap: ObservedState) -> Iterator[Metric]:
    waiting = GaugeMetricFamily(_name("rank_waiting"), "Requests waiting at the rank, as it "
                                "last reported", labels=["rank"])
    running = GaugeMetricFamily(_name("rank_running"), "Requests running at the rank, as it "
                                "last reported", labels=["rank"])
    kv = GaugeMetricFamily(_name("rank_kv_cache_usage"), "KV cache usage of the rank (0..1), "
                           "as it last reported", labels=["rank"])
    in_flight = GaugeMetricFamily(_name("rank_in_flight"), "Requests dispatched through the "
                                  "coordinator to the rank and not yet finished", labels=["rank"])
    state = GaugeMetricFamily(_name("rank_state"), "1 for the rank's current membership "
                              "state, 0 for the others", labels=["rank", "state"])
    age = GaugeMetricFamily(_name("rank_report_age_seconds"), "Seconds since the rank's last "
                            "stats report (absent until it reports)", labels=["rank"])
    dispatches = CounterMetricFamily(_name("dispatches"), "Requests the coordinator dispatched "
                                     "to the rank", labels=["rank"])
    known = set(RANK_STATES) | {view.state for view in snap.ranks}
    states = [*RANK_STATES, *sorted(known - set(RANK_STATES))]
    for view in snap.ranks:
        rank = str(view.rank)
        waiting.add_metric([rank], view.waiting)
        running.add_metric([rank], view.running)
        kv.add_metric([rank], view.kv_cache_usage)
        in_flight.add_metric([rank], view.in_flight)
        dispatches.add_metric([rank], view.dispatched)
        if view.report_age_s is not None:
            age.add_metric([rank], view.report_age_s)
        for name in states:
            state.add_metric([rank, name], 1.0 if view.state == name else 0.0)
    yield from (waiting, running, kv, in_flight, state, age, dispatches)


def _group_metrics(published: _Published, now: float) -> Iterator[Metric]:
    snap = published.snapshot
    yield GaugeMetricFamily(_name("wave"), "Current wave number (the next one while paused)",
                            value=snap.wave)
    yield GaugeMetricFamily(_name("wave_running"), "1 while an engine reported the current "
                            "wave running, 0 while paused", value=1.0 if snap.running else 0.0)
    yield GaugeMetricFamily(_name("lockstep"), "1 with wave coordination (MoE), 0 in dense mode",
                            value=1.0 if snap.lockstep else 0.0)
    yield GaugeMetricFamily(_name("all_ranks_ready"), "1 when every rank of the group is ready",
                            value=1.0 if snap.all_ready else 0.0)
    yield CounterMetricFamily(_name("waves"), "Waves started", value=snap.waves_total)
    yield CounterMetricFamily(_name("running_seconds"), "Seconds the group was running a wave",
                              value=snap.seconds_running)
    yield CounterMetricFamily(_name("paused_seconds"), "Seconds the group was paused",
                              value=snap.seconds_paused)
    yield CounterMetricFamily(_name("start_dp_wave_broadcasts"), "START_DP_WAVE broadcasts "
                              "sent to the engines",
                              value=snap.counters.get(COUNTER_START_BROADCASTS, 0))
    yield CounterMetricFamily(_name("lease_expiries"), "Rank registrations that ended: lease "
                              "expired, peer disconnected or rank removed",
                              value=snap.counters.get(COUNTER_LEASE_DEAD, 0))
    cumulative: list[tuple[str, float]] = []
    running_total = 0
    bounds = [*WAKE_LATENCY_BUCKETS, math.inf]
    for bound, count in zip(bounds, published.latency_buckets, strict=True):
        running_total += count
        cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), running_total))
    yield HistogramMetricFamily(
        _name("wake_latency_seconds"),
        "From the coordinator waking a paused group for a request to an engine reporting "
        "the wave started",
        buckets=cumulative,
        sum_value=published.latency_sum,
    )
    loads = [v.waiting + v.running for v in snap.ranks if v.state == "ready"]
    if not loads:
        loads = [v.waiting + v.running for v in snap.ranks]
    yield GaugeMetricFamily(_name("balance_ratio"), "Mean over max of waiting+running across "
                            "ready ranks (1.0: even or idle)", value=balance_ratio(loads))
    alerts = GaugeMetricFamily(_name("watchdog_alert"), "1 while the hang watchdog's condition "
                               "fires", labels=["kind"])
    firing = {str(alert.get("kind")) for alert in snap.watchdog}
    for kind in [*WATCHDOG_KINDS, *sorted(firing - set(WATCHDOG_KINDS))]:
        alerts.add_metric([kind], 1.0 if kind in firing else 0.0)
    yield alerts
    yield GaugeMetricFamily(_name("snapshot_age_seconds"), "Seconds since the event loop last "
                            "published its state", value=max(0.0, now - snap.taken_at))


def _counter_metrics(counters: Mapping[str, int]) -> Iterator[Metric]:
    by_socket = {
        "refused": CounterMetricFamily(_name("refused"), "Peers refused (handshake identities "
                                       "and settings, CURVE keys), by socket and reason",
                                       labels=["socket", "reason"]),
        "dropped": CounterMetricFamily(_name("dropped_frames"), "Bad input dropped, by socket "
                                       "and reason", labels=["socket", "reason"]),
        "send_dropped": CounterMetricFamily(_name("send_dropped"), "Messages that could not "
                                            "be sent (peer gone or queue full), by socket",
                                            labels=["socket", "reason"]),
    }
    events = CounterMetricFamily(_name("events"), "Every internal counter of the coordinator, "
                                 "by name", labels=["event"])
    for key, value in sorted(counters.items()):
        events.add_metric([key], value)
        for prefix, family in by_socket.items():
            parts = split_counter(key, prefix)
            if parts is not None:
                family.add_metric(list(parts), value)
    handshakes = CounterMetricFamily(_name("handshakes"), "Engine handshakes by step and "
                                     "outcome", labels=["step", "outcome"])
    for (step, outcome), value in sorted(handshake_outcomes(counters).items()):
        handshakes.add_metric([step, outcome], value)
    yield from by_socket.values()
    yield handshakes
    yield events


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
    ) -> None:
        self.host = host
        self.port = port
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._published: _Published | None = None
        # Histogram state is touched only by update() (the loop thread).
        self._latency_counts = [0] * (len(WAKE_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self._published, clock))
        self._metrics_app = cast(WsgiApp, make_wsgi_app(self.registry))
        self._server: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None

    # ---- loop side -----------------------------------------------------------------------

    def update(self, snapshot: ObservedState) -> None:
        """Publish a new snapshot (loop thread). Its wake latencies are counted once, here."""
        for latency in snapshot.wake_latencies_s:
            self._latency_counts[bisect.bisect_left(WAKE_LATENCY_BUCKETS, latency)] += 1
            self._latency_sum += latency
        self._published = _Published(snapshot, tuple(self._latency_counts), self._latency_sum)

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
        not_ready = {str(v.rank): v.state for v in snap.ranks if v.state != "ready"}
        if snap.all_ready:
            return "200 OK", {"status": "ready", "ranks": len(snap.ranks)}
        return "503 Service Unavailable", {
            "status": "not_ready",
            "reason": f"{len(not_ready)} of {len(snap.ranks)} ranks are not ready"
            if not_ready else "the group is not ready",
            "ranks_not_ready": not_ready,
        }

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
        now = self._clock()
        out = []
        for event in events:
            item = dict(event)
            at = item.get("at")
            if isinstance(at, (int, float)):
                item["age_s"] = round(now - at, 6)
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


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags for metrics, the watchdog and the flight recorder."""
    group = parser.add_argument_group("observability")
    group.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve /metrics, /healthz, /readyz, /state and /debug/waves over "
                       "HTTP on PORT (0: any free port; default: off)")
    group.add_argument("--metrics-host", default=DEFAULT_METRICS_HOST, metavar="H",
                       help=f"address for the HTTP endpoints (default {DEFAULT_METRICS_HOST}); "
                       "they are read-only but reveal the group's state")
    group.add_argument("--watchdog-stall-s", type=float, default=30.0, metavar="S",
                       help="alert when the group is believed running but no rank stepped "
                       "for S seconds, or ranks report different waves for S seconds; "
                       "0 disables (default 30)")
    group.add_argument("--no-watchdog-rewake", dest="watchdog_rewake", action="store_false",
                       help="when the watchdog fires, only report it; by default it also "
                       "broadcasts START_DP_WAVE [wave, nil] again, which running engines "
                       "ignore, so a false alarm costs nothing")
    group.add_argument("--recorder-size", type=int, default=1000, metavar="N",
                       help="wave and membership transitions kept for /debug/waves, SIGUSR1 "
                       "and watchdog alerts (default 1000)")
