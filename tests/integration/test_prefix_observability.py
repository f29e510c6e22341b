"""What operators see of prefix-cache routing, from a real coordinator process:
/metrics, /state and `dp-coordinator top`.

No engine registers with this coordinator, as in the vLLM plugin route: ranks
are chosen by `route` calls, and publishers (``tests.integration.kv_publishers``)
feed the index.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from coordinator.cli.top import HttpSource, Rates, render
from coordinator.launch import launch
from coordinator.protocol import frontend as fp
from coordinator.protocol.kv_events import BlockStored
from tests.integration.kv_publishers import bind_publishers

pytestmark = pytest.mark.timeout(60)

STEP = 5.0
BLOCK = 16


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fetch(url: str) -> str:
    """The body, or "" while the coordinator has published no snapshot yet (503)."""
    try:
        with urllib.request.urlopen(url, timeout=STEP) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return ""
        raise


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + STEP
    while not await check():
        assert time.monotonic() < deadline, f"not within {STEP} s: {what}"
        await asyncio.sleep(0.05)


async def test_metrics_state_and_top_show_the_index_and_the_decisions(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    publishers, live, replay = bind_publishers(ctx, 2)
    port = free_port()
    handle = launch(engines=2, addr_file=str(tmp_path / "addresses.json"), timeout=20.0,
                    host="127.0.0.1",
                    extra_args=["--policy", "prefix", "--kv-events-endpoint", f"tcp://*:{live}",
                                "--kv-events-replay-endpoint", f"tcp://*:{replay}",
                                "--kv-block-size", str(BLOCK), "--metrics-port", str(port)])
    client = ctx.socket(zmq.DEALER)  # a frontend that only asks for ranks, as vLLM's do
    client.setsockopt(zmq.LINGER, 0)
    client.connect(handle.addresses["frontend"])
    base = f"http://127.0.0.1:{port}"
    try:
        for publisher in publishers:
            await publisher.wait_subscribed()
        prompt = list(range(500, 500 + 3 * BLOCK))
        publishers[1].publish(BlockStored([1, 2, 3], None, prompt, BLOCK, None, "GPU", None))

        async def indexed() -> bool:
            body = await asyncio.to_thread(fetch, base + "/state")
            return bool(body) and json.loads(body)["prefix"]["ranks"][1]["blocks"] == 3

        await eventually(indexed, "rank 1's blocks in /state")
        await client.send(fp.encode(fp.Route(1, "q1", None, fp.PromptKeys([*prompt, 9]))))
        assert await client.poll(int(STEP * 1000))
        routed = fp.decode_reply(await client.recv())
        assert routed == fp.Routed(1, "q1", 1, "prefix")

        async def decided() -> bool:
            text = await asyncio.to_thread(fetch, base + "/metrics")
            return samples(text).get(("dp_coordinator_route_queries_total", ()), 0) == 1

        await eventually(decided, "the route call in /metrics")
        scraped = samples(await asyncio.to_thread(fetch, base + "/metrics"))
        rank = (("rank", "1"),)
        assert scraped["dp_coordinator_prefix_index_blocks", rank] == 3
        assert scraped["dp_coordinator_prefix_index_blocks", (("rank", "0"),)] == 0
        assert scraped["dp_coordinator_kv_stream_state", (("rank", "1"), ("state", "live"))] == 1
        assert scraped["dp_coordinator_kv_stream_state", (("rank", "0"), ("state", "sync"))] == 1
        assert scraped["dp_coordinator_kv_events_batches_total", rank] == 1
        assert scraped["dp_coordinator_kv_events_total", (("kind", "stored"),)] == 1
        assert scraped["dp_coordinator_route_decisions_total", (("reason", "prefix"),)] == 1
        assert scraped["dp_coordinator_route_cached_tokens_total", ()] == 3 * BLOCK
        assert scraped["dp_coordinator_route_prompt_tokens_total", ()] == 3 * BLOCK + 1
        assert scraped["dp_coordinator_prefix_index_memory_bytes", ()] > 0
        # Each connection caught up by a replay from 0, which had nothing to miss.
        assert scraped["dp_coordinator_kv_events_replay_requests_total", ()] == 2
        assert scraped["dp_coordinator_kv_events_replays_total", (("outcome", "filled"),)] == 2
        assert scraped["dp_coordinator_kv_events_replays_total", (("outcome", "timed_out"),)] == 0
        # The route call was timed.
        assert scraped["dp_coordinator_route_decision_seconds_count", ()] == 1
        assert scraped["dp_coordinator_route_decision_seconds_bucket", (("le", "+Inf"),)] == 1

        state = json.loads(await asyncio.to_thread(fetch, base + "/state"))
        assert state["policy"] == "prefix"
        prefix = state["prefix"]
        assert prefix["block_size"] == BLOCK and prefix["total_blocks"] == 3
        assert prefix["decisions"] == {"prefix": 1}
        assert prefix["hit_ratio"] == pytest.approx(48 / 49, abs=1e-4)
        assert prefix["ranks"][1]["stream"] == "live"
        assert prefix["ranks"][1]["publisher"] == f"tcp://127.0.0.1:{live + 1}"

        frame = await asyncio.to_thread(HttpSource(base, STEP).fetch)
        buffer = io.StringIO()
        Console(file=buffer, width=160, color_system=None).print(render(frame, Rates()))
        text = buffer.getvalue()
        assert "prefix hits 98%" in text and "decided by prefix 1" in text
        assert "cached" in text and "index 3 blocks" in text
    finally:
        client.close(0)
        for publisher in publishers:
            publisher.close()
        ctx.term()
        assert handle.shutdown(timeout=5.0) == 0, handle.stderr_text()[-3000:]
