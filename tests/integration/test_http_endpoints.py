"""HttpEndpoints over real HTTP on 127.0.0.1, fed with hand-built snapshots."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.core.observe.recorder import KIND_MEMBERSHIP, KIND_WAVE, FlightRecorder
from coordinator.core.ranks.readiness import Readiness
from coordinator.core.waves.watchdog import HangWatchdog
from coordinator.server.http import (
    HttpEndpoints,
    ObservedState,
    RankView,
    add_observability_arguments,
)
from coordinator.server.metrics import handshake_outcomes, split_counter

pytestmark = pytest.mark.timeout(30)

COUNTERS = {
    "dropped.back_output.decode": 3,
    "dropped.frontend.frame_count": 1,
    "refused.handshake.identity_length": 2,
    "refused.handshake.engine_id_mismatch": 1,
    "refused.curve.unknown_key": 5,
    "handshake.hello.accepted": 4,
    "handshake.ready.accepted": 3,
    "handshake.replaced": 1,
    "lease.dead": 1,
    "waves.start_broadcasts": 7,
    "submit.dispatched": 20,
    "send_dropped.dispatch.unreachable": 1,
}


def make_snapshot(**overrides: object) -> ObservedState:
    recorder = FlightRecorder()
    recorder.record(at=time.monotonic() - 2.0, kind=KIND_MEMBERSHIP, cause="READY accepted",
                    wave=0, running=False, rank=0)
    recorder.record(at=time.monotonic() - 1.0, kind=KIND_WAVE, cause="start_wave(0) from rank 1",
                    wave=0, running=True, rank=1, exclude=1)
    recorder.record(at=time.monotonic(), kind=KIND_WAVE, cause="wave_complete(0) from rank 0",
                    wave=1, running=False, rank=0)
    dog = HangWatchdog(stall_after_s=1.0)
    dog.observe_group(running=True, wave=3, ranks=[0, 1, 2], now=0.0)
    alerts = dog.check(5.0)
    fields: dict[str, object] = {
        "taken_at": time.monotonic(),
        "wave": 3,
        "running": True,
        "lockstep": True,
        "ranks": [
            RankView(0, "ready", waiting=2, running=4, kv_cache_usage=0.25, dispatched=12,
                     report_age_s=0.1, in_flight=5, vllm_version="0.33.0"),
            RankView(1, "ready", waiting=0, running=3, kv_cache_usage=0.5, dispatched=8,
                     report_age_s=0.2, in_flight=3, vllm_version="0.28.1"),
            RankView(2, "dead", dispatched=0, report_age_s=None),
        ],
        "counters": dict(COUNTERS),
        "waves_total": 9,
        "seconds_running": 12.5,
        "seconds_paused": 30.25,
        "wake_latencies_s": [0.002, 0.03],
        "watchdog": [a.as_dict(5.0) for a in alerts],
        "recorder_tail": recorder.as_json(),
        "all_ready": False,
        "state_json": {"rank_start": 0, "rank_count": 3, "frontends": 2},
    }
    fields.update(overrides)
    return ObservedState(**fields)  # type: ignore[arg-type]


@pytest.fixture
def endpoints() -> Iterator[HttpEndpoints]:
    http = HttpEndpoints("127.0.0.1", 0)
    http.start()
    try:
        yield http
    finally:
        http.stop()


def get(url: str, *, method: str = "GET",
        headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(), dict(exc.headers)


def get_json(url: str) -> tuple[int, dict[str, object]]:
    status, body, headers = get(url)
    assert headers["Content-Type"] == "application/json"
    return status, json.loads(body)


Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


def scrape(http: HttpEndpoints) -> tuple[set[str], Samples]:
    status, body, headers = get(http.url + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    families: set[str] = set()
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        families.add(family.name)
        for sample in family.samples:
            samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name][frozenset(labels.items())]


# --- pure helpers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "expected"), [
    ("dropped.back_output.decode", ("back_output", "decode")),
    ("dropped.frontend.bad.dotted", ("frontend", "bad.dotted")),
    ("dropped.frontend", None),
    ("dropped..x", None),
    ("dropped_other.a.b", None),
    ("submit.dispatched", None),
])
def test_split_counter(key: str, expected: tuple[str, str] | None) -> None:
    assert split_counter(key, "dropped") == expected


def test_handshake_outcomes() -> None:
    assert handshake_outcomes(COUNTERS) == {
        ("hello", "accepted"): 4, ("ready", "accepted"): 3, ("any", "replaced"): 1,
        ("any", "refused"): 3,
    }


# --- /metrics ----------------------------------------------------------------------------------


def test_metrics_before_any_snapshot_has_no_coordinator_families(
    endpoints: HttpEndpoints,
) -> None:
    # Only what the process knows without its loop: the build and the process itself.
    families, _ = scrape(endpoints)
    assert [name for name in families if name.startswith("dp_coordinator")] == [
        "dp_coordinator_build_info"]
    assert {"process_resident_memory_bytes", "process_open_fds"} <= set(families)


def test_every_metric_family_with_its_values(endpoints: HttpEndpoints) -> None:
    endpoints.update(make_snapshot())
    endpoints.update(make_snapshot(wake_latencies_s=[0.7], counters={
        **COUNTERS, "submit.dispatched": 21}))
    families, s = scrape(endpoints)
    assert families >= {
        "dp_coordinator_rank_waiting", "dp_coordinator_rank_running",
        "dp_coordinator_rank_kv_cache_usage", "dp_coordinator_rank_in_flight",
        "dp_coordinator_rank_state", "dp_coordinator_rank_report_age_seconds",
        "dp_coordinator_dispatches", "dp_coordinator_wave", "dp_coordinator_wave_running",
        "dp_coordinator_lockstep", "dp_coordinator_all_ranks_ready", "dp_coordinator_waves",
        "dp_coordinator_running_seconds", "dp_coordinator_paused_seconds",
        "dp_coordinator_start_dp_wave_broadcasts", "dp_coordinator_lease_expiries",
        "dp_coordinator_wake_latency_seconds", "dp_coordinator_balance_ratio",
        "dp_coordinator_watchdog_alert", "dp_coordinator_snapshot_age_seconds",
        "dp_coordinator_refused", "dp_coordinator_dropped_frames",
        "dp_coordinator_send_dropped", "dp_coordinator_handshakes", "dp_coordinator_events",
        "dp_coordinator_engine_info",
    }
    # per rank
    assert value(s, "dp_coordinator_rank_waiting", rank="0") == 2
    assert value(s, "dp_coordinator_rank_running", rank="1") == 3
    assert value(s, "dp_coordinator_rank_kv_cache_usage", rank="1") == 0.5
    assert value(s, "dp_coordinator_rank_in_flight", rank="0") == 5
    assert value(s, "dp_coordinator_dispatches_total", rank="0") == 12
    assert value(s, "dp_coordinator_rank_report_age_seconds", rank="1") == 0.2
    assert frozenset({("rank", "2")}) not in s["dp_coordinator_rank_report_age_seconds"]
    # each rank's vLLM, and whether it is in the supported range (rank 2 named none)
    assert s["dp_coordinator_engine_info"] == {
        frozenset({("rank", "0"), ("vllm_version", "0.33.0"), ("supported", "true")}): 1,
        frozenset({("rank", "1"), ("vllm_version", "0.28.1"), ("supported", "false")}): 1,
    }
    states = {dict(k)["state"]: v for k, v in s["dp_coordinator_rank_state"].items()
              if dict(k)["rank"] == "2"}
    assert states == {"absent": 0, "handshaking": 0, "ready": 0, "draining": 0,
                      "cordoned": 0, "dead": 1}
    # group
    assert value(s, "dp_coordinator_wave") == 3
    assert value(s, "dp_coordinator_wave_running") == 1
    assert value(s, "dp_coordinator_lockstep") == 1
    assert value(s, "dp_coordinator_all_ranks_ready") == 0
    assert value(s, "dp_coordinator_waves_total") == 9
    assert value(s, "dp_coordinator_running_seconds_total") == 12.5
    assert value(s, "dp_coordinator_paused_seconds_total") == 30.25
    assert value(s, "dp_coordinator_start_dp_wave_broadcasts_total") == 7
    assert value(s, "dp_coordinator_lease_expiries_total") == 1
    # ready ranks carry 6 and 3: mean 4.5 over max 6
    assert value(s, "dp_coordinator_balance_ratio") == pytest.approx(0.75)
    assert value(s, "dp_coordinator_watchdog_alert", kind="no_progress") == 1
    assert value(s, "dp_coordinator_watchdog_alert", kind="wave_split") == 0
    assert 0 <= value(s, "dp_coordinator_snapshot_age_seconds") < 5
    # wake latency: three observations over two snapshots, each counted once
    assert value(s, "dp_coordinator_wake_latency_seconds_count") == 3
    assert value(s, "dp_coordinator_wake_latency_seconds_sum") == pytest.approx(0.732)
    assert value(s, "dp_coordinator_wake_latency_seconds_bucket", le="0.0025") == 1
    assert value(s, "dp_coordinator_wake_latency_seconds_bucket", le="0.05") == 2
    assert value(s, "dp_coordinator_wake_latency_seconds_bucket", le="0.5") == 2
    assert value(s, "dp_coordinator_wake_latency_seconds_bucket", le="1.0") == 3
    assert value(s, "dp_coordinator_wake_latency_seconds_bucket", le="+Inf") == 3
    # derived from the counters
    assert value(s, "dp_coordinator_refused_total", socket="handshake",
                 reason="identity_length") == 2
    assert value(s, "dp_coordinator_refused_total", socket="curve", reason="unknown_key") == 5
    assert value(s, "dp_coordinator_dropped_frames_total", socket="back_output",
                 reason="decode") == 3
    assert value(s, "dp_coordinator_send_dropped_total", socket="dispatch",
                 reason="unreachable") == 1
    assert value(s, "dp_coordinator_handshakes_total", step="hello", outcome="accepted") == 4
    assert value(s, "dp_coordinator_handshakes_total", step="any", outcome="refused") == 3
    assert {dict(k)["event"]: v for k, v in s["dp_coordinator_events_total"].items()} == {
        **COUNTERS, "submit.dispatched": 21}


def test_balance_ratio_falls_back_to_all_ranks_and_unknown_states_are_shown(
    endpoints: HttpEndpoints,
) -> None:
    endpoints.update(make_snapshot(
        ranks=[RankView(0, "handshaking", waiting=1), RankView(1, "rebooting", running=3)],
        watchdog=[{"kind": "custom"}], wake_latencies_s=[], lockstep=False, running=False,
        all_ready=True,
    ))
    _, s = scrape(endpoints)
    assert value(s, "dp_coordinator_balance_ratio") == pytest.approx(2 / 3)
    assert value(s, "dp_coordinator_rank_state", rank="1", state="rebooting") == 1
    assert value(s, "dp_coordinator_rank_state", rank="0", state="rebooting") == 0
    assert value(s, "dp_coordinator_watchdog_alert", kind="custom") == 1
    assert value(s, "dp_coordinator_wake_latency_seconds_count") == 0
    assert value(s, "dp_coordinator_lockstep") == 0
    assert value(s, "dp_coordinator_wave_running") == 0
    assert value(s, "dp_coordinator_all_ranks_ready") == 1


def test_labelled_counters_show_zero_on_a_healthy_coordinator(
    endpoints: HttpEndpoints,
) -> None:
    """Nothing counted yet: the label values every coordinator can count are there at 0
    (a panel shows 0, not "No data"), and a count replaces its zero."""
    endpoints.update(make_snapshot(counters={}))
    _, s = scrape(endpoints)
    for name, labels in [
        ("dp_coordinator_refused_total", {"socket": "handshake", "reason": "rank_held"}),
        ("dp_coordinator_dropped_frames_total", {"socket": "frontend", "reason": "decode"}),
        ("dp_coordinator_send_dropped_total", {"socket": "dispatch", "reason": "unreachable"}),
        ("dp_coordinator_handshakes_total", {"step": "hello", "outcome": "accepted"}),
        ("dp_coordinator_handshakes_total", {"step": "any", "outcome": "refused"}),
    ]:
        assert value(s, name, **labels) == 0, (name, labels)
    assert all(v == 0 for v in s["dp_coordinator_refused_total"].values())
    endpoints.update(make_snapshot(counters={"refused.handshake.rank_held": 2}))
    _, s = scrape(endpoints)
    assert value(s, "dp_coordinator_refused_total", socket="handshake",
                 reason="rank_held") == 2
    assert value(s, "dp_coordinator_handshakes_total", step="any", outcome="refused") == 2


def test_openmetrics_is_served_when_asked(endpoints: HttpEndpoints) -> None:
    endpoints.update(make_snapshot())
    status, body, headers = get(endpoints.url + "/metrics",
                                headers={"Accept": "application/openmetrics-text"})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_scrapes_while_the_loop_publishes_always_see_whole_snapshots(
    endpoints: HttpEndpoints,
) -> None:
    stop = threading.Event()

    def loop() -> None:
        wave = 0
        while not stop.is_set():
            wave += 1
            endpoints.update(make_snapshot(
                wave=wave, ranks=[RankView(r, "ready", waiting=wave, running=wave)
                                  for r in range(8)], wake_latencies_s=[]))

    publisher = threading.Thread(target=loop, daemon=True)
    publisher.start()
    try:
        for _ in range(20):
            _, s = scrape(endpoints)
            wave = value(s, "dp_coordinator_wave")
            # every rank row comes from the same snapshot as the wave
            assert set(s["dp_coordinator_rank_waiting"].values()) == {wave}
            assert value(s, "dp_coordinator_balance_ratio") == 1.0
    finally:
        stop.set()
        publisher.join(5)


# --- /healthz, /readyz -------------------------------------------------------------------------


def test_healthz_flips_to_503_when_snapshots_stop() -> None:
    with HttpEndpoints("127.0.0.1", 0, stale_after_s=0.3) as http:
        status, body = get_json(http.url + "/healthz")
        assert status == 503
        assert "has not published" in str(body["reason"])
        http.update(make_snapshot())
        status, body = get_json(http.url + "/healthz")
        assert (status, body["status"]) == (200, "ok")
        time.sleep(0.5)
        status, body = get_json(http.url + "/healthz")
        assert status == 503
        assert "blocked or stopped" in str(body["reason"])
        assert float(str(body["snapshot_age_s"])) >= 0.3
        http.update(make_snapshot())
        assert get_json(http.url + "/healthz")[0] == 200


def test_healthz_uses_the_injected_clock() -> None:
    now = [100.0]
    with HttpEndpoints("127.0.0.1", 0, clock=lambda: now[0]) as http:
        http.update(make_snapshot(taken_at=99.0))
        assert get_json(http.url + "/healthz") == (200, {"status": "ok", "snapshot_age_s": 1.0})
        now[0] = 101.5
        assert get_json(http.url + "/healthz")[0] == 503
        # readiness needs a live loop too
        http.update(make_snapshot(taken_at=90.0, readiness=Readiness(True, "all ranks")))
        assert get_json(http.url + "/readyz")[0] == 503


def test_readyz_says_what_the_cores_rule_says(endpoints: HttpEndpoints) -> None:
    status, body = get_json(endpoints.url + "/readyz")
    assert status == 503  # no snapshot yet
    endpoints.update(make_snapshot(readiness=Readiness(
        True, "2 of 3 ranks take requests (1 cordoned)", {2: "cordoned"})))
    assert get_json(endpoints.url + "/readyz") == (200, {
        "status": "ready", "ranks": 3, "reason": "2 of 3 ranks take requests (1 cordoned)",
        "ranks_out": {"2": "cordoned"}})
    endpoints.update(make_snapshot(readiness=Readiness(
        False, "no rank can take requests (3 dead)", {0: "dead", 1: "dead", 2: "dead"})))
    status, body = get_json(endpoints.url + "/readyz")
    assert status == 503
    assert body == {"status": "not_ready", "reason": "no rank can take requests (3 dead)",
                    "ranks_out": {"0": "dead", "1": "dead", "2": "dead"}}


# --- /state, /debug/waves ----------------------------------------------------------------------


def test_state(endpoints: HttpEndpoints) -> None:
    assert get_json(endpoints.url + "/state")[0] == 503
    endpoints.update(make_snapshot(state_json={"rank_count": 3, "wave": "overridden"}))
    status, body = get_json(endpoints.url + "/state")
    assert status == 200
    assert body["rank_count"] == 3
    assert body["wave"] == 3  # the snapshot's own fields win over state_json
    assert body["running"] is True
    assert body["waves_total"] == 9
    assert body["counters"] == COUNTERS
    ranks = body["ranks"]
    assert isinstance(ranks, list)
    assert ranks[0] == {"rank": 0, "state": "ready", "waiting": 2, "running": 4,
                        "kv_cache_usage": 0.25, "dispatched": 12, "report_age_s": 0.1,
                        "in_flight": 5}
    assert ranks[2]["report_age_s"] is None
    [alert] = body["watchdog"]  # type: ignore[misc]
    assert alert["kind"] == "no_progress"
    assert alert["ranks"] == [0, 1, 2]


def test_debug_waves(endpoints: HttpEndpoints) -> None:
    assert get_json(endpoints.url + "/debug/waves")[0] == 503
    endpoints.update(make_snapshot())
    status, body = get_json(endpoints.url + "/debug/waves")
    assert status == 200
    assert body["count"] == 3
    events = body["events"]
    assert isinstance(events, list)
    assert [e["seq"] for e in events] == [1, 2, 3]
    assert events[1]["cause"] == "start_wave(0) from rank 1"
    assert events[1]["detail"] == {"exclude": 1}
    assert 0.9 <= events[1]["age_s"] < 5
    _, last_two = get_json(endpoints.url + "/debug/waves?n=2")
    assert [e["seq"] for e in last_two["events"]] == [2, 3]  # type: ignore[union-attr]
    assert get_json(endpoints.url + "/debug/waves?n=0")[1] == {"count": 0, "events": []}
    assert get_json(endpoints.url + "/debug/waves?n=-1")[0] == 400
    endpoints.update(make_snapshot(recorder_tail=[{"seq": 1, "at": None}]))
    assert get_json(endpoints.url + "/debug/waves")[1]["events"] == [{"seq": 1, "at": None}]


def test_debug_waves_gives_each_event_its_time_of_day() -> None:
    """`at` is monotonic, which means nothing to an operator reading logs beside it."""
    with HttpEndpoints("127.0.0.1", 0, clock=lambda: 1000.0,
                       wall_clock=lambda: 1_767_225_600.0) as http:  # 2026-01-01T00:00:00Z
        tail = [{"seq": 1, "at": 997.5}, {"seq": 2, "at": 1000.0}]
        http.update(make_snapshot(taken_at=1000.0, recorder_tail=tail))
        events = get_json(http.url + "/debug/waves")[1]["events"]
    assert [e["time"] for e in events] == [  # type: ignore[union-attr]
        "2025-12-31T23:59:57.500+00:00", "2026-01-01T00:00:00.000+00:00"]


# --- HTTP details ------------------------------------------------------------------------------


def test_index_unknown_paths_methods_and_head(endpoints: HttpEndpoints) -> None:
    status, body = get_json(endpoints.url + "/")
    assert status == 200
    assert "/metrics" in body["endpoints"]  # type: ignore[operator]
    status, raw, _ = get(endpoints.url + "/nope")
    assert status == 404
    assert json.loads(raw)["error"] == "no such endpoint: /nope"
    status, raw, headers = get(endpoints.url + "/healthz", method="POST")
    assert status == 405
    assert headers["Allow"] == "GET, HEAD"
    endpoints.update(make_snapshot())
    status, raw, headers = get(endpoints.url + "/healthz/", method="HEAD")
    assert status == 200
    assert raw == b""
    assert int(headers["Content-Length"]) > 0


def test_start_stop_are_idempotent_and_report_the_bound_port() -> None:
    http = HttpEndpoints("127.0.0.1", 0)
    port = http.start()
    assert port > 0
    assert http.start() == port
    assert http.url == f"http://127.0.0.1:{port}"
    http.stop()
    http.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_a_busy_port_is_reported_with_the_address() -> None:
    with HttpEndpoints("127.0.0.1", 0) as first:
        taken = HttpEndpoints("127.0.0.1", first.port)
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{first.port}"):
            taken.start()


def test_ipv6_loopback() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with HttpEndpoints("::1", 0) as http:
        assert http.url.startswith("http://[::1]:")
        http.update(make_snapshot())
        assert get_json(http.url + "/healthz")[0] == 200


def test_observability_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_observability_arguments(parser)
    args = parser.parse_args([])
    assert (args.metrics_port, args.metrics_host, args.watchdog_stall_s, args.watchdog_rewake,
            args.recorder_size) == (None, "127.0.0.1", 30.0, True, 1000)
    args = parser.parse_args(["--metrics-port", "0", "--metrics-host", "::1",
                              "--watchdog-stall-s", "5", "--no-watchdog-rewake",
                              "--recorder-size", "50"])
    assert (args.metrics_port, args.metrics_host, args.watchdog_stall_s, args.watchdog_rewake,
            args.recorder_size) == (0, "::1", 5.0, False, 50)
