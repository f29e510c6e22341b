"""The load generator against a real coordinator and simulated engines.

Its command line, its handling of the coordinator's shutdown notice, and its
prefix-reuse workloads, whose figures come from what the engines report.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.launch import CoordinatorHandle, launch
from coordinator.loadgen import LoadConfig, LoadGenerator, LoadSummary
from coordinator.sim import SimConfig, SimEngineGroup
from coordinator.sim.workload import ChatConfig, DocumentsConfig

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # ipc socket paths must fit in 108 bytes; pytest's tmp_path may not.
    path = Path(tempfile.mkdtemp(prefix="dpl-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _launch(where: Path, engines: int, frontends: int, *extra: str) -> CoordinatorHandle:
    return launch(engines=engines, frontends=frontends, addr_file=str(where / "coord.json"),
                  extra_args=["--ipc-dir", str(where / "ipc"), *extra], timeout=20.0)


def _env() -> dict[str, str]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def test_help_says_how_to_run_it_and_bad_arguments_are_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "coordinator.loadgen", "--help"],
                            capture_output=True, text=True, timeout=30, env=_env(), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m coordinator.loadgen")
    for words in ("--addr-file", "--workload", "chat", "documents", "Exit status"):
        assert words in result.stdout, words
    for bad in (["--addr-file", "x", "--workload", "nope"],
                ["--addr-file", "x", "--user-tokens", "9,3"],
                ["--addr-file", "x", "--concurrency", "0"],
                []):
        refused = subprocess.run([sys.executable, "-m", "coordinator.loadgen", *bad],
                                 capture_output=True, text=True, timeout=30, env=_env(),
                                 check=False)
        assert refused.returncode == 2 and "usage:" in refused.stderr, bad


@pytest.mark.parametrize("workload", ["poisson", "chat"])
async def test_the_shutdown_notice_stops_the_load_at_once_and_nothing_is_lost(
        short_tmp: Path, workload: str) -> None:
    handle = _launch(short_tmp, 2, 2)
    group = SimEngineGroup(handle.addresses["handshake"], 2, config=SimConfig(
        step_time_s=0.005, collective_timeout_s=5.0, on_hang="wait"))
    # Long requests, a long run: only the notice can end it in time.
    chat = ChatConfig(sessions=200, turns=5, system_prompt_tokens=32, user_tokens=(4, 8),
                      answer_tokens=(400, 600), think_s=0.0)
    config = LoadConfig(frontends=2, rate=100.0, duration_s=60.0, steps_median=400,
                        steps_sigma=0.1, steps_max=600, drain_timeout_s=30.0, seed=5,
                        workload=workload, chat=chat, concurrency=40)
    gen = LoadGenerator(handle.addresses, config)
    try:
        await asyncio.wait_for(asyncio.gather(gen.start(), group.start()), 20.0)
        await gen.wait_ready(timeout_s=10.0)
        run = asyncio.ensure_future(gen.run())
        while sum(1 for r in gen.records.values() if r.rank is not None) < 20:
            assert not run.done()
            await asyncio.sleep(0.05)
        handle.process.send_signal(signal.SIGTERM)
        told = time.monotonic()
        # Against a 60 s run: the notice ends it within the bound, with room for a
        # loaded machine.
        summary = await asyncio.wait_for(run, 30.0)
    finally:
        await asyncio.wait_for(gen.close(), 10.0)
        await asyncio.wait_for(group.stop(), 20.0)
        handle.shutdown(timeout=5.0)
    assert summary.shutdown_reason is not None
    assert summary.lost == 0 and summary.lost_ids == [] and summary.healthy
    assert summary.ended_by_shutdown > 0
    assert summary.completed + summary.failed + summary.ended_by_shutdown >= summary.submitted
    # Nothing was submitted once the notice was in.
    assert max(r.submitted_at for r in gen.records.values()) < told + 5.0
    assert summary.load_seconds < 30


async def _run_against_sim(where: Path, engines: int, config: LoadConfig,
                           sim: SimConfig) -> tuple[LoadSummary, list[dict[str, int]]]:
    handle = _launch(where, engines, config.frontends)
    group = SimEngineGroup(handle.addresses["handshake"], engines, config=sim)
    gen = LoadGenerator(handle.addresses, config)
    try:
        await asyncio.wait_for(asyncio.gather(gen.start(), group.start()), 20.0)
        await gen.wait_ready(timeout_s=10.0)
        summary = await asyncio.wait_for(gen.run(), 60.0)
        engines_said = [e.summary() for e in group.engines]
    finally:
        await asyncio.wait_for(gen.close(), 10.0)
        await asyncio.wait_for(group.stop(), 20.0)
        handle.shutdown(timeout=5.0)
    return summary, engines_said


async def test_one_turn_at_a_time_on_one_rank_reuses_exactly_the_ideal(
        short_tmp: Path) -> None:
    """Each turn finds its whole history in the cache, and the shared system prompt."""
    chat = ChatConfig(sessions=3, turns=3, system_prompts=1, system_prompt_tokens=96,
                      user_tokens=(5, 40), answer_tokens=(3, 30), think_s=0.0)
    config = LoadConfig(frontends=1, workload="chat", chat=chat, concurrency=1,
                        duration_s=30.0, block_size=16, seed=11)
    summary, engines = await _run_against_sim(
        short_tmp, 1, config, SimConfig(step_time_s=0.002, block_size=16, kv_blocks=4096))
    assert summary.completed == summary.submitted == 9 and summary.healthy
    assert summary.sessions_started == 3
    assert summary.ideal_reusable_tokens is not None and summary.ideal_reusable_tokens > 0
    assert summary.hit_tokens == summary.ideal_reusable_tokens
    assert summary.ideal_fraction == 1.0
    assert summary.queried_tokens == summary.prompt_tokens == engines[0]["prompt_tokens"]
    assert summary.hit_tokens == engines[0]["hit_tokens"]
    assert summary.prefill_tokens == summary.prompt_tokens - summary.hit_tokens
    assert summary.ttft_ms_p50 is not None and summary.ttft_ms_p99 is not None
    assert summary.per_rank[0].hit_tokens == summary.hit_tokens


async def test_documents_over_two_ranks_report_reuse_from_the_engines(short_tmp: Path) -> None:
    documents = DocumentsConfig(documents=2, document_tokens=256, questions=12,
                                question_tokens=(8, 24), answer_tokens=(2, 8))
    config = LoadConfig(frontends=2, workload="documents", documents=documents,
                        concurrency=3, duration_s=30.0, block_size=16, seed=3,
                        kv_capacity_blocks=2048)
    summary, engines = await _run_against_sim(
        short_tmp, 2, config, SimConfig(step_time_s=0.002, block_size=16, kv_blocks=2048,
                                         collective_timeout_s=5.0))
    assert summary.completed == summary.submitted == 12 and summary.healthy
    assert summary.workload == "documents" and summary.sessions_started == 12
    assert summary.hit_tokens == sum(e["hit_tokens"] for e in engines) > 0
    assert summary.ideal_reusable_tokens is not None
    assert summary.hit_tokens <= summary.ideal_reusable_tokens
    # Two documents of 256 tokens: everything after each document's first reading.
    assert summary.ideal_reusable_tokens >= 10 * 256
    assert summary.ttft_ms_p99 is not None
    assert sum(w.hit_tokens for w in summary.per_rank.values()) == summary.hit_tokens


def test_the_command_line_runs_a_chat_workload_and_prints_json(short_tmp: Path) -> None:
    handle = _launch(short_tmp, 2, 1)
    sim = subprocess.Popen(
        [sys.executable, "-m", "coordinator.sim", "group", "--engines", "2",
         "--addr-file", str(short_tmp / "coord.json"), "--step-ms", "2",
         "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        result = subprocess.run(
            [sys.executable, "-m", "coordinator.loadgen", "--addr-file",
             str(short_tmp / "coord.json"), "--frontends", "1", "--workload", "chat",
             "--sessions", "4", "--turns", "2", "--system-prompt-tokens", "64",
             "--user-tokens", "8,16", "--answer-tokens", "4,8", "--think", "0.01",
             "--concurrency", "2", "--duration", "20", "--seed", "2", "--json"],
            capture_output=True, text=True, timeout=60, env=_env(), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads(result.stdout)
        assert summary["workload"] == "chat" and summary["completed"] == 8
        assert summary["prompt_tokens"] > 0 and summary["ideal_reusable_tokens"] > 0
        assert summary["lost"] == 0 and summary["healthy"]
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.wait(20)
        handle.shutdown(timeout=5.0)
