"""The prefix benchmark runs end to end in smoke mode and writes what it measured.

Only that it runs, on the same traffic for every policy, and what it writes
are checked; no figure is judged (those come from `python -m bench.prefix`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.prefix import decision_p99_us

REPO = Path(__file__).resolve().parents[2]


def run_prefix(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "bench.prefix", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=150, check=False)


@pytest.mark.timeout(180)
def test_smoke_run_compares_policies_on_the_same_traffic(tmp_path: Path) -> None:
    result = run_prefix("--smoke", "--policy", "prefix", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "prefix.json").read_text())
    assert data["benchmark"] == "prefix" and data["mode"] == "smoke"
    assert data["policies"] == ["least-loaded", "prefix"]
    runs = data["runs"]
    assert {(r["mode"], r["policy"]) for r in runs} == {
        (mode, policy) for mode in ("lockstep", "dense")
        for policy in ("least-loaded", "prefix")}
    for run in runs:
        assert "error" not in run, run
        assert run["healthy"] and run["lost"] == 0 and run["completed"] == run["requests"] > 0
        assert 0 < run["hit_tokens"] <= run["ideal_reusable_tokens"] <= run["prompt_tokens"]
        assert run["hit_tokens"] == run["engine_hit_tokens"]
        assert run["prefill_tokens"] == run["prompt_tokens"] - run["hit_tokens"]
        assert run["ttft_ms_p50"] is not None and run["balance_ratio"] is not None
        assert run["decision_p99_us"] is not None and run["decision_p99_us"] > 0
    # One seed: every policy was offered exactly the same prompts.
    assert len({(r["prompt_tokens"], r["ideal_reusable_tokens"]) for r in runs}) == 1
    assert [(c["mode"], c["policy"]) for c in data["comparisons"]] == [
        ("lockstep", "prefix"), ("dense", "prefix")]
    table = (tmp_path / "PREFIX.md").read_text()
    assert table.count("| 2 | lockstep |") == 2 and table.count("| 2 | dense |") == 2


def test_a_policy_the_coordinator_does_not_know_is_reported_not_hidden(tmp_path: Path) -> None:
    result = run_prefix("--smoke", "--modes", "dense", "--policy", "nonsense",
                        "--out", str(tmp_path))
    assert result.returncode == 1
    runs = json.loads((tmp_path / "prefix.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["least-loaded", "nonsense"]
    assert "error" not in runs[0] and "error" in runs[1]
    assert "error:" in (tmp_path / "PREFIX.md").read_text()


def test_a_short_run_refuses_to_overwrite_the_committed_results() -> None:
    from bench.run import RESULTS_DIR

    result = run_prefix("--smoke", "--out", RESULTS_DIR)
    assert result.returncode == 2 and "must not overwrite" in result.stderr


def test_decision_latency_is_read_from_a_route_decision_histogram() -> None:
    text = "\n".join([
        "# TYPE dp_coordinator_route_decision_seconds histogram",
        'dp_coordinator_route_decision_seconds_bucket{le="5e-05"} 10',
        'dp_coordinator_route_decision_seconds_bucket{le="0.0001"} 980',
        'dp_coordinator_route_decision_seconds_bucket{le="0.0002"} 995',
        'dp_coordinator_route_decision_seconds_bucket{le="+Inf"} 1000',
        "dp_coordinator_route_decision_seconds_count 1000",
        'other_bucket{le="1"} 5',
    ])
    assert decision_p99_us(text) == 200.0
    assert decision_p99_us("dp_coordinator_waves_total 3\n") is None
    assert decision_p99_us(text.replace("995", "985")) is None  # p99 beyond the last bound
