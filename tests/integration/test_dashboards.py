"""The Grafana dashboard and the Prometheus alert rules name only what the process exports.

A real coordinator (tcp, metrics on) serves simulated engines, a frontend
submits a few requests (a wake, dispatches), and a bad engine identity and a
garbage frame plant a refusal and a drop. Its `/metrics` is scraped, and every
query of `deploy/grafana/dp-coordinator.json` (panels, template variables,
annotations) and every expression of `deploy/prometheus/rules/alerts.yml` is taken
apart enough to pull out the metric names and label names it uses; each must
be a series of a family in that scrape (or Prometheus' own `up`), and each
label one those series carry (or a label Prometheus adds at scrape time).

Where `promtool` is installed (Debian's `prometheus` package), it also checks
the rule files, runs the alert unit tests in `deploy/prometheus/tests/`
and parses every dashboard query; those tests are skipped without it.
"""

from __future__ import annotations

import asyncio
import glob
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families

from coordinator.frontend import FrontendClient
from coordinator.sim import SimConfig, SimEngineGroup, SimRequest, encode_sim_request
from tests.conftest import CoordinatorFactory

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dp-coordinator.json"
PROMETHEUS = REPO / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "rules" / "alerts.yml"
ALERT_TESTS = PROMETHEUS / "tests" / "alerts_test.yml"
PROMETHEUS_CONFIG = PROMETHEUS / "config" / "prometheus.yml"

STEP = 5.0
# Labels Prometheus attaches to every scraped series, and its per-target series.
TARGET_LABELS = frozenset({"instance", "job"})
PROMETHEUS_SERIES = {"up": frozenset()}


# ---- taking PromQL apart ---------------------------------------------------------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", re.IGNORECASE
)
_RANGE = re.compile(r"\[[^\[\]]*\]")
_IDENTIFIER = re.compile(r"(?<![A-Za-z0-9_:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan", "atan2", "start", "end",
})
_GRAFANA_INTERVAL = re.compile(r"\$__(?:rate_interval|interval|range)\b|\$\{__[a-z_]+\}")
_GRAFANA_VARIABLE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")


@dataclass
class Uses:
    """Metric names and label names one expression uses."""

    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)


def promql_uses(expr: str) -> Uses:
    """The metric and label names in a PromQL expression (Grafana variables allowed)."""
    uses = Uses()
    label_values = _LABEL_VALUES.match(expr)
    if label_values:  # Grafana's `label_values(selector, label)`
        inner, label = label_values.groups()
        uses.labels.add(label)
        if inner:
            more = promql_uses(inner)
            uses.metrics |= more.metrics
            uses.labels |= more.labels
        return uses
    text = _GRAFANA_INTERVAL.sub("5m", expr)
    text = _STRING.sub('""', text)
    text = _GRAFANA_VARIABLE.sub("0", text)  # only left outside strings in numbers
    for block in _MATCHERS.findall(text):
        uses.labels.update(_MATCHER_LABEL.findall(block))
    text = _MATCHERS.sub(" ", text)
    for group in _GROUPING.findall(text):
        uses.labels.update(name.strip() for name in group.split(",") if name.strip())
    text = _GROUPING.sub(" ", text)
    text = _RANGE.sub(" ", text)
    for name, call in _IDENTIFIER.findall(text):
        if call or name.lower() in _KEYWORDS:
            continue
        uses.metrics.add(name)
    uses.labels.discard("__name__")
    return uses


def test_promql_uses_reads_what_an_expression_names() -> None:
    """The extractor itself: selectors, grouping, ranges, strings, functions, variables."""
    uses = promql_uses(
        'histogram_quantile(0.99, sum by (le, instance) (rate(foo_bucket{job="a", x=~"b{c}"}'
        '[$__rate_interval]))) > on (instance) group_left (rank) bar_total offset 5m '
        'and ignoring(kind) baz:rate5m unless count without (q) (qux{ y !="and"}) * 2e3'
    )
    assert uses.metrics == {"foo_bucket", "bar_total", "baz:rate5m", "qux"}
    assert uses.labels == {"le", "instance", "job", "x", "rank", "kind", "q", "y"}
    assert promql_uses("label_values(dp_coordinator_wave{job=\"j\"}, instance)").metrics == {
        "dp_coordinator_wave"}
    assert promql_uses("label_values(instance)").labels == {"instance"}
    assert promql_uses('up{job="dp-coordinator"} == 0').metrics == {"up"}


# ---- what the dashboard and the rules use ------------------------------------------------------


def dashboard_expressions() -> Iterator[tuple[str, str, str | None]]:
    """(where, expression, legendFormat) for every query in the dashboard."""
    board = json.loads(DASHBOARD.read_text())

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    for panel in panels(board["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"], target.get("legendFormat")
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield (f"variable {variable['name']}",
                   query["query"] if isinstance(query, dict) else query, None)
    for annotation in board["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation["expr"], None


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_the_files_parse_and_have_what_operators_look_for() -> None:
    board = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in board["panels"]}
    for wanted in ("Wave number and running", "Waiting by rank", "Rank state",
                   "First-request wake latency", "Balance ratio", "Peers refused",
                   "Bad input dropped", "Sends dropped", "Lease expiries", "Watchdog"):
        assert wanted in titles
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    names = {rule["alert"] for rule in alert_rules()}
    assert {"DPCoordinatorWatchdogNoProgress", "DPCoordinatorWatchdogWaveSplit",
            "DPCoordinatorRankDead", "DPCoordinatorWaveStuckPaused",
            "DPCoordinatorWaveStuckRunning"} <= names
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["../rules/*.yml"]
    assert [job["job_name"] for job in config["scrape_configs"]] == ["dp-coordinator"]
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    tested = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"]
              if case["exp_alerts"]}
    assert tested == names  # every alert has a case where it fires


_OUTER_AGGREGATION = re.compile(
    r"\s*(?:[\d.]+\s*\*\s*)?(?:histogram_quantile\(\s*[\d.]+\s*,\s*)?"
    r"(?:sum|max|min|count|avg)\s*(?:by\s*\(([^)]*)\))?\s*\(")


def result_keeps(expr: str, label: str) -> bool:
    """Whether the series an expression returns still carry `label`: yes without an
    outer aggregation, else only when the aggregation groups by it."""
    match = _OUTER_AGGREGATION.match(expr)
    if match is None:
        return True
    return label in {name.strip() for name in (match.group(1) or "").split(",")}


def legend_collisions(queries: Iterator[tuple[str, str, str | None]]) -> list[str]:
    """Queries whose legend would be the same for two coordinators: results that keep
    `instance` but a legend that does not name it, and ranks grouped without it (rank
    numbers are per coordinator)."""
    problems = []
    for where, expr, legend in queries:
        if not legend:
            continue  # a table or a state timeline: Grafana shows every label
        if result_keeps(expr, "instance") and "{{instance}}" not in legend:
            problems.append(f"{where}: {legend!r} for {expr}")
        elif result_keeps(expr, "rank") and not result_keeps(expr, "instance"):
            problems.append(f"{where}: ranks of every coordinator summed in {expr}")
    return problems


def test_no_two_coordinators_share_a_legend() -> None:
    assert legend_collisions(dashboard_expressions()) == []


def test_a_colliding_legend_is_caught() -> None:
    assert legend_collisions(iter([
        ("a", 'dp_coordinator_rank_waiting{instance=~"$instance"}', "rank {{rank}}"),
        ("b", "sum by (rank) (dp_coordinator_rank_in_flight)", "rank {{rank}}"),
        ("c", "count by (instance) (dp_coordinator_rank_state)", "ranks"),
        ("d", "sum by (socket) (rate(dp_coordinator_refused_total[5m]))", "{{socket}}"),
        ("e", "histogram_quantile(0.5, sum by (le) (rate(x_bucket[5m])))", "p50"),
    ])) == [
        "a: 'rank {{rank}}' for dp_coordinator_rank_waiting{instance=~\"$instance\"}",
        "b: ranks of every coordinator summed in sum by (rank) (dp_coordinator_rank_in_flight)",
        "c: 'ranks' for count by (instance) (dp_coordinator_rank_state)",
    ]


# ---- a real coordinator's scrape ---------------------------------------------------------------


@dataclass
class Scrape:
    """Series names and their label names, from one /metrics answer."""

    series: dict[str, set[str]] = field(default_factory=dict)
    """Every series name the families declare (type-aware), with the labels seen on it."""
    sampled: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        out = cls()
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                    "_created"), "summary": ("", "_sum", "_count", "_created"),
                    "gauge": ("",), "info": ("_info",), "stateset": ("",), "unknown": ("",)}
        for family in text_string_to_metric_families(text):
            for suffix in suffixes.get(family.type, ("",)):
                out.series.setdefault(family.name + suffix, set())
            for sample in family.samples:
                out.series.setdefault(sample.name, set()).update(sample.labels)
                out.sampled.add(sample.name)
        return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=STEP) as response:
            return int(response.status), bytes(response.read())
    except OSError:
        return 0, b""


async def eventually(check: Any, what: str, timeout: float = 3 * STEP) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.05)


def plant_a_refusal_and_a_drop(addresses: dict[str, str]) -> None:
    """A HELLO from a one-byte identity (refused) and garbage on back_output (dropped)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.IDENTITY, b"\x07")
        bad.setsockopt(zmq.LINGER, 1000)
        bad.connect(addresses["handshake"])
        bad.send(b"\x81\xa4type\xa5HELLO")
        assert bad.poll(int(STEP * 1000)), "no answer to a bad identity"
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(addresses["back_output"])
        push.send(b"\xc1 not msgpack")
    finally:
        ctx.destroy(linger=1000)


@pytest.fixture
def scrape_of_a_serving_coordinator(coordinator: CoordinatorFactory) -> Scrape:
    port = free_port()
    handle = coordinator(2, transport="tcp", frontends=1,
                         extra_args=["--metrics-port", str(port)])
    base = f"http://127.0.0.1:{port}"

    async def run() -> Scrape:
        client = FrontendClient(handle.addresses, client_index=0, host="127.0.0.1",
                                call_timeout_s=STEP)
        config = SimConfig(step_time_s=0.002, dp_sync_interval=4, heartbeat_interval_s=0.5,
                           handshake_timeout_s=STEP, ready_timeout_s=2 * STEP,
                           accept_timeout_s=STEP)
        group = SimEngineGroup(handle.addresses["handshake"], 2, config=config)
        try:
            await asyncio.wait_for(client.register(), STEP)
            await asyncio.wait_for(group.start(), 3 * STEP)
            for i in range(4):
                request = SimRequest(f"r-{i}", 0, client.wave, 20, time.monotonic_ns())
                await client.submit(f"r-{i}", [encode_sim_request(request)])
            plant_a_refusal_and_a_drop(handle.addresses)

            async def everything_seen() -> bool:
                status, body = await asyncio.to_thread(get, base + "/metrics")
                if status != 200:
                    return False
                scrape = Scrape.parse(body.decode())
                # The labelled counters carry zero series from the start: wait for counts.
                counted = all(re.search(rb"^%s\{[^}]*\} [1-9]" % name.encode(), body, re.M)
                              for name in ("dp_coordinator_refused_total",
                                           "dp_coordinator_dropped_frames_total",
                                           "dp_coordinator_handshakes_total"))
                return counted and {"dp_coordinator_rank_waiting",
                                    "dp_coordinator_rank_report_age_seconds"} <= scrape.sampled \
                    and b'dp_coordinator_wake_latency_seconds_count 0.0' not in body

            await eventually(everything_seen, "a refusal, a drop, ranks and a wake in /metrics")
            status, body = await asyncio.to_thread(get, base + "/metrics")
            assert status == 200
            return Scrape.parse(body.decode())
        finally:
            await asyncio.wait_for(group.stop(), 2 * STEP)
            await asyncio.wait_for(client.close(), STEP)

    return asyncio.run(run())


# Families a healthy run leaves without samples: their label names cannot be read
# from the scrape (their names still can, from the family's TYPE line).
NO_SAMPLES_IN_A_HEALTHY_RUN = frozenset({"dp_coordinator_send_dropped_total"})


def check_uses(where: str, uses: Uses, scrape: Scrape, extra_labels: set[str]) -> list[str]:
    problems = []
    labels: set[str] = set(TARGET_LABELS)
    labels_known = True
    for name in sorted(uses.metrics):
        if name in PROMETHEUS_SERIES:
            labels |= PROMETHEUS_SERIES[name]
        elif name not in scrape.series:
            problems.append(f"{where}: {name} is not exported")
        elif name not in scrape.sampled:
            labels_known = False
            if name not in NO_SAMPLES_IN_A_HEALTHY_RUN:
                problems.append(f"{where}: {name} has no samples to read its labels from")
        else:
            labels |= scrape.series[name]
    if not uses.metrics:
        problems.append(f"{where}: names no metric")
    if labels_known:
        for label in sorted((uses.labels | extra_labels) - labels):
            problems.append(f"{where}: label {label!r} is on none of {sorted(uses.metrics)}")
    return problems


def test_every_query_and_alert_names_exported_series(
    scrape_of_a_serving_coordinator: Scrape,
) -> None:
    scrape = scrape_of_a_serving_coordinator
    # What the brief of the dashboard needs is really there, with samples.
    for name in ("dp_coordinator_wave", "dp_coordinator_wave_running",
                 "dp_coordinator_rank_waiting", "dp_coordinator_rank_state",
                 "dp_coordinator_dispatches_total", "dp_coordinator_wake_latency_seconds_bucket",
                 "dp_coordinator_balance_ratio", "dp_coordinator_lease_expiries_total",
                 "dp_coordinator_watchdog_alert", "dp_coordinator_refused_total",
                 "dp_coordinator_dropped_frames_total"):
        assert name in scrape.sampled, name
    assert {"rank", "state"} <= scrape.series["dp_coordinator_rank_state"]
    assert {"socket", "reason"} <= scrape.series["dp_coordinator_refused_total"]

    problems: list[str] = []
    queries = 0
    for where, expr, legend in dashboard_expressions():
        queries += 1
        legend_labels = set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend or ""))
        problems += check_uses(where, promql_uses(expr), scrape, legend_labels)
    rules = alert_rules()
    for rule in rules:
        template_labels = set(re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)",
                                         json.dumps(rule["annotations"])))
        problems += check_uses(f"alert {rule['alert']}", promql_uses(rule["expr"]), scrape,
                               template_labels)
    assert queries >= 30 and len(rules) >= 10
    assert problems == []


def test_a_misspelt_name_or_label_is_caught(scrape_of_a_serving_coordinator: Scrape) -> None:
    """The check above can fail: a wrong name, a wrong label, a wrong legend label."""
    scrape = scrape_of_a_serving_coordinator
    assert check_uses("q", promql_uses("rate(dp_coordinator_dispatches[5m])"), scrape, set())
    assert check_uses("q", promql_uses('dp_coordinator_wave{rank="0"}'), scrape, set())
    assert check_uses("q", promql_uses("dp_coordinator_rank_waiting"), scrape, {"socket"})
    assert not check_uses("q", promql_uses('sum by (rank) (dp_coordinator_rank_waiting'
                                           '{instance=~"$instance"})'), scrape, {"rank"})


# ---- promtool, where it is installed ----------------------------------------------------------


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_each_prometheus_folder_holds_one_kind_of_file() -> None:
    """rules/ only rule files, tests/ only rule tests, config/ only the configuration, so
    the documented globs (`promtool check rules deploy/prometheus/rules/*.yml`) work."""
    kinds = {"rules": {"groups"}, "tests": {"rule_files", "tests", "evaluation_interval"},
             "config": {"global", "rule_files", "scrape_configs"}}
    assert sorted(p.name for p in PROMETHEUS.iterdir()) == sorted(kinds)
    for folder, keys in kinds.items():
        files = sorted((PROMETHEUS / folder).iterdir())
        assert files and all(f.suffix == ".yml" for f in files), files
        for path in files:
            assert set(yaml.safe_load(path.read_text())) <= keys, path
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for pattern in config["rule_files"]:  # relative to the configuration file
        found = glob.glob(str(PROMETHEUS_CONFIG.parent / pattern))
        assert [Path(p).resolve() for p in found] == [ALERTS.resolve()], pattern


@needs_promtool
def test_promtool_accepts_the_rules_and_the_config() -> None:
    rule_files = [str(p) for p in sorted((PROMETHEUS / "rules").glob("*.yml"))]
    checked = promtool("check", "rules", *rule_files)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_promtool_runs_the_alert_unit_tests() -> None:
    tests = [str(p) for p in sorted((PROMETHEUS / "tests").glob("*.yml"))]
    result = promtool("test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query, Grafana's variables filled in, as a recording rule promtool must parse."""
    rules = []
    for index, (_, expr, _) in enumerate(dashboard_expressions()):
        if _LABEL_VALUES.match(expr):
            continue  # Grafana's own function, not PromQL
        text = _GRAFANA_INTERVAL.sub("5m", expr).replace("$instance", ".+")
        rules.append({"record": f"dashboard:query_{index}", "expr": text})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
