"""Prometheus metrics of the KV bootstrap registry (``--kv-bootstrap-port``).

Rendered from the core's ``kv_bootstrap.`` counters and the snapshot's view of
the entries. Every family is exported whether or not the registry is served
(zeros, one series per known state and reason), so dashboards and alerts find
the same series everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from coordinator.server.observe import ObservedState

PREFIX: Final = "dp_coordinator_kv_bootstrap"
ENTRY_STATES: Final = ("live", "incomplete", "unverified", "dead", "gone")
REFUSAL_REASONS: Final = ("bad_payload", "not_found", "method_not_allowed", "http_400",
                          "http_411", "http_413", "http_431", "http_505",
                          "too_many_connections")
COUNTERS: Final = (
    ("registrations", "Worker registrations recorded (a new worker slot)"),
    ("retries", "Identical registrations repeated (answered ok, nothing changed)"),
    ("replacements", "DP entries replaced because their old engine was proven gone"),
    ("conflicts", "Registrations refused because a live engine holds the DP rank or slot"),
    ("probes", "Probes of an old holder's side channels"),
    ("probes_gone", "Probes that found no side channel accepting a connection"),
    ("queries", "Decoders' /query requests"),
)


def bootstrap_metrics(snap: ObservedState) -> Iterator[Metric]:
    counters = snap.counters
    for name, help_text in COUNTERS:
        yield CounterMetricFamily(f"{PREFIX}_{name}", help_text,
                                  value=counters.get(f"kv_bootstrap.{name}", 0))
    refused = CounterMetricFamily(f"{PREFIX}_refused", "Requests refused as bad input "
                                  "(malformed, out of bounds, oversize), by reason",
                                  labels=["reason"])
    seen = {key.removeprefix("kv_bootstrap.refused."): value for key, value in counters.items()
            if key.startswith("kv_bootstrap.refused.")}
    for reason in [*REFUSAL_REASONS, *sorted(set(seen) - set(REFUSAL_REASONS))]:
        refused.add_metric([reason], seen.get(reason, 0))
    yield refused
    entries = GaugeMetricFamily(f"{PREFIX}_entries", "DP entries of the registry, by state "
                                "(live ones are what /query shows)", labels=["state"])
    view = snap.state_json.get("kv_bootstrap")
    by_state: dict[str, int] = dict.fromkeys(ENTRY_STATES, 0)
    if isinstance(view, list):
        for entry in view:
            state = str(entry.get("state")) if isinstance(entry, dict) else "unknown"
            by_state[state] = by_state.get(state, 0) + 1
    for state, count in by_state.items():
        entries.add_metric([state], count)
    yield entries
