"""Observability and security through the real coordinator process.

Every test starts `python -m coordinator serve` (through the `coordinator`
fixture, which always shuts it down) and talks to it only from outside: HTTP on
its metrics port, ZeroMQ on its sockets, signals, and the command line.

* metrics and endpoints, scraped over HTTP while simulated engines serve load;
* the hang watchdog: quiet through a healthy run, then firing on a planted hang
  (a frozen engine, or one that ignores START_DP_WAVE), logging the flight
  recorder, re-waking, and clearing once the group moves again;
* CURVE: keys made by `dp-coordinator keygen`, listed clients served on every
  socket, unlisted and plain clients answered with silence and counted;
* the refusal to bind a non-loopback address without keys;
* SIGUSR1 dumping the flight recorder to the log;
* `dp-coordinator top --once` against the live process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import stat
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from coordinator.engine import AddRequest, EngineAgent, EngineHandshakeFailed
from coordinator.frontend import FrontendClient
from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol import frontend as fp
from coordinator.sim import SimConfig, SimEngineGroup, SimRequest, encode_sim_request
from tests.conftest import CoordinatorFactory

pytestmark = pytest.mark.timeout(90)

STEP = 5.0  # bound on any single wait that should take milliseconds
STALL_S = 1.5  # --watchdog-stall-s for the watchdog tests
ALERT_WITHIN_S = STALL_S + 3.0  # stall time, plus checks every 250 ms, plus slack
CLI = (sys.executable, "-m", "coordinator")


# ---- HTTP ---------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=STEP) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), bytes(exc.read())


class Http:
    """The coordinator's HTTP endpoints; requests run off the event loop."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    async def get(self, path: str) -> tuple[int, bytes]:
        return await asyncio.to_thread(_get, self.base + path)

    async def json(self, path: str) -> tuple[int, Any]:
        status, body = await self.get(path)
        return status, json.loads(body)

    async def state(self) -> dict[str, Any]:
        status, body = await self.json("/state")
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    async def wait_healthy(self) -> None:
        """Until the loop has published its first snapshot (it does so every 250 ms)."""

        async def healthy() -> bool:
            return (await self.get("/healthz"))[0] == 200

        await eventually(healthy, f"{self.base}/healthz answers 200")

    async def metrics(self) -> Metrics:
        status, body = await self.get("/metrics")
        assert status == 200, body[:500]
        return Metrics.parse(body.decode())


@dataclass
class Metrics:
    """Samples of one scrape, by sample name (`..._total`, `..._bucket`, ...)."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        out = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.samples.setdefault(sample.name, []).append(sample)
        return out

    def all(self, name: str, **labels: str) -> list[Sample]:
        return [s for s in self.samples.get(name, [])
                if all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        found = self.all(name, **labels)
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples: {found}"
        return float(found[0].value)

    def value_or(self, name: str, default: float, **labels: str) -> float:
        found = self.all(name, **labels)
        return float(found[0].value) if found else default

    def by_rank(self, name: str, **labels: str) -> dict[int, float]:
        return {int(s.labels["rank"]): float(s.value) for s in self.all(name, **labels)}


# ---- waiting ------------------------------------------------------------------------------------


async def eventually(check: Callable[[], Awaitable[bool]], what: str,
                     timeout: float = STEP, interval: float = 0.05) -> float:
    """Poll `check` until it holds; return how long that took, fail after `timeout`."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - start


async def run_cli(*args: str, timeout: float = 20.0,
                  env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `python -m coordinator ARGS`; (exit code, stdout, stderr)."""
    return await run_process([*CLI, *args], timeout=timeout, env=env)


async def run_process(argv: Sequence[str], *, timeout: float = 20.0,
                      env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{' '.join(argv)} did not finish within {timeout:g} s") from None
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


# ---- engines and load -----------------------------------------------------------------------


def sim_config(**overrides: Any) -> SimConfig:
    options: dict[str, Any] = {
        "step_time_s": 0.002,
        "dp_sync_interval": 4,
        # A planted hang must stay a hang (no engine death) for as long as a test looks.
        "collective_timeout_s": 30.0,
        "on_hang": "wait",
        "heartbeat_interval_s": 0.5,
        "handshake_timeout_s": STEP,
        "ready_timeout_s": 2 * STEP,
        "accept_timeout_s": STEP,
    }
    options.update(overrides)
    return SimConfig(**options)


def sim_payload(client: FrontendClient, request_id: str, steps: int) -> list[bytes]:
    request = SimRequest(request_id, client.client_index, client.wave, steps, time.monotonic_ns())
    return [encode_sim_request(request)]


class Load:
    """Submits simulated requests through a FrontendClient and follows their completion."""

    def __init__(self, client: FrontendClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.submitted: set[str] = set()
        self.finished: set[str] = set()
        self._ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def on_finished(self, request_id: str) -> None:
        self.finished.add(request_id)

    async def submit(self, steps: int, *, dp_rank: int | None = None) -> str:
        request_id = f"{self.prefix}-{next(self._ids)}"
        await self.client.submit(request_id, sim_payload(self.client, request_id, steps),
                                 dp_rank=dp_rank)
        self.submitted.add(request_id)
        return request_id

    async def burst(self, count: int, steps: Callable[[int], int]) -> None:
        for i in range(count):
            await self.submit(steps(i))

    def start_stream(self, interval_s: float, steps: Callable[[int], int],
                     dp_ranks: Sequence[int] | None = None) -> None:
        """Submit a request every `interval_s` until `stop_stream` (to `dp_ranks` in turn,
        or wherever the coordinator sends it)."""

        async def stream() -> None:
            for i in itertools.count():
                rank = None if dp_ranks is None else dp_ranks[i % len(dp_ranks)]
                await self.submit(steps(i), dp_rank=rank)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), interval_s)
                if self._stop.is_set():
                    return

        self._stop.clear()
        self._task = asyncio.ensure_future(stream())

    async def stop_stream(self) -> None:
        """Stop after the submit in progress (a flag, not cancel: on Python 3.10/3.11
        `wait_for` drops a cancellation that races with its result)."""
        task, self._task = self._task, None
        if task is not None:
            self._stop.set()
            await asyncio.wait_for(task, 2 * STEP)

    async def all_finished(self, timeout: float = STEP) -> None:
        async def done() -> bool:
            return self.submitted <= self.finished

        await eventually(done, f"{len(self.submitted - self.finished)} of "
                         f"{len(self.submitted)} {self.prefix} requests finished", timeout)


@dataclass
class Group:
    """A registered frontend and a running group of simulated engines."""

    client: FrontendClient
    engines: SimEngineGroup
    load: Load


@contextlib.asynccontextmanager
async def sim_group(handle: CoordinatorHandle, engines: int, *, prefix: str = "r",
                    **config: Any) -> AsyncIterator[Group]:
    """One frontend (registered first: INIT waits for it) and `engines` simulated ranks."""
    loads: list[Load] = []
    client = FrontendClient(
        handle.addresses, client_index=0, host="127.0.0.1", call_timeout_s=STEP,
        on_finished=lambda done: loads[0].on_finished(done.request_id),
    )
    loads.append(Load(client, prefix))
    group = SimEngineGroup(handle.addresses["handshake"], engines, config=sim_config(**config))
    try:
        await client.register()
        await asyncio.wait_for(group.start(), 3 * STEP)
        yield Group(client, group, loads[0])
    finally:
        await loads[0].stop_stream()
        await asyncio.wait_for(group.stop(), 2 * STEP)
        await asyncio.wait_for(client.close(), STEP)


@contextlib.asynccontextmanager
async def agents(handle: CoordinatorHandle, ranks: Sequence[int],
                 **options: Any) -> AsyncIterator[list[EngineAgent]]:
    """Bare EngineAgents for `ranks`, started together (the READY gate needs them all)."""
    started = [EngineAgent(handle.addresses["handshake"], rank, heartbeat_interval_s=0.5,
                           handshake_timeout_s=STEP, ready_timeout_s=2 * STEP,
                           accept_timeout_s=STEP, **options)
               for rank in ranks]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in started)), 3 * STEP)
        yield started
    finally:
        for agent in started:
            await asyncio.wait_for(agent.close(linger_s=0.0), STEP)


def metrics_args(port: int, *extra: str) -> list[str]:
    return ["--metrics-port", str(port), *extra]


# ---- (a) metrics and endpoints during a sim run ---------------------------------------------


async def test_metrics_and_endpoints_follow_a_sim_run(coordinator: CoordinatorFactory) -> None:
    port = free_port()
    handle = coordinator(3, transport="tcp", frontends=1, extra_args=metrics_args(port))
    http = Http(port)
    await http.wait_healthy()
    status, body = await http.json("/readyz")
    assert status == 503, body
    assert body["status"] == "not_ready"
    assert body["ranks_out"] == {"0": "absent", "1": "absent", "2": "absent"}

    async with sim_group(handle, 3, prefix="burst") as group:

        async def ready() -> bool:
            return (await http.get("/readyz"))[0] == 200

        await eventually(ready, "/readyz answers 200 once a rank is ready")

        async def all_ready() -> bool:
            return (await http.metrics()).value("dp_coordinator_all_ranks_ready") == 1.0

        # /readyz says the group serves (one rank suffices); all three join soon after.
        await eventually(all_ready, "every rank ready")
        before = await http.metrics()
        wave_before = before.value("dp_coordinator_wave")
        waves_before = before.value("dp_coordinator_waves_total")

        # Three bursts, each into a paused group: three coordinator wakes, three waves.
        bursts, per_burst = 3, 20
        for _ in range(bursts):
            await group.client.wait_for(lambda c: not c.running, timeout=STEP)
            await group.load.burst(per_burst, lambda i: 3 + i % 7)
            await group.load.all_finished()
        await group.client.wait_for(lambda c: not c.running, timeout=STEP)
        submits = bursts * per_burst

        async def settled() -> bool:
            # The frontend reports finished ids in batches; snapshots follow every 250 ms.
            scrape = await http.metrics()
            return (sum(scrape.by_rank("dp_coordinator_dispatches_total").values()) == submits
                    and set(scrape.by_rank("dp_coordinator_rank_in_flight").values()) == {0})

        await eventually(settled, f"{submits} dispatches counted and none in flight")
        after = await http.metrics()

        # Per-rank gauges, for every rank.
        for name in ("dp_coordinator_rank_waiting", "dp_coordinator_rank_running",
                     "dp_coordinator_rank_kv_cache_usage", "dp_coordinator_rank_in_flight",
                     "dp_coordinator_rank_report_age_seconds"):
            assert sorted(after.by_rank(name)) == [0, 1, 2], name
        assert after.by_rank("dp_coordinator_rank_state", state="ready") == {0: 1, 1: 1, 2: 1}
        assert after.by_rank("dp_coordinator_rank_state", state="dead") == {0: 0, 1: 0, 2: 0}
        assert after.by_rank("dp_coordinator_rank_in_flight") == {0: 0, 1: 0, 2: 0}
        for age in after.by_rank("dp_coordinator_rank_report_age_seconds").values():
            assert 0.0 <= age < 30.0

        # Waves moved, one per burst at least.
        assert after.value("dp_coordinator_wave") >= wave_before + bursts
        assert after.value("dp_coordinator_waves_total") >= waves_before + bursts
        assert after.value("dp_coordinator_wave_running") == 0.0
        assert after.value("dp_coordinator_running_seconds_total") > 0.0
        assert after.value("dp_coordinator_start_dp_wave_broadcasts_total") >= bursts

        # Every submit dispatched once; least-loaded spread them over every rank.
        dispatched = after.by_rank("dp_coordinator_dispatches_total")
        assert sum(dispatched.values()) == submits
        assert all(n > 0 for n in dispatched.values()), dispatched
        assert after.value("dp_coordinator_events_total", event="submit.dispatched") == submits

        # Each burst's first submit woke the paused group and an engine answered.
        count = after.value("dp_coordinator_wake_latency_seconds_count")
        assert count >= 1
        assert after.value("dp_coordinator_wake_latency_seconds_bucket", le="+Inf") == count
        assert 0.0 < after.value("dp_coordinator_wake_latency_seconds_sum") < count * 5.0

        # Handshakes by step and outcome; nothing refused or dropped.
        assert after.value("dp_coordinator_handshakes_total", step="hello",
                           outcome="accepted") == 3
        assert after.value("dp_coordinator_handshakes_total", step="ready",
                           outcome="accepted") == 3
        assert [s.value for s in after.all("dp_coordinator_refused_total") if s.value] == []
        assert [s.value for s in after.all("dp_coordinator_dropped_frames_total")
                if s.value] == []
        assert 0.0 < after.value("dp_coordinator_balance_ratio") <= 1.0
        assert after.value("dp_coordinator_watchdog_alert", kind="no_progress") == 0.0

        status, health = await http.json("/healthz")
        assert (status, health["status"]) == (200, "ok")
        status, ready_body = await http.json("/readyz")
        assert (status, ready_body) == (200, {"status": "ready", "ranks": 3, "ranks_out": {},
                                              "reason": "all 3 ranks take requests"})

        state = await http.state()
        assert [(e["rank"], e["state"]) for e in state["engines"]] == [
            (0, "ready"), (1, "ready"), (2, "ready")]
        assert all(isinstance(e["engine_id"], str) and e["engine_id"] for e in state["engines"])
        assert [r["rank"] for r in state["ranks"]] == [0, 1, 2]
        assert sum(r["dispatched"] for r in state["ranks"]) == submits
        assert state["frontends"] == 1
        assert state["all_ready"] is True
        assert state["watchdog"] == []
        assert state["wave"] == after.value("dp_coordinator_wave")

        status, waves = await http.json("/debug/waves")
        assert status == 200
        events = waves["events"]
        assert waves["count"] == len(events) > 0
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
        membership = [(e["rank"], e["cause"]) for e in events if e["kind"] == "membership"]
        for rank in range(3):
            assert (rank, "hello accepted") in membership
            assert (rank, "ready accepted") in membership
        wave_causes = [e["cause"] for e in events if e["kind"] == "wave"]
        assert any(re.fullmatch(r"start_wave\(\d+\) from rank \d", c) for c in wave_causes)
        assert any(re.fullmatch(r"wave_complete\(\d+\) from rank 0", c) for c in wave_causes)
        wakes = [e for e in events if e["kind"] == "wake"]
        assert any(e["cause"].startswith("first request 'burst-") for e in wakes), wakes
        assert all(e["age_s"] >= 0 for e in events)

        status, last = await http.json("/debug/waves?n=2")
        assert (status, last["count"]) == (200, 2)
        assert [e["seq"] for e in last["events"]] == [e["seq"] for e in events[-2:]]


# ---- (b) the hang watchdog --------------------------------------------------------------------


def short_steps(i: int) -> int:
    return 2 + i % 5


async def watchdog_counters(http: Http) -> dict[str, int]:
    return {k: v for k, v in (await http.state())["counters"].items()
            if k.startswith("watchdog.")}


async def run_healthy(http: Http, group: Group, seconds: float) -> None:
    """A steady stream of short requests: counts change every few steps on every rank."""
    group.load.start_stream(0.01, short_steps)
    await asyncio.sleep(seconds)
    await group.load.stop_stream()
    await group.load.all_finished()
    assert group.engines.hangs == []


@pytest.mark.parametrize("hang", ["freeze", "ignore_start_wave"])
async def test_watchdog_quiet_when_healthy_fires_on_a_planted_hang(
    coordinator: CoordinatorFactory, hang: str
) -> None:
    # The re-wake is on by default; one variant turns it off to see that it is optional.
    rewake = hang == "ignore_start_wave"
    port = free_port()
    handle = coordinator(3, transport="tcp", frontends=1, extra_args=metrics_args(
        port, "--watchdog-stall-s", str(STALL_S), *([] if rewake else ["--no-watchdog-rewake"])))
    http = Http(port)
    await http.wait_healthy()
    async with sim_group(handle, 3, prefix=hang) as group:
        # Healthy: more than twice the stall time under load, with waves ending and starting.
        waves_before = (await http.state())["waves_total"]
        await run_healthy(http, group, 2 * STALL_S + 0.5)
        await asyncio.sleep(0.3)  # one more watchdog check after the last request
        state = await http.state()
        assert state["waves_total"] > waves_before
        assert state["watchdog"] == []
        assert await watchdog_counters(http) == {}
        healthy = await http.metrics()
        assert healthy.value("dp_coordinator_watchdog_alert", kind="no_progress") == 0.0
        assert healthy.value("dp_coordinator_watchdog_alert", kind="wave_split") == 0.0
        assert "WATCHDOG" not in handle.stderr_text()

        await group.client.wait_for(lambda c: not c.running, timeout=STEP)
        if hang == "freeze":
            # Rank 1 stops mid-wave while requests keep arriving; its peers block in
            # their next collective.
            group.load.start_stream(0.02, short_steps)
            await group.client.wait_for(lambda c: c.running, timeout=STEP)
            group.engines.engine(1).freeze(silence=True)
        else:
            # One request for rank 0 wakes the paused group; rank 2 drops the wake, so
            # ranks 0 and 1 wait for it in the first collective of the wave.
            group.engines.engine(2).ignore_start_wave = True
            await group.load.submit(20, dp_rank=0)
            await group.client.wait_for(lambda c: c.running, timeout=STEP)
        planted = time.monotonic()

        async def alerted() -> bool:
            return any(a["kind"] == "no_progress" for a in (await http.state())["watchdog"])

        await eventually(alerted, "a no_progress alert in /state", timeout=ALERT_WITHIN_S)
        assert time.monotonic() - planted >= STALL_S - 0.3
        await group.load.stop_stream()

        state = await http.state()
        alert = next(a for a in state["watchdog"] if a["kind"] == "no_progress")
        assert alert["ranks"] == [0, 1, 2]
        assert "no rank has reported progress" in alert["message"]
        assert alert["for_s"] >= STALL_S
        assert state["running"] is True
        counters = await watchdog_counters(http)
        # A rank that ignores wakes also stays at an older wave: a wave split may be
        # reported beside the stall, and is right to be.
        counters.pop("watchdog.wave_split", None)
        assert counters == ({"watchdog.no_progress": 1, "watchdog.rewakes": 1} if rewake
                            else {"watchdog.no_progress": 1})
        hung = await http.metrics()
        assert hung.value("dp_coordinator_watchdog_alert", kind="no_progress") == 1.0
        assert hung.value_or("dp_coordinator_events_total", 0.0,
                             event="watchdog.rewakes") == (1.0 if rewake else 0.0)

        log = handle.stderr_text()
        line = re.search(r"ERROR coordinator\.server: WATCHDOG: wave \d+ is believed running "
                         r"but no rank has reported progress for [\d.]+ s", log)
        assert line is not None, log[-3000:]
        after_alert = log[line.end():]
        assert re.search(r"flight recorder: last \d+ of \d+ events", after_alert)
        assert re.search(r"#\d+ t-[\d.]+s \[wave \d+ running\] wave rank=\d: start_wave",
                         after_alert)
        assert ("re-broadcast START_DP_WAVE" in after_alert) == rewake

        status, waves = await http.json("/debug/waves")
        assert status == 200
        recorded = [e for e in waves["events"] if e["kind"] == "watchdog"]
        # A stalled rank's last report can also be from an older wave than its peers':
        # a wave split may be recorded beside the stall, and is right to be.
        stalls = [e for e in recorded if e["cause"] == "no_progress"]
        assert len(stalls) == 1
        assert {e["cause"] for e in recorded} <= {"no_progress", "wave_split"}
        assert stalls[0]["detail"]["ranks"] == [0, 1, 2]

        # Undo the fault: the group steps again and the alert clears.
        if hang == "freeze":
            group.engines.engine(1).unfreeze()
        else:
            # A request of its own wakes rank 2 without START_DP_WAVE.
            group.engines.engine(2).ignore_start_wave = False
            await group.load.submit(3, dp_rank=2)

        async def cleared() -> bool:
            return not (await http.state())["watchdog"]

        await eventually(cleared, "the alert clears once ranks step again")
        await group.load.all_finished(timeout=2 * STEP)
        assert group.engines.hangs == []
        recovered = await http.metrics()
        assert recovered.value("dp_coordinator_watchdog_alert", kind="no_progress") == 0.0
        assert (await watchdog_counters(http))["watchdog.no_progress"] == 1


async def test_watchdog_stays_quiet_through_a_long_steady_decode(
    coordinator: CoordinatorFactory,
) -> None:
    port = free_port()
    handle = coordinator(2, transport="tcp", frontends=1, extra_args=metrics_args(
        port, "--watchdog-stall-s", str(STALL_S)))
    http = Http(port)
    await http.wait_healthy()
    async with sim_group(handle, 2, prefix="long") as group:
        # One request of ~1500 steps (about 3 s): the group runs and steps throughout.
        await group.load.submit(1500)
        await group.client.wait_for(lambda c: c.running, timeout=STEP)
        deadline = time.monotonic() + STALL_S + 1.0
        while time.monotonic() < deadline:
            assert (await http.state())["watchdog"] == []
            await asyncio.sleep(0.1)


# ---- (c) CURVE ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    server_secret: str
    server_public: str
    clients_dir: str
    frontend_secret: str
    engine_secret: str
    stranger_secret: str


async def keygen(directory: Path, name: str) -> tuple[str, str]:
    code, out, err = await run_cli("keygen", "--dir", str(directory), "--name", name)
    assert code == 0, err
    public, secret = str(directory / f"{name}.key"), str(directory / f"{name}.key_secret")
    assert f"public key: {public}" in out and f"secret key: {secret}" in out, out
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    return public, secret


@pytest.fixture
async def keys(tmp_path: Path) -> Keys:
    """Key pairs written by `dp-coordinator keygen`; only two clients are listed."""
    made = await asyncio.gather(
        keygen(tmp_path / "coordinator", "coordinator"),
        keygen(tmp_path / "frontend", "frontend0"),
        keygen(tmp_path / "engine", "engines"),
        keygen(tmp_path / "stranger", "stranger"),
    )
    (server_public, server_secret), (frontend_public, frontend_secret) = made[:2]
    (engine_public, engine_secret), (_, stranger_secret) = made[2:]
    code, _, err = await run_cli("keygen", "--dir", str(tmp_path / "stranger"),
                                 "--name", "stranger")
    assert code != 0 and "already exists" in err
    clients = tmp_path / "allowed"
    clients.mkdir()
    for public in (frontend_public, engine_public):
        shutil.copy(public, clients)
    return Keys(server_secret, server_public, str(clients), frontend_secret, engine_secret,
                stranger_secret)


def curve_args(keys: Keys) -> list[str]:
    return ["--curve-secret-key", keys.server_secret, "--curve-clients-dir", keys.clients_dir]


@pytest.fixture
def zctx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


async def ask_state_raw(ctx: zmq.asyncio.Context, address: str, timeout: float,
                        keys: tuple[str, str] | None) -> bytes | None:
    """A QueryState from a bare DEALER (CURVE client when `keys`); the reply or None."""
    from coordinator._zmq import configure_client_socket

    sock = ctx.socket(zmq.DEALER)
    try:
        if keys is not None:
            configure_client_socket(sock, *keys)
        sock.connect(address)
        await sock.send(fp.encode(fp.QueryState(7)))
        if not await sock.poll(int(timeout * 1000)):
            return None
        return bytes(await sock.recv())
    finally:
        sock.close(linger=0)


async def test_curve_serves_listed_keys_and_counts_refusals(
    coordinator: CoordinatorFactory, keys: Keys, zctx: zmq.asyncio.Context
) -> None:
    port = free_port()
    handle = coordinator(2, transport="tcp", frontends=1,
                         extra_args=[*curve_args(keys), *metrics_args(port)])
    assert all(a.startswith("tcp://127.0.0.1:") for key, a in handle.addresses.items()
               if key != "admin")  # the operators' socket is owner-only ipc
    assert "CURVE on: 2 allowed client keys" in handle.stderr_text()
    http = Http(port)

    # The control: a listed key gets an answer on the very socket strangers try.
    server = keys.server_public
    reply = await ask_state_raw(zctx, handle.addresses["frontend"], STEP,
                                (keys.frontend_secret, server))
    assert reply is not None and isinstance(fp.decode_reply(reply), fp.StateReply)
    # An unlisted key, and no key at all, get silence.
    assert await ask_state_raw(zctx, handle.addresses["frontend"], 1.0,
                               (keys.stranger_secret, server)) is None
    assert await ask_state_raw(zctx, handle.addresses["frontend"], 1.0, None) is None

    # An engine with an unlisted key never gets an INIT, and is told why.
    stranger = EngineAgent(handle.addresses["handshake"], 0, handshake_timeout_s=1.0,
                           curve_secret_key=keys.stranger_secret, curve_server_key=server)
    with pytest.raises(EngineHandshakeFailed) as refused:
        await stranger.start()
    assert refused.value.stage == "init"
    assert "refused our CURVE key" in str(refused.value)

    client = FrontendClient(handle.addresses, client_index=0, host="127.0.0.1",
                            call_timeout_s=STEP, curve_secret_key=keys.frontend_secret,
                            curve_server_key=server)
    try:
        registered = await client.register()
        assert (registered.rank_start, registered.rank_count) == (0, 2)
        state = await client.query_state()
        assert [e.state for e in state.engines] == ["absent", "absent"]

        async with agents(handle, [0, 1], curve_secret_key=keys.engine_secret,
                          curve_server_key=server) as engines:
            # Handshake, dispatch greeting, back_publish READY: every rank is ready.
            assert all(agent.started for agent in engines)
            state = await client.query_state()
            assert [e.state for e in state.engines] == ["ready", "ready"]

            async def ready() -> bool:
                return (await http.get("/readyz"))[0] == 200

            await eventually(ready, "/readyz answers 200")
            # dispatch carries requests to the engine (first input socket, CURVE).
            submitted = await client.submit("over-curve", [b"payload"], dp_rank=1)
            assert submitted.rank == 1
            # The group's wake (START_DP_WAVE on back_publish) or a lease probe (an
            # empty ABORT) may come before the ADD; they travel on other messages.
            deadline = time.monotonic() + STEP
            request = await engines[1].recv_request(timeout_s=STEP)
            while not isinstance(request, AddRequest):
                request = await engines[1].recv_request(
                    timeout_s=max(0.01, deadline - time.monotonic()))
            assert request.frames == (b"payload",)
            # back_output carries stats; front_publish carries them back to the frontend.
            engines[0].send_stats(waiting=4, running=2, kv_cache_usage=0.25)
            await client.wait_for(lambda c: c.counts is not None and c.counts[0][:2] == (4, 2),
                                  timeout=STEP)

        scrape = await http.metrics()
        refused_keys = scrape.value("dp_coordinator_refused_total", socket="curve",
                                    reason="unknown_key")
        assert refused_keys >= 2  # the stranger DEALER and the stranger engine
        assert scrape.value("dp_coordinator_handshakes_total", step="hello",
                            outcome="accepted") == 2
        assert [s.value for s in scrape.all("dp_coordinator_refused_total", socket="handshake")
                if s.value] == []
        assert (await http.state())["counters"]["refused.curve.unknown_key"] == refused_keys
        assert "refused a CURVE client with public key" in handle.stderr_text()
    finally:
        await client.close()


async def test_sim_cli_group_and_frontend_round_trip_over_curve(
    coordinator: CoordinatorFactory, keys: Keys, tmp_path: Path
) -> None:
    handle = coordinator(2, transport="tcp", frontends=1, extra_args=curve_args(keys))
    server = keys.server_public

    # Half a key pair is a usage error, before anything connects.
    code, _, err = await run_process(
        [sys.executable, "-m", "coordinator.sim", "group", "--engines", "2",
         "--addr-file", handle.addr_file, "--curve-secret-key", keys.engine_secret])
    assert code == 2 and "curve_server_key" in err, err

    finished: list[str] = []
    client = FrontendClient(handle.addresses, client_index=0, host="127.0.0.1",
                            call_timeout_s=STEP, curve_secret_key=keys.frontend_secret,
                            curve_server_key=server,
                            on_finished=lambda done: finished.append(done.request_id))
    sim_log = (tmp_path / "sim.stderr").open("wb")
    sim = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator.sim", "group", "--engines", "2",
        "--addr-file", handle.addr_file, "--step-ms", "2", "--sync-interval", "4",
        "--curve-secret-key", keys.engine_secret, "--curve-server-key", server,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=sim_log,
    )
    try:
        await client.register()

        async def all_ready() -> bool:
            return all(e.state == "ready" for e in (await client.query_state()).engines)

        await eventually(all_ready, "both simulated engines ready over CURVE", 3 * STEP)
        ids = [f"c{i}" for i in range(12)]
        for request_id in ids:
            await client.submit(request_id, sim_payload(client, request_id, 4))

        async def all_finished() -> bool:
            return sorted(finished) == sorted(ids)

        await eventually(all_finished, "every request finished")
        sim.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(sim.communicate(), STEP)
        assert sim.returncode == 0, (tmp_path / "sim.stderr").read_text()[-3000:]
        summaries = [json.loads(line) for line in out.decode().splitlines()]
        assert sum(s["finished"] for s in summaries) == len(ids)
        assert all(s["hang_count"] == 0 for s in summaries)
    finally:
        if sim.returncode is None:
            sim.kill()
            await sim.wait()
        sim_log.close()
        await client.close()


async def test_serve_refuses_a_public_bind_without_keys(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    code, _, err = await run_cli("serve", "--engines", "1", "--host", "0.0.0.0",
                                 "--addr-file", str(tmp_path / "a.json"))
    assert code == 2, err
    assert "refusing to bind '0.0.0.0' without CURVE keys" in err
    assert "--insecure" in err and "--curve-secret-key" in err
    assert not (tmp_path / "a.json").exists()

    # --insecure is the operator saying the network is trusted: it binds.
    handle = launch(engines=1, host="0.0.0.0", extra_args=["--insecure"],
                    addr_file=str(tmp_path / "b.json"), timeout=20.0)
    try:
        assert all(a.startswith("tcp://0.0.0.0:") for key, a in handle.addresses.items()
                   if key != "admin")  # the operators' socket is owner-only ipc
        # Serving (asked over loopback only), so SIGTERM now meets its handler.
        port = handle.addresses["frontend"].rsplit(":", 1)[1]
        reply = await ask_state_raw(zctx, f"tcp://127.0.0.1:{port}", STEP, None)
        assert reply is not None and isinstance(fp.decode_reply(reply), fp.StateReply)
    finally:
        assert handle.shutdown(timeout=5.0) == 0


# ---- (d) SIGUSR1 --------------------------------------------------------------------------


async def test_sigusr1_logs_the_flight_recorder(coordinator: CoordinatorFactory) -> None:
    handle = coordinator(2, transport="ipc")
    async with agents(handle, [0, 1]):
        os.kill(handle.pid, signal.SIGUSR1)

        async def dumped() -> bool:
            return "ready accepted" in handle.stderr_text().partition("flight recorder:")[2]

        await eventually(dumped, "the flight recorder in the log after SIGUSR1")
        dump = handle.stderr_text().partition("flight recorder:")[2]
        header = re.match(r" last (\d+) of (\d+) events", dump)
        assert header is not None and header.group(1) == header.group(2), dump[:200]
        for rank in (0, 1):
            for step in ("hello", "ready"):
                assert re.search(rf"#\d+ t-[\d.]+s \[wave 0 paused\] membership rank={rank}: "
                                 rf"{step} accepted", dump), dump
        assert handle.is_alive()


# ---- (e) dp-coordinator top ---------------------------------------------------------------


def rank_rows(text: str) -> dict[int, list[str]]:
    """Table rows by rank: lines whose first cell is a number and second a state."""
    rows: dict[int, list[str]] = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 8 and cells[0].isdigit() and cells[1].isalpha():
            rows[int(cells[0])] = cells
    return rows


async def test_top_once_renders_ranks_from_both_sources(
    coordinator: CoordinatorFactory,
) -> None:
    port = free_port()
    handle = coordinator(3, transport="tcp", extra_args=metrics_args(port))
    env = {**os.environ, "COLUMNS": "160", "TERM": "dumb"}
    # The frontend registers before the engines, so that their INITs carry its outputs.
    client = FrontendClient(handle.addresses, client_index=0, host="127.0.0.1",
                            call_timeout_s=STEP)
    await client.register()
    async with agents(handle, [0, 1, 2]):
        try:
            for rank in (0, 2, 2):
                await client.submit(f"top-{rank}-{time.monotonic_ns()}", [b"x"], dp_rank=rank)

            async def counted() -> bool:
                state = await Http(port).state()
                return [r["dispatched"] for r in state["ranks"]] == [1, 0, 2]

            await eventually(counted, "/state shows the dispatches")

            code, out, err = await run_cli("top", "--once", "--addr-file", handle.addr_file,
                                           env=env)
            assert code == 0, err
            rows = rank_rows(out)
            assert sorted(rows) == [0, 1, 2], out
            assert all(row[1] == "ready" for row in rows.values())
            # Over the frontend socket: no per-rank dispatch totals ("-"), the group's
            # total, and in flight.
            assert [rows[r][5] for r in (0, 1, 2)] == ["-", "-", "-"], out
            assert [rows[r][6] for r in (0, 1, 2)] == ["1", "0", "2"], out
            assert "dispatched in total 3" in out
            assert "watchdog: not available over the frontend socket" in out

            code, out, err = await run_cli("top", "--once", "--url",
                                           f"http://127.0.0.1:{port}/state", env=env)
            assert code == 0, err
            rows = rank_rows(out)
            assert sorted(rows) == [0, 1, 2], out
            assert all(row[1] == "ready" for row in rows.values())
            assert [rows[r][5] for r in (0, 1, 2)] == ["1", "0", "2"], out
            assert "watchdog: ok" in out
            assert re.search(r"wave \d+ (running|paused)", out)
            assert "dispatched in total 3" in out
        finally:
            await client.close()
