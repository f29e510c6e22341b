"""Prometheus metrics rendered from the latest ``ObservedState``.

``SnapshotCollector`` is registered in the HTTP endpoints' own registry (never
the process-global one) and renders whatever snapshot was published last:
per-rank gauges, group gauges and counters, the wake-latency histogram, and
every counter of the coordinator by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final, get_args

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from coordinator.core.dispatch.balancer import balance_ratio
from coordinator.core.events import SendFailure
from coordinator.core.ranks.membership import RefusalReason
from coordinator.core.ranks.versions import SUPPORTED_RANGE, is_supported
from coordinator.protocol.addresses import SOCKET_KEYS
from coordinator.server.bootstrap_metrics import bootstrap_metrics
from coordinator.server.observe import ObservedState
from coordinator.server.prefix_metrics import prefix_metrics

PREFIX: Final = "dp_coordinator"

# States a rank row can be in (membership's RankState values plus "absent").
RANK_STATES: Final = ("absent", "handshaking", "ready", "draining", "cordoned", "dead")
WATCHDOG_KINDS: Final = ("no_progress", "wave_split")

# From the coordinator's first wake of a paused group to an engine reporting the
# wave started: one network round trip plus a scheduler step when healthy.
WAKE_LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# Label values every coordinator can count, shown at 0 until they count something: a
# healthy system's panels then show 0, not "No data", and rate() has a starting point.
ZERO_SERIES: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    "refused": tuple(("handshake", reason.value) for reason in RefusalReason),
    "dropped": tuple((socket, reason) for socket in SOCKET_KEYS
                     for reason in ("decode", "frame_count")),
    "send_dropped": tuple((socket, reason) for socket in SOCKET_KEYS if socket != "back_output"
                          for reason in get_args(SendFailure)),
}
HANDSHAKE_ZERO_SERIES: Final = (("hello", "accepted"), ("ready", "accepted"),
                                ("any", "replaced"), ("any", "refused"))

# Counter keys of the core (CoordinatorCore.counter_values) that metrics single out.
COUNTER_START_BROADCASTS: Final = "waves.start_broadcasts"
COUNTER_LEASE_DEAD: Final = "lease.dead"


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
class Published:
    """What the HTTP thread reads: a snapshot and the histogram accumulated up to it."""

    snapshot: ObservedState
    latency_buckets: tuple[int, ...]  # per bucket, not cumulative; last is +Inf
    latency_sum: float


class SnapshotCollector:
    """A prometheus-client collector that renders the latest published snapshot."""

    def __init__(self, read: Callable[[], Published | None], clock: Callable[[], float]) -> None:
        self._read = read
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        published = self._read()
        if published is None:
            return
        yield from _rank_metrics(published.snapshot)
        yield from _group_metrics(published, self._clock())
        yield from prefix_metrics(published.snapshot)
        yield from bootstrap_metrics(published.snapshot)
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
    info = GaugeMetricFamily(_name("engine_info"), "1 per rank whose engine named its vLLM "
                             f"version; supported is whether it is in {SUPPORTED_RANGE}",
                             labels=["rank", "vllm_version", "supported"])
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
        if view.vllm_version is not None:
            supported = "true" if is_supported(view.vllm_version) else "false"
            info.add_metric([rank, view.vllm_version, supported], 1.0)
        for name in states:
            state.add_metric([rank, name], 1.0 if view.state == name else 0.0)
    yield from (waiting, running, kv, in_flight, state, age, dispatches, info)


def _group_metrics(published: Published, now: float) -> Iterator[Metric]:
    snap = published.snapshot
    yield GaugeMetricFamily(_name("wave"), "Current wave number (the next one while paused)",
                            value=snap.wave)
    yield GaugeMetricFamily(_name("wave_running"), "1 while an engine reported the current "
                            "wave running, 0 while paused", value=1.0 if snap.running else 0.0)
    yield GaugeMetricFamily(_name("lockstep"), "1 with wave coordination (MoE), 0 in dense mode",
                            value=1.0 if snap.lockstep else 0.0)
    yield GaugeMetricFamily(_name("all_ranks_ready"), "1 when every rank of the group is ready",
                            value=1.0 if snap.all_ready else 0.0)
    yield GaugeMetricFamily(_name("group_serves"), "1 when the group takes requests (what "
                            "/readyz says: gate open, at least one rank dispatchable)",
                            value=1.0 if snap.readiness.serves else 0.0)
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
    labelled: dict[str, dict[tuple[str, str], int]] = {
        prefix: dict.fromkeys(ZERO_SERIES[prefix], 0) for prefix in by_socket}
    for key, value in sorted(counters.items()):
        events.add_metric([key], value)
        for prefix in by_socket:
            parts = split_counter(key, prefix)
            if parts is not None:
                labelled[prefix][parts] = value
    for prefix, family in by_socket.items():
        for labels, value in sorted(labelled[prefix].items()):
            family.add_metric(list(labels), value)
    handshakes = CounterMetricFamily(_name("handshakes"), "Engine handshakes by step and "
                                     "outcome", labels=["step", "outcome"])
    outcomes = {**dict.fromkeys(HANDSHAKE_ZERO_SERIES, 0), **handshake_outcomes(counters)}
    for (step, outcome), value in sorted(outcomes.items()):
        handshakes.add_metric([step, outcome], value)
    yield from by_socket.values()
    yield handshakes
    yield events
