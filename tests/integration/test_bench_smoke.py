"""The benchmark harness runs end to end in smoke mode and writes its result files.

Only that it runs and what it writes are checked; no timing is asserted (the
numbers come from `python -m bench`, on a quiet machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--no-asyncio-compare", "--out", str(out),
         *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )


@pytest.mark.timeout(400)
def test_smoke_run_writes_results(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--scenario", "wake", "--scenario", "stats", "--scenario",
                       "flood")
    assert result.returncode == 0, result.stderr[-3000:]
    for scenario in ("wake", "stats", "flood"):
        data = json.loads((tmp_path / f"{scenario}.json").read_text())
        assert data["scenario"] == scenario
        assert data["mode"] == "smoke"
        assert {"cpu", "cores", "python", "pyzmq", "libzmq", "msgspec"} <= data["machine"].keys()
        assert set(data["targets"]) == {"ours", "floor"}
        case = data["cases"][0]
        assert {"ours", "floor"} <= case["targets"].keys()
    wake = json.loads((tmp_path / "wake.json").read_text())["cases"][0]
    assert wake["targets"]["ours"]["median"]["n"] > 0
    assert "ours/floor" in wake["ratios"]
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "| Wake latency p99, N=4 (µs) |" in summary
    assert "Stats ingest" in summary
    flood = json.loads((tmp_path / "flood.json").read_text())["cases"][0]["targets"]["ours"]
    assert flood["median"]["rss_peak_mib"] > 0
    assert "| Flood by 2 processes: RSS peak (MiB) |" in summary
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "summary.png").stat().st_size > 0


def test_unknown_scenario_is_refused(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--scenario", "nonsense")
    assert result.returncode == 2
    assert "unknown scenario 'nonsense'" in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(900)
def test_vllm_peer_runs_through_the_peer_scenarios(tmp_path: Path) -> None:
    """vLLM 0.33's unmodified coordinator is driven like ours, in the same run."""
    from tools import vllm_wheel

    try:
        vllm_wheel.extract(vllm_wheel.COORDINATOR_REAL, timeout_s=600)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_wheel.VLLM_VERSION} wheel unavailable: {exc}")
    result = run_bench(tmp_path, "--no-floor", "--peer", "vllm", "--scenario", "wake",
                       "--scenario", "cadence", "--no-figure")
    assert result.returncode == 0, result.stderr[-3000:]
    for scenario in ("wake", "cadence"):
        data = json.loads((tmp_path / f"{scenario}.json").read_text())
        assert data["targets"] == ["ours", "peer"]
        assert data["peer"] == "vllm 0.33.0"
        case = data["cases"][0]
        assert "ours/peer" in case["ratios"]
    wake = json.loads((tmp_path / "wake.json").read_text())["cases"][0]["targets"]["peer"]
    # Every wake reached every engine, with vLLM's own wave numbers in the payload.
    assert wake["median"]["n"] == 20 and wake["median"]["bad_payloads"] == 0
    cadence = json.loads((tmp_path / "cadence.json").read_text())["cases"][0]
    assert cadence["targets"]["peer"]["median"]["absorbed_per_s"] > 0
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "*peer* is vllm 0.33.0" in summary
    assert "| Wake latency p50, N=4 (µs) |" in summary


@pytest.mark.parametrize("mode", ["--quick", "--smoke"])
def test_a_short_run_refuses_to_overwrite_the_committed_results(mode: str) -> None:
    from bench.run import RESULTS_DIR

    results = Path(RESULTS_DIR)
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir() if p.is_file()}
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "bench", mode, "--scenario", "wake", "--out", str(results)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 2
    assert "must not overwrite the full results" in result.stderr
    after = {p.name: p.stat().st_mtime_ns for p in results.iterdir() if p.is_file()}
    assert after == before


def test_short_runs_write_to_git_ignored_directories_by_default() -> None:
    from bench.run import RESULTS_DIR, output_dir

    assert output_dir("full", None) == RESULTS_DIR
    for mode in ("quick", "smoke"):
        where = output_dir(mode, None)
        assert Path(where) == Path(RESULTS_DIR) / mode
        probe = os.path.relpath(os.path.join(where, "wake.json"), REPO)
        ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO,
                                 capture_output=True, timeout=30, check=False)
        if ignored.returncode == 128:
            pytest.skip("not a git checkout")
        assert ignored.returncode == 0, f"{probe} is not git-ignored"


@pytest.mark.timeout(400)
def test_scale_and_cpu_scenarios_measure_what_they_say(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--scenario", "scale", "--scenario", "cpu", "--no-figure")
    assert result.returncode == 0, result.stderr[-3000:]
    scale = json.loads((tmp_path / "scale.json").read_text())
    n = scale["parameters"]["engines"]
    assert scale["targets"] == ["ours", "floor"]
    ours = scale["cases"][0]["targets"]["ours"]["median"]
    floor = scale["cases"][0]["targets"]["floor"]["median"]
    for got in (ours, floor):
        assert got["all_ready_ms"] > 0 and got["fds_after_handshake"] > got["fds_idle"]
        # Every wake reached every rank of every engine process.
        assert got["wake_n"] == scale["parameters"]["wakes_per_repetition"]
        assert got["wake_missing"] == 0 and got["wake_bad_payloads"] == 0
    # One row per rank in the full publish, seen by every frontend.
    assert ours["publish_rows"] == n and ours["publish_bytes"] > 0
    assert ours["publishes_per_frontend_min"] >= 1
    assert ours["rss_end_mib"] > 0 and ours["stats_caught_up_after_s"] is not None
    fds = scale["file_descriptors"]
    for transport in ("ipc", "tcp"):
        entry = fds[transport]
        assert entry["handshake"] == "complete" and entry["alive"]
        # At least one descriptor per rank's connection on each of the three engine sockets.
        assert entry["peak"] >= entry["idle"] + 3 * n
    for transport in ("ipc", "tcp"):  # 16 ranks fit in 1,024 descriptors
        assert fds[f"{transport}_soft_limit_1024"]["handshake"] == "complete"
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    assert cpu["targets"] == ["ours", "floor", "floor-batched"]
    for name, target in cpu["cases"][0]["targets"].items():
        got = target["median"]
        assert got["submit_errors"] == 0 and got["unanswered"] == 0, name
        assert got["adds_received"] > 0 and got["stats_sent_per_s"] > 0, name
        # CPU is read per thread too (libzmq's and the interpreter's); no figure is judged.
        assert got["zmq_threads_cpu_pct"] >= 0 and got["python_threads_cpu_pct"] >= 0, name
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert f"| {n} ranks: handshake, all READY (ms) |" in summary
    assert f"| {n} ranks: descriptors, handshake peak / after, tcp |" in summary
    assert "| CPU, 8 ranks x 50 stats/s + 200 submits/s (% of one core) |" in summary
    assert "floor reading in 1 ms batches" in summary


def test_profile_summary_counts_own_and_stack_time(tmp_path: Path) -> None:
    from bench.profile import summarize

    stacks = tmp_path / "stacks.txt"
    stacks.write_text("main;loop;drain 6\nmain;loop;send 3\nmain;loop 1\n\n")
    text = summarize(str(stacks), top=5)
    assert text.startswith("10 samples")
    assert "60.0%  drain" in text and "30.0%  send" in text
    assert "100.0%  main" in text
    assert summarize(str(stacks), top=1).count(
        "%") == 2
