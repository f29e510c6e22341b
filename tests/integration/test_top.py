"""`dp-coordinator top` against a live coordinator (frontend socket) and against /state."""

from __future__ import annotations

import argparse
import asyncio
import io
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from rich.console import Console

from coordinator.cli.top import (
    FrontendSource,
    Rates,
    TopError,
    TopFrame,
    TopRank,
    add_top_parser,
    compute_rates,
    frame_from_state_json,
    run_top,
    state_url,
)
from coordinator.core.waves.watchdog import HangWatchdog
from coordinator.engine import EngineAgent
from coordinator.launch import launch
from coordinator.server.http import HttpEndpoints, ObservedState, RankView

pytestmark = pytest.mark.timeout(60)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dp-coordinator")
    add_top_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["top", *argv])


def make_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=140, color_system=None, force_terminal=False), buffer


def rank_rows(text: str) -> dict[str, list[str]]:
    """Table rows keyed by rank (lines whose first cell is a number and second a state)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 8 and cells[0].isdigit() and cells[1].isalpha():
            rows[cells[0]] = cells
    return rows


# --- against a live coordinator, over its frontend socket --------------------------------------


async def test_once_shows_every_rank_of_a_live_coordinator() -> None:
    handle = await asyncio.to_thread(launch, engines=2)
    agents = [EngineAgent(handle.addresses["handshake"], rank, heartbeat_interval_s=None,
                          ready_timeout_s=20, handshake_timeout_s=20) for rank in (0, 1)]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 30)
        agents[0].send_stats(waiting=3, running=2, kv_cache_usage=0.5, step_counter=1)
        agents[1].send_stats(waiting=0, running=7, kv_cache_usage=0.25, step_counter=1)

        source = FrontendSource(handle.addr_file, timeout_s=5)
        try:
            deadline = time.monotonic() + 10
            while True:
                frame = await asyncio.to_thread(source.fetch)
                if [r.running for r in frame.ranks] == [2, 7]:
                    break
                assert time.monotonic() < deadline, f"stats never arrived: {frame}"
                await asyncio.sleep(0.05)
        finally:
            source.close()

        console, buffer = make_console()
        code = await asyncio.to_thread(
            run_top, parse(["--addr-file", handle.addr_file, "--once"]), console=console
        )
        out = buffer.getvalue()
        assert code == 0, out
        rows = rank_rows(out)
        # Per-rank dispatch totals are not in a state reply: "-", never another quantity.
        assert rows["0"][:7] == ["0", "ready", "3", "2", "50%", "-", "0"], out
        assert rows["1"][:7] == ["1", "ready", "0", "7", "25%", "-", "0"], out
        assert "dispatched in total 0" in out
        assert "wave 0 paused" in out
        assert "lockstep   ranks 2" in out
        assert handle.addresses["frontend"] in out
        assert "watchdog: not available over the frontend socket" in out
        assert "dispatched: requests sent since the coordinator started (per rank only over " \
            "--url)" in out
    finally:
        for agent in agents:
            await agent.close(linger_s=0)
        await asyncio.to_thread(handle.shutdown)


def test_missing_address_file_is_explained(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    console, _ = make_console()
    code = run_top(parse(["--addr-file", str(tmp_path / "nope.json"), "--once"]),
                   console=console)
    assert code == 1
    assert "no address file at" in capsys.readouterr().err


def test_silent_coordinator_times_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    addr_file = tmp_path / "addr.json"
    addr_file.write_text(f'{{"frontend": "ipc://{tmp_path}/nobody"}}')
    console, _ = make_console()
    code = run_top(parse(["--addr-file", str(addr_file), "--once", "--timeout", "0.2"]),
                   console=console)
    assert code == 1
    assert "did not answer within 0.2 s" in capsys.readouterr().err


# --- against /state ----------------------------------------------------------------------------


def snapshot(dispatched: Sequence[int], waves_total: int, *, alerts: bool = False,
             wave: int = 4) -> ObservedState:
    watchdog: list[dict[str, object]] = []
    if alerts:
        dog = HangWatchdog(stall_after_s=1.0)
        dog.observe_group(running=True, wave=wave, ranks=[0, 1], now=0.0)
        watchdog = [a.as_dict(3.0) for a in dog.check(3.0)]
    return ObservedState(
        taken_at=time.monotonic(),
        wave=wave,
        running=True,
        lockstep=True,
        ranks=[RankView(rank, "ready" if rank else "draining", waiting=rank, running=4,
                        kv_cache_usage=0.125 * (rank + 1), dispatched=n,
                        report_age_s=0.25, in_flight=rank + 1)
               for rank, n in enumerate(dispatched)],
        counters={"submit.dispatched": sum(dispatched)},
        waves_total=waves_total,
        watchdog=watchdog,
        all_ready=False,
        state_json={"frontends": 2},
    )


@pytest.fixture
def endpoints() -> Iterator[HttpEndpoints]:
    with HttpEndpoints("127.0.0.1", 0) as http:
        yield http


def test_once_from_state_shows_totals_and_the_watchdog(endpoints: HttpEndpoints) -> None:
    endpoints.update(snapshot([10, 32], 7, alerts=True))
    console, buffer = make_console()
    assert run_top(parse(["--url", endpoints.url, "--once"]), console=console) == 0
    out = buffer.getvalue()
    rows = rank_rows(out)
    assert rows["0"] == ["0", "draining", "0", "4", "12%", "10", "1", "0.2s"]
    assert rows["1"] == ["1", "ready", "1", "4", "25%", "32", "2", "0.2s"]
    assert "frontends 2" in out
    assert "waves started 7" in out
    assert "dispatched in total 42" in out
    assert "(per rank only over --url)" not in out
    assert "dispatches/s -" in out  # one reading: no rate yet
    assert "no_progress: wave 4 is believed running" in out
    assert endpoints.url + "/state" in out


def test_live_view_computes_rates_from_successive_readings(endpoints: HttpEndpoints) -> None:
    endpoints.update(snapshot([0, 0], 0))

    stop = threading.Event()

    def publish() -> None:
        step = 0
        while not stop.wait(0.05):
            step += 1
            endpoints.update(snapshot([50 * step, 50 * step], step))

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    try:
        console, buffer = make_console()
        code = run_top(parse(["--url", endpoints.url, "--interval", "0.3", "--frames", "3"]),
                       console=console)
    finally:
        stop.set()
        publisher.join(5)
    assert code == 0
    out = buffer.getvalue()
    rate = out.split("dispatches/s ")[-1].split()[0]
    assert rate != "-"
    # 100 dispatches and 1 wave every 50 ms
    assert 500 <= float(rate.replace(",", "")) <= 3000, out
    waves = float(out.split("waves/s ")[-1].split()[0])
    assert 5 <= waves <= 30, out
    assert "watchdog: ok" in out


def test_url_errors(endpoints: HttpEndpoints, capsys: pytest.CaptureFixture[str]) -> None:
    console, _ = make_console()
    assert run_top(parse(["--url", endpoints.url, "--once"]), console=console) == 1
    assert "answered 503" in capsys.readouterr().err
    endpoints.update(snapshot([1], 1))
    assert run_top(parse(["--url", endpoints.url + "/healthz", "--once"]), console=console) == 1
    assert "no 'ranks' list" in capsys.readouterr().err
    with HttpEndpoints("127.0.0.1", 0) as other:
        port = other.port
    assert run_top(parse(["--url", f"http://127.0.0.1:{port}", "--once", "--timeout", "1"]),
                   console=console) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_live_view_keeps_the_last_reading_when_the_coordinator_goes_away() -> None:
    http = HttpEndpoints("127.0.0.1", 0)
    http.start()
    http.update(snapshot([1, 1], 1))
    console, buffer = make_console()
    stopper = threading.Timer(0.15, http.stop)
    stopper.start()
    try:
        code = run_top(parse(["--url", http.url, "--interval", "0.3", "--frames", "2",
                              "--timeout", "1"]), console=console)
    finally:
        stopper.join(5)
        http.stop()
    assert code == 0
    out = buffer.getvalue()
    assert "cannot reach" in " ".join(out.split())
    assert "showing the last reading" in " ".join(out.split())
    assert rank_rows(out)["1"][5] == "1"


# --- pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "expected"), [
    ("http://127.0.0.1:9100", "http://127.0.0.1:9100/state"),
    ("http://127.0.0.1:9100/", "http://127.0.0.1:9100/state"),
    ("127.0.0.1:9100", "http://127.0.0.1:9100/state"),
    ("http://[::1]:9100/state", "http://[::1]:9100/state"),
    ("http://h:1/custom", "http://h:1/custom"),
])
def test_state_url(given: str, expected: str) -> None:
    assert state_url(given) == expected


def frame(at: float, *, wave: int = 0, dispatched: int | None = None,
          waves_total: int | None = None) -> TopFrame:
    counters = {} if dispatched is None else {"submit.dispatched": dispatched}
    return TopFrame(taken_at=at, source="x", wave=wave, running=True, lockstep=True, ranks=[],
                    counters=counters, waves_total=waves_total)


def test_compute_rates() -> None:
    assert compute_rates(None, frame(1.0)) == Rates()
    assert compute_rates(frame(1.0), frame(1.0)) == Rates()
    assert compute_rates(frame(0.0, dispatched=10, waves_total=2),
                         frame(2.0, dispatched=30, waves_total=6)) == Rates(10.0, 2.0)
    # without waves started, the wave number is used
    assert compute_rates(frame(0.0, wave=3), frame(0.5, wave=4)) == Rates(None, 2.0)
    # a restarted coordinator: counters went back, no rate
    assert compute_rates(frame(0.0, dispatched=100), frame(1.0, dispatched=5)).dispatches_per_s \
        is None


def test_dispatched_total_falls_back_to_rank_totals() -> None:
    def rank(n: int | None) -> TopRank:
        return TopRank(0, "ready", 0, 0, 0.0, 0, n, None, None)

    base = frame(0.0)
    assert TopFrame(**{**base.__dict__, "ranks": [rank(3), rank(4)]}).dispatched_total == 7
    assert TopFrame(**{**base.__dict__, "ranks": [rank(3), rank(None)]}).dispatched_total is None
    assert base.dispatched_total is None


def test_state_documents_are_read_tolerantly() -> None:
    parsed = frame_from_state_json({
        "wave": 2, "running": False, "ranks": [
            {"rank": 5, "state": "ready", "waiting": 1.0, "kv_cache_usage": None,
             "dispatched_since_report": 3},
            "junk",
        ], "counters": {"a": 1}, "watchdog": [{"kind": "wave_split"}, 7],
    }, taken_at=0.0, source="s")
    assert parsed.ranks == [TopRank(5, "ready", 1, 0, 0.0, 0, None, 3, None)]
    assert parsed.watchdog == [{"kind": "wave_split"}]
    assert parsed.waves_total is None
    assert parsed.lockstep
    with pytest.raises(TopError, match="no 'ranks' list"):
        frame_from_state_json({"status": "ok"}, taken_at=0.0, source="s")
