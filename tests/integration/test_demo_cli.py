"""The `demo` and `status` commands, run as a user would: as subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from coordinator.launch import launch
from coordinator.loadgen import LoadConfig, LoadGenerator, LoadSummary, percentile
from coordinator.protocol.frontend import GroupState
from coordinator.sim import SimConfig, SimEngineGroup
from tests.unit.test_readme import per_rank_header, readme_demo_output, summary_labels

pytestmark = pytest.mark.timeout(120)

DEMO_TIMEOUT = 90.0


def cli() -> list[str]:
    """`dp-coordinator` from this virtualenv, or the module when it is not installed."""
    script = Path(sys.executable).with_name("dp-coordinator")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "coordinator"]


def run_bounded(args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run in its own process group; on timeout kill the whole group (children too)."""
    process = subprocess.Popen(
        list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate(timeout=10)
        pytest.fail(f"{' '.join(args)} did not finish within {timeout} s\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    return subprocess.CompletedProcess(list(args), process.returncode, out, err)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # ipc socket paths must fit in 108 bytes; pytest's tmp_path may not.
    path = Path(tempfile.mkdtemp(prefix="dpd-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_demo_runs_end_to_end_and_loses_nothing(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    result = run_bounded(
        [sys.executable, "-m", "coordinator", "demo", "--duration", "3", "--no-live",
         "--engines", "2", "--frontends", "2", "--seed", "7", "--json", str(summary_file)],
        DEMO_TIMEOUT,
    )
    report = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    assert "lost = 0" in result.stdout, report
    assert "hang = no" in result.stdout, report
    data = json.loads(summary_file.read_text())
    summary = data["summary"]
    assert data["healthy"] is True and data["hang_detected"] is False
    assert summary["lost"] == 0 and summary["failed"] == 0
    assert summary["submitted"] > 100  # 3 s at the default 200/s
    assert summary["completed"] == summary["submitted"]
    assert set(summary["per_rank"]) == {"0", "1"}
    assert summary["wakes"] >= 1 and summary["waves_completed"] >= summary["wakes"]
    assert data["group_paused"] is True
    assert summary["balance_ratio"] > 0.5
    assert len(data["engines"]) == 2 and all(not e["hangs"] for e in data["engines"])
    # The README shows this output: the same rows and columns, in the same order.
    readme = readme_demo_output()
    assert summary_labels(result.stdout) == summary_labels(readme), result.stdout
    assert per_rank_header(result.stdout) == per_rank_header(readme), result.stdout


def test_thousands_of_requests_finish_exactly_once_and_every_wave_ends(
    tmp_path: Path,
) -> None:
    """A full simulated run: four lockstep engines with a real per-step collective."""
    summary_file = tmp_path / "summary.json"
    result = run_bounded(
        [sys.executable, "-m", "coordinator", "demo", "--duration", "8", "--rate", "400",
         "--no-live", "--engines", "4", "--frontends", "2", "--seed", "11",
         "--json", str(summary_file)],
        DEMO_TIMEOUT,
    )
    report = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    data = json.loads(summary_file.read_text())
    summary = data["summary"]
    assert summary["submitted"] >= 2000, report
    # Every request finished, and the coordinator's routing table holds none of them:
    # each finish was reported once (a second report would find no entry to free).
    assert summary["completed"] == summary["submitted"], report
    assert summary["lost"] == 0 and summary["failed"] == 0 and summary["stalls"] == 0
    assert data["hang_detected"] is False
    assert all(not engine["hangs"] for engine in data["engines"])
    # Every wave ended: once the work was done the coordinator said the group paused,
    # and the waves are counted up to that state. Each submit that woke the group
    # woke a different wave (one wake per wave), and each of those waves is among the
    # ones that ended. How many waves the bursts make depends on the machine's speed
    # (a loaded machine may run two bursts as one wave), so that number is not pinned.
    assert data["group_paused"] is True
    assert summary["wakes"] >= 1
    assert summary["waves_completed"] >= summary["wakes"]
    assert summary["last_wave"] == summary["first_wave"] + summary["waves_completed"]
    counters = data["coordinator_counters"]
    assert counters.get("submit.dispatched") == summary["submitted"]
    assert not any(key.startswith("internal_error") for key in counters)


def test_demo_dense_mode_over_tcp(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    result = run_bounded(
        [sys.executable, "-m", "coordinator", "demo", "--duration", "2", "--no-live",
         "--engines", "3", "--frontends", "1", "--rate", "100", "--host", "127.0.0.1",
         "--no-wave-coordination", "--json", str(summary_file)],
        DEMO_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads(summary_file.read_text())["summary"]
    assert summary["lost"] == 0 and summary["completed"] == summary["submitted"] > 0
    # Dense mode: no waves and no wakes.
    assert summary["waves_completed"] == 0 and summary["wakes"] == 0
    assert json.loads(summary_file.read_text())["group_paused"] is None  # no waves to end


async def _status(args: Sequence[str], timeout: float = 30.0) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return int(process.returncode or 0), out.decode(), err.decode()


async def test_status_json_lists_the_ranks(short_tmp: Path) -> None:
    addr_file = short_tmp / "addresses.json"
    handle = launch(engines=3, addr_file=str(addr_file),
                    extra_args=["--ipc-dir", str(short_tmp / "ipc")], timeout=20.0)
    group = SimEngineGroup(handle.addresses["handshake"], 3,
                           config=SimConfig(step_time_s=0.002, collective_timeout_s=5.0))
    try:
        code, out, err = await _status([*cli(), "status", "--addr-file", str(addr_file),
                                        "--json"])
        assert code == 0, err
        before = json.loads(out)
        assert [e["rank"] for e in before["engines"]] == [0, 1, 2]
        assert {e["state"] for e in before["engines"]} == {"absent"}

        await asyncio.wait_for(group.start(), 20.0)
        code, out, err = await _status([*cli(), "status", "--addr-file", str(addr_file),
                                        "--json"])
        assert code == 0, err
        state = json.loads(out)
        assert (state["rank_start"], state["rank_count"]) == (0, 3)
        assert [e["rank"] for e in state["engines"]] == [0, 1, 2]
        assert [e["state"] for e in state["engines"]] == ["ready"] * 3
        assert state["lockstep"] is True and isinstance(state["counters"], dict)

        code, out, err = await _status([*cli(), "status", "--addr-file", str(addr_file)])
        assert code == 0, err
        assert "ready" in out and "wave" in out
    finally:
        await asyncio.wait_for(group.stop(), 20.0)
        handle.shutdown(timeout=5.0)


async def test_status_without_an_answer_exits_1(short_tmp: Path) -> None:
    addr_file = short_tmp / "addresses.json"
    # A well-formed file naming a socket nobody binds.
    addr_file.write_text(json.dumps({"frontend": f"ipc://{short_tmp}/nobody"}))
    code, out, err = await _status([*cli(), "status", "--addr-file", str(addr_file),
                                    "--timeout", "0.5"])
    assert code == 1 and out == ""
    assert "did not answer within 0.5 s" in err

    code, _out, err = await _status([*cli(), "status", "--addr-file",
                                     str(short_tmp / "missing.json")])
    assert code == 1 and "no address file" in err


# ---------------------------------------------------------------- the load generator


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0, 99.0, 100.0)


async def _loadgen_against_sim(short_tmp: Path, config: LoadConfig, *,
                               ignore_start_wave: bool = False,
                               settled: list[GroupState] | None = None) -> LoadSummary:
    """Run the load against two simulated engines; with `settled`, also append the
    coordinator's state once the group paused after the run (bounded wait)."""
    handle = launch(engines=2, frontends=config.frontends,
                    addr_file=str(short_tmp / "addresses.json"),
                    extra_args=["--ipc-dir", str(short_tmp / "ipc")], timeout=20.0)
    group = SimEngineGroup(handle.addresses["handshake"], 2, config=SimConfig(
        step_time_s=0.002, collective_timeout_s=1.0, on_hang="wait"))
    gen = LoadGenerator(handle.addresses, config)
    try:
        await asyncio.wait_for(asyncio.gather(gen.start(), group.start()), 20.0)
        for engine in group.engines:
            engine.ignore_start_wave = ignore_start_wave
        await gen.wait_ready(timeout_s=10.0)
        summary = await asyncio.wait_for(gen.run(), 30.0)
        if settled is not None:
            deadline = time.monotonic() + 10.0
            state = await gen.clients[0].query_state(timeout=5.0)
            while state.running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                state = await gen.clients[0].query_state(timeout=5.0)
            settled.append(state)
        return summary
    finally:
        await asyncio.wait_for(gen.close(), 10.0)
        await asyncio.wait_for(group.stop(), 20.0)
        handle.shutdown(timeout=5.0)


async def test_loadgen_stops_at_the_request_budget(short_tmp: Path) -> None:
    config = LoadConfig(frontends=2, rate=40.0, duration_s=30.0, max_requests=60, seed=3,
                        burst_on_s=0.1, burst_off_s=0.4, steps_max=32)
    started = time.monotonic()
    settled: list[GroupState] = []
    summary = await _loadgen_against_sim(short_tmp, config, settled=settled)
    assert time.monotonic() - started < 20.0  # the count bound ended it, not the 30 s
    assert summary.arrivals == summary.submitted == summary.completed == 60
    assert summary.lost == 0 and summary.stalls == 0 and summary.healthy
    assert sum(w.completed for w in summary.per_rank.values()) == 60
    # The first request woke the paused group; whether later bursts found it paused
    # again depends on the machine's speed, so only what every run guarantees is
    # checked: each wake woke its own wave, and every wave ended once the work did.
    (state,) = settled
    assert summary.wakes >= 1
    assert not state.running
    assert state.wave - summary.first_wave >= summary.wakes


async def test_loadgen_reports_a_hang_as_lost_and_stalled(short_tmp: Path) -> None:
    # Every engine drops START_DP_WAVE: the rank that gets the request runs alone and
    # waits in the collective for peers that were never woken.
    config = LoadConfig(frontends=1, rate=50.0, duration_s=5.0, max_requests=1,
                        drain_timeout_s=2.5, stall_s=1.0)
    summary = await _loadgen_against_sim(short_tmp, config, ignore_start_wave=True)
    assert summary.submitted == 1 and summary.wakes == 1
    assert summary.completed == 0 and summary.lost == 1 and summary.lost_ids
    assert summary.stalls == 1 and not summary.healthy
