"""Prometheus metrics of the KV event plane, the prefix index and the routing decisions.

Rendered from the snapshot's ``prefix`` view and the core's ``kv.``,
``prefix_index.`` and ``route.`` counters. Every family is exported whether or
not the coordinator follows KV events (zeros, and one series per rank and per
known label value), so dashboards and alerts find the same series everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Final

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from coordinator.core.dispatch.prefix_rule import RouteReason
from coordinator.server.observe import DECISION_BUCKETS, ObservedState

PREFIX: Final = "dp_coordinator"
STREAM_STATES: Final = ("off", "sync", "live", "replaying")
EVENT_KINDS: Final = ("stored", "removed", "cleared", "unknown")
BAD_REASONS: Final = ("decode", "bad_value", "frame_count", "unexpected_type")
REPLAY_OUTCOMES: Final = ("filled", "incomplete", "timed_out")
RESET_CAUSES: Final = ("gap", "replay_incomplete", "replay_timeout", "publisher_restart",
                       "bad_batch", "rank_gone", "rank_replaced", "publisher_disconnected")
ROUTE_REASONS: Final = tuple(reason.value for reason in RouteReason)


def _name(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


def _labelled(family: CounterMetricFamily | GaugeMetricFamily, counters: Mapping[str, int],
              prefix: str, known: tuple[str, ...]) -> CounterMetricFamily | GaugeMetricFamily:
    """One series per known label value (0 until counted), plus any other value counted."""
    seen = {key[len(prefix):]: value for key, value in counters.items()
            if key.startswith(prefix)}
    for label in [*dict.fromkeys(known), *sorted(set(seen) - set(known))]:
        family.add_metric([label], seen.get(label, 0))
    return family


def prefix_metrics(snap: ObservedState) -> Iterator[Metric]:
    view = snap.prefix
    counters = snap.counters
    ranks = [rank.rank for rank in snap.ranks]
    blocks = GaugeMetricFamily(_name("prefix_index_blocks"), "KV cache blocks the prefix "
                               "index holds for the rank", labels=["rank"])
    state = GaugeMetricFamily(_name("kv_stream_state"), "1 for the state of the rank's KV "
                              "event stream (off: not followed), 0 for the others",
                              labels=["rank", "state"])
    batches = CounterMetricFamily(_name("kv_events_batches"), "KV event batches received "
                                  "from the rank's publisher, live and replayed",
                                  labels=["rank"])
    for rank in ranks:
        held = view.blocks.get(rank, 0) if view is not None else 0
        current = view.streams.get(rank, "off") if view is not None else "off"
        blocks.add_metric([str(rank)], held)
        batches.add_metric([str(rank)], view.batches.get(rank, 0) if view is not None else 0)
        for name in STREAM_STATES:
            state.add_metric([str(rank), name], 1.0 if current == name else 0.0)
    yield from (blocks, state, batches)
    yield GaugeMetricFamily(_name("prefix_index_total_blocks"), "(rank, block) entries the "
                            "prefix index holds, over all ranks",
                            value=view.total_blocks if view is not None else 0)
    yield GaugeMetricFamily(_name("prefix_index_distinct_blocks"), "Distinct blocks the "
                            "prefix index holds (a block cached on several ranks counts once)",
                            value=view.distinct_blocks if view is not None else 0)
    yield GaugeMetricFamily(_name("prefix_index_memory_bytes"), "Estimated memory the prefix "
                            "index holds", value=view.memory_bytes if view is not None else 0)
    yield GaugeMetricFamily(_name("kv_events_pending_blocks"), "Blocks of received KV events "
                            "not yet applied to the index",
                            value=view.pending_blocks if view is not None else 0)
    yield _labelled(CounterMetricFamily(_name("kv_events"), "KV cache events applied to the "
                                        "index, by kind (unknown: skipped, newer vLLM)",
                                        labels=["kind"]), counters, "kv.events.", EVENT_KINDS)
    yield _labelled(CounterMetricFamily(_name("kv_events_bad_batches"), "KV event messages "
                                        "that did not decode, by reason", labels=["reason"]),
                    counters, "kv.bad_batches.", BAD_REASONS)
    yield CounterMetricFamily(_name("kv_events_gaps"), "Live KV event batches that came after "
                              "a hole in the sequence", value=counters.get("kv.gaps", 0))
    yield CounterMetricFamily(_name("kv_events_lost_batches"), "KV event batches never applied "
                              "(their rank's index was emptied instead)",
                              value=counters.get("kv.lost_batches", 0))
    yield CounterMetricFamily(_name("kv_events_replay_requests"), "Replays asked of the "
                              "publishers", value=counters.get("kv.replays_requested", 0))
    replays = CounterMetricFamily(_name("kv_events_replays"), "Replays by outcome: filled "
                                  "(nothing missing), incomplete (the publisher's buffer had "
                                  "lost some), timed_out", labels=["outcome"])
    for outcome in REPLAY_OUTCOMES:
        replays.add_metric([outcome], counters.get(f"kv.replays_{outcome}", 0))
    yield replays
    yield CounterMetricFamily(_name("kv_events_publisher_restarts"), "Publishers whose "
                              "sequence numbers started again (a restarted engine)",
                              value=counters.get("kv.publisher_restarts", 0))
    yield _labelled(CounterMetricFamily(_name("prefix_index_resets"), "Ranks whose index was "
                                        "emptied, by cause", labels=["cause"]),
                    counters, "kv.resets.", RESET_CAUSES)
    yield CounterMetricFamily(_name("prefix_index_evictions"), "Blocks the index dropped to "
                              "stay within its memory caps",
                              value=counters.get("prefix_index.evicted_at_cap", 0))
    yield _labelled(CounterMetricFamily(_name("route_decisions"), "Ranks chosen by the prefix "
                                        "policy (and route calls), by what decided",
                                        labels=["reason"]),
                    counters, "route.decisions.", ROUTE_REASONS)
    yield CounterMetricFamily(_name("route_prompt_tokens"), "Prompt tokens of the requests "
                              "the prefix policy routed",
                              value=counters.get("route.prompt_tokens", 0))
    yield CounterMetricFamily(_name("route_cached_tokens"), "Of those, tokens estimated to be "
                              "in the chosen rank's prefix cache",
                              value=counters.get("route.cached_tokens", 0))
    yield CounterMetricFamily(_name("route_queries"), "Route calls answered (the vLLM plugin "
                              "route asks before vLLM's own choice)",
                              value=counters.get("route.answered", 0))
    counts, total = snap.decision_times
    cumulative: list[tuple[str, float]] = []
    running = 0
    bounds = [*DECISION_BUCKETS, math.inf]
    for index, bound in enumerate(bounds):
        running += counts[index] if index < len(counts) else 0
        cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), running))
    yield HistogramMetricFamily(_name("route_decision_seconds"), "CPU time the coordinator "
                                "took over a submit or route call: reading the prompt, the "
                                "lookup, the choice of rank and the dispatch built on it "
                                "(at most one call per 5 ms)",
                                buckets=cumulative, sum_value=total)
