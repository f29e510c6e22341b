"""What `status` and `top` show: widths that cut nothing, `drained`, one meaning of dispatched.

The table checks render the real views into fixed-width consoles; the others
run the commands against a real coordinator process with engines that did the
whole handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence

import pytest
from rich.console import Console

from coordinator.cli import main
from coordinator.cli.status import state_tables
from coordinator.cli.top import Rates, TopFrame, TopRank, render
from coordinator.engine import EngineAgent
from coordinator.frontend import FrontendClient
from coordinator.launch import CoordinatorHandle
from coordinator.protocol import frontend as fp
from tests.conftest import CoordinatorFactory

pytestmark = pytest.mark.timeout(60)

STEP = 10.0
STATES = ["ready", "handshaking", "draining", "cordoned", "dead", "absent"]


def rendered(renderable: object, width: int) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(renderable)
    return buffer.getvalue()


def wide_state() -> fp.GroupState:
    """Every state, with the widest values a busy group shows."""
    engines = [fp.EngineStatus(rank, state, None if state == "absent" else "9f" * 16,
                               waiting=99999, running=9999, kv_cache_usage=1.0,
                               dispatched_since_report=9999, in_flight=99999,
                               last_seen_age_s=9999.9)
               for rank, state in enumerate(STATES)]
    return fp.GroupState(wave=4_000_000_000, running=True, lockstep=True, rank_start=0,
                         rank_count=len(engines), frontends=64, in_flight=999_999,
                         engines=engines,
                         counters={"refused.handshake.parallel_config_mismatch": 12})


def test_status_says_which_vllm_the_ranks_run_and_flags_a_mix() -> None:
    def state(*versions: str | None) -> fp.GroupState:
        engines = [fp.EngineStatus(rank, "ready", None, 0, 0, 0.0, 0, 0, 1.0, version)
                   for rank, version in enumerate(versions)]
        return fp.GroupState(wave=0, running=False, lockstep=True, rank_start=0,
                             rank_count=len(engines), frontends=0, in_flight=0,
                             engines=engines, counters={})

    assert "vLLM" not in rendered(state_tables(state(None, None)), 80)
    assert "vLLM 0.33.0 on every rank that greeted" in rendered(
        state_tables(state("0.33.0", None, "0.33.0")), 80)
    text = rendered(state_tables(state("0.33.0", "0.32.0", "0.33.0")), 100)
    assert "vLLM versions differ: 0.33.0 on rank 0, 2; 0.32.0 on rank 1" in text
    assert "outside the supported" not in text
    text = rendered(state_tables(state("0.34.0", "0.34.0")), 120)
    assert "vLLM 0.34.0 on every rank that greeted (0.34.0 outside the supported 0.29.x to " \
        "0.33.x)" in text
    text = rendered(state_tables(state("0.28.0", "0.32.0")), 120)
    assert "0.28.0 on rank 0; 0.32.0 on rank 1 (0.28.0 outside the supported" in text


def row_lines(text: str, rank_count: int) -> list[str]:
    """The table line that starts each rank's row."""
    lines = text.splitlines()
    found = []
    for rank in range(rank_count):
        (line,) = [line for line in lines if line.split()[:1] == [str(rank)]
                   and len(line.split()) > 1 and line.split()[1] in {*STATES, "drained"}]
        found.append(line)
    return found


@pytest.mark.parametrize("width", [80, 100])
def test_status_fits_every_value_on_one_line_per_rank(width: int) -> None:
    text = rendered(state_tables(wide_state()), width)
    assert "…" not in text
    for line, state in zip(row_lines(text, len(STATES)), STATES, strict=True):
        cells = line.split()
        assert cells[1] == state
        assert cells[3:9] == ["99999", "9999", "100%", "9999", "99999", "9999.9s"], line
        assert len(line) <= width


def test_status_on_a_narrow_screen_wraps_values_and_never_cuts_a_state() -> None:
    text = rendered(state_tables(wide_state()), 50)
    assert "…" not in text
    for line, state in zip(row_lines(text, len(STATES)), STATES, strict=True):
        assert line.split()[1] == state


def top_frame(ranks: Sequence[TopRank]) -> TopFrame:
    return TopFrame(taken_at=0.0, source="http://127.0.0.1:9400/state", wave=4_000_000_000,
                    running=True, lockstep=True, ranks=list(ranks),
                    counters={"submit.dispatched": 9_999_999}, waves_total=9_999_999,
                    watchdog=[], frontends=64)


def test_top_fits_80_columns_and_cuts_nothing() -> None:
    ranks = [TopRank(rank, state, 99999, 9999, 1.0, 99999, 9_999_999, None, 9999.9)
             for rank, state in enumerate(STATES)]
    text = rendered(render(top_frame(ranks), Rates(99999.9, 99.9)), 80)
    assert "…" not in text
    for line, state in zip(row_lines(text, len(STATES)), STATES, strict=True):
        assert line.split()[1:8] == [state, "99999", "9999", "100%", "9999999", "99999",
                                     "9999.9s"], line


def test_a_draining_rank_is_drained_once_nothing_is_in_flight() -> None:
    engines = [fp.EngineStatus(0, "draining", "a", 0, 0, 0.0, 0, 0, 1.0),
               fp.EngineStatus(1, "draining", "b", 0, 1, 0.0, 0, 1, 1.0)]
    state = fp.GroupState(0, False, True, 0, 2, 0, 1, engines, {})
    assert [line.split()[1] for line in row_lines(rendered(state_tables(state), 80), 2)] == [
        "drained", "draining"]
    frame = top_frame([TopRank(0, "draining", 0, 0, 0.0, 0, 3, None, 1.0),
                       TopRank(1, "draining", 0, 1, 0.0, 1, 3, None, 1.0)])
    assert [line.split()[1] for line in row_lines(rendered(render(frame, Rates()), 80), 2)] == [
        "drained", "draining"]


# ---- against a running coordinator ---------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def ready_engines(handle: CoordinatorHandle, count: int) -> AsyncIterator[None]:
    agents = [EngineAgent(handle.addresses["handshake"], rank, handshake_timeout_s=STEP,
                          ready_timeout_s=STEP, accept_timeout_s=STEP) for rank in range(count)]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 2 * STEP)
        yield
    finally:
        for agent in agents:
            await agent.close(linger_s=0)


def run_cli(capsys: pytest.CaptureFixture[str], args: Sequence[str]) -> str:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


async def test_a_drained_rank_shows_drained_in_status_and_top(
    coordinator: CoordinatorFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = coordinator(2)
    addr = ["--addr-file", handle.addr_file]
    async with ready_engines(handle, 2):
        out = await asyncio.to_thread(run_cli, capsys, ["drain", "1", *addr])
        assert "dp_rank=1 is now draining" in out
        raw = json.loads(await asyncio.to_thread(run_cli, capsys, ["status", "--json", *addr]))
        assert [e["state"] for e in raw["engines"]] == ["ready", "draining"]  # the wire's word
        shown = await asyncio.to_thread(run_cli, capsys, ["status", *addr])
        assert [line.split()[1] for line in row_lines(shown, 2)] == ["ready", "drained"]
        shown = await asyncio.to_thread(run_cli, capsys, ["top", "--once", *addr])
        assert [line.split()[1] for line in row_lines(shown, 2)] == ["ready", "drained"]


def wait_http(port: int) -> None:
    deadline = time.monotonic() + STEP
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1.0):
                return
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline, "the metrics endpoint never answered"
            time.sleep(0.05)


async def test_top_says_dispatched_for_the_same_quantity_over_either_source(
    coordinator: CoordinatorFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    handle = coordinator(2, extra_args=["--metrics-port", str(port)])
    await asyncio.to_thread(wait_http, port)
    async with ready_engines(handle, 2):
        client = FrontendClient(handle.addresses, call_timeout_s=STEP)
        try:
            for index, rank in enumerate((0, 1, 1)):
                await client.submit(f"r{index}", [b"payload"], dp_rank=rank)
        finally:
            await client.close()
        deadline = time.monotonic() + STEP
        while True:  # /state is a snapshot the coordinator refreshes on its own schedule
            over_url = await asyncio.to_thread(
                run_cli, capsys, ["top", "--once", "--url", f"http://127.0.0.1:{port}"])
            if "dispatched in total 3" in over_url or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        over_socket = await asyncio.to_thread(
            run_cli, capsys, ["top", "--once", "--addr-file", handle.addr_file])
    for out in (over_url, over_socket):
        assert "dispatched in total 3" in out, out
        assert "dispatched: requests sent since the coordinator started" in out
    # Per rank: the totals where the source has them, and "-" (not another number) where not.
    assert [line.split()[5] for line in row_lines(over_url, 2)] == ["1", "2"], over_url
    assert [line.split()[5] for line in row_lines(over_socket, 2)] == ["-", "-"], over_socket
