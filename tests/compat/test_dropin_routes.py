"""What docs/vllm.md says about the plugin route, checked on the drop-in.

The drop-in is built the way vLLM's launcher builds its coordinator, stock
vLLM-shaped engines pass the gate on its engine sockets and report stats, and
then the document's claims are tried from outside, with the command line a
reader would use: the coordinator's address file is published under vLLM's RPC
base path, and `status` and `top` find it with no arguments and show the ranks' loads,
with every rank `absent`; `/healthz` answers 200 and `/readyz` never does;
`cordon` is refused. The `serve` commands the document shows parse.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator.cli import build_parser
from coordinator.vllm_compat import DPCoordinatorProcess
from tests.vllm_peers import READY, RawEngine, stats_report

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "coordinator"]


class Config:
    data_parallel_size = 2
    data_parallel_size_local = 2
    data_parallel_master_ip = "127.0.0.1"
    data_parallel_master_port = 29533
    data_parallel_external_lb = False
    data_parallel_hybrid_lb = False
    enable_elastic_ep = False
    local_engines_only = False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def plugin_route(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[DPCoordinatorProcess, int]]:
    """A drop-in with metrics on, its launch directory and vLLM's RPC base path in a
    private temp dir, and two engines past the gate; rank 0 reported (waiting 3, running 1)."""
    scratch = tempfile.mkdtemp(prefix="tmp-")
    port = free_port()
    monkeypatch.setattr(tempfile, "tempdir", scratch)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", scratch)
    monkeypatch.setenv("DP_COORDINATOR_SERVE_ARGS", f"--metrics-port {port}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    coord = DPCoordinatorProcess(Config(), log_sink=None, startup_timeout=20.0)
    try:
        coord_in, coord_out = coord.get_engine_socket_addresses()
        engines = [RawEngine(ctx, {"back_publish": coord_in, "back_output": coord_out,
                                   "dispatch": coord.addresses["dispatch"]}, rank, dp_size=2,
                             handshake=False) for rank in range(2)]
        for engine in engines:
            engine.connect_plane()
            engine.subscribe()
        for engine in engines:
            assert engine.expect_publish() == [READY]
        engines[0].report(stats_report(0, waiting=3, running=1))
        yield coord, port
    finally:
        coord.shutdown(timeout=0.0)
        ctx.destroy(linger=0)
        monkeypatch.undo()
        leftovers = os.listdir(scratch)
        os.rmdir(scratch) if not leftovers else None
        assert leftovers == []


def test_a_plugin_started_coordinator_is_found_and_shown_as_documented(
    plugin_route: tuple[DPCoordinatorProcess, int],
) -> None:
    coord, port = plugin_route
    # "dp-coordinator-<port>.json in vLLM's RPC base path", port = data_parallel_master_port
    (found,) = glob.glob(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "dp-coordinator-*.json"))
    assert os.path.basename(found) == "dp-coordinator-29533.json" == \
        os.path.basename(coord.discovery_file or "")

    deadline = time.monotonic() + 5.0
    while True:  # the stats report is in once status, with no arguments, shows it
        status = run("status", "--json")
        assert status.returncode == 0, status.stderr
        state = json.loads(status.stdout)
        if state["engines"][0]["waiting"] == 3:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    assert [e["state"] for e in state["engines"]] == ["absent", "absent"]
    assert state["engines"][0]["running"] == 1
    assert state["in_flight"] == 0 and state["frontends"] == 0

    for top in (run("top", "--once"), run("top", "--once", "--url", f"http://127.0.0.1:{port}")):
        assert top.returncode == 0, top.stderr
        assert re.search(r"^\s*0\s+absent\s+3\s+1\b", top.stdout, re.MULTILINE), top.stdout

    base = f"http://127.0.0.1:{port}"
    assert http_status(base + "/healthz") == 200
    assert http_status(base + "/readyz") == 503  # the ranks registered with vLLM's launcher

    cordon = run("cordon", "1", "--addr-file", found)
    assert cordon.returncode != 0
    assert "no live engine holds it" in cordon.stdout + cordon.stderr


def documented_commands(name: str) -> list[list[str]]:
    """Every `dp-coordinator serve ...` command in a code block of docs/`name`."""
    text = (REPO / "docs" / name).read_text()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["dp-coordinator", "serve"]:
                commands.append(words[1:])
    return commands


def test_the_documented_serve_commands_parse() -> None:
    commands = documented_commands("vllm.md")
    assert commands
    for argv in commands:
        args = build_parser().parse_args(argv)
        # Only stock front_publish readers in these examples: INIT must not wait.
        assert args.frontends == 0, argv
        if args.master_ip is not None:
            assert args.master_port is not None
