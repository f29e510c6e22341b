"""The KV bootstrap registry through the real process (``serve --kv-bootstrap-port``).

Prefill workers are played by real ZeroMQ ROUTER sockets on tcp://127.0.0.1, bound
to random ports as vLLM's Mooncake connector binds its side channel, and register
over real HTTP; a decoder's view is a real ``GET /query``. The coordinator is a
real process, killed with SIGKILL where a test says so.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator.launch import CoordinatorHandle, launch
from tests.vllm_peers import wait_until

Ctx = zmq.Context[zmq.Socket[bytes]]


class SideChannel:
    """One prefill worker's side channel: a ROUTER socket on a random port."""

    def __init__(self, ctx: Ctx) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"

    def close(self) -> None:
        self.sock.close(linger=0)


def request(url: str, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, object]:
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def register(url: str, engine_id: str, dp: int, tp: int, addr: str,
             pp: int = 0) -> tuple[int, object]:
    body = json.dumps({"engine_id": engine_id, "dp_rank": dp, "tp_rank": tp, "pp_rank": pp,
                       "addr": addr}).encode()
    return request(url, "POST", "/register", body, {"content-type": "application/json"})


def query(url: str) -> dict[str, object]:
    status, body = request(url, "GET", "/query")
    assert status == 200
    assert isinstance(body, dict)
    return body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(tmp_path: Path, *extra: str, port: int = 0, state: bool = False,
          tp_size: int = 2) -> CoordinatorHandle:
    args = ["--kv-bootstrap-port", str(port), "--kv-bootstrap-tp-size", str(tp_size),
            "--metrics-port", "0", *extra]
    if state:
        args += ["--state-file", str(tmp_path / "state.json")]
    return launch(engines=2, addr_file=str(tmp_path / "addresses.json"), extra_args=args,
                  timeout=30.0)


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def channels(ctx: Ctx) -> Iterator[list[SideChannel]]:
    made: list[SideChannel] = []
    yield made
    for channel in made:
        channel.close()


def engine(ctx: Ctx, made: list[SideChannel], tp_size: int = 2) -> list[SideChannel]:
    workers = [SideChannel(ctx) for _ in range(tp_size)]
    made.extend(workers)
    return workers


def register_engine(url: str, engine_id: str, dp: int, workers: list[SideChannel]) -> None:
    for tp, worker in enumerate(workers):
        assert register(url, engine_id, dp, tp, worker.addr) == (200, {"status": "ok"})


def expected(engine_id: str, workers: list[SideChannel]) -> dict[str, object]:
    return {"engine_id": engine_id,
            "worker_addr": {str(tp): {"0": worker.addr} for tp, worker in enumerate(workers)}}


def counters(handle: CoordinatorHandle) -> dict[str, int]:
    base = handle.stderr_text()
    assert "metrics and state on" in base
    url = base.split("metrics and state on ", 1)[1].split()[0]
    status, body = request(url, "GET", "/state")
    assert status == 200 and isinstance(body, dict)
    found: dict[str, int] = body["counters"]
    return found


def state_view(handle: CoordinatorHandle) -> list[dict[str, object]]:
    url = handle.stderr_text().split("metrics and state on ", 1)[1].split()[0]
    _, body = request(url, "GET", "/state")
    assert isinstance(body, dict)
    view: list[dict[str, object]] = body.get("kv_bootstrap", [])
    return view


def metrics_text(handle: CoordinatorHandle) -> str:
    url = handle.stderr_text().split("metrics and state on ", 1)[1].split()[0]
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=20)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_two_dp_by_two_tp_prefill_workers_register_and_a_decoder_sees_them(
        tmp_path: Path, ctx: Ctx, channels: list[SideChannel]) -> None:
    handle = start(tmp_path)
    try:
        url = handle.addresses["kv_bootstrap"]
        assert request(url, "GET", "/health") == (200, {"status": "ok"})
        first, second = engine(ctx, channels), engine(ctx, channels)
        register_engine(url, "engine-a", 0, first)
        register_engine(url, "engine-b", 1, second)
        assert query(url) == {"0": expected("engine-a", first), "1": expected("engine-b", second)}
        # An identical retry (a client timeout after the server recorded it) is ok.
        assert register(url, "engine-a", 0, 1, first[1].addr) == (200, {"status": "ok"})
        wait_until(lambda: counters(handle).get("kv_bootstrap.registrations") == 4,
                   timeout=10, what="the registrations in /state")
        assert counters(handle)["kv_bootstrap.retries"] == 1
    finally:
        handle.shutdown()


def test_a_restarted_engine_replaces_its_entry_once_its_old_side_channel_is_gone(
        tmp_path: Path, ctx: Ctx, channels: list[SideChannel]) -> None:
    handle = start(tmp_path)
    try:
        url = handle.addresses["kv_bootstrap"]
        old, other = engine(ctx, channels), engine(ctx, channels)
        register_engine(url, "engine-a", 0, old)
        register_engine(url, "engine-b", 1, other)
        # The engine restarts: its old process (and side channels) gone, a new engine id,
        # new ports. vLLM's own server would refuse it until it was restarted itself.
        began = time.monotonic()
        for worker in old:
            worker.close()
        new = engine(ctx, channels)
        register_engine(url, "engine-a2", 0, new)
        took = time.monotonic() - began
        assert query(url) == {"0": expected("engine-a2", new), "1": expected("engine-b", other)}
        print(f"\nrestart to re-registration of both TP workers: {took * 1000:.1f} ms")
        wait_until(lambda: counters(handle).get("kv_bootstrap.replacements") == 1,
                   timeout=10, what="the replacement in /state")
        assert "engine engine-a2 replaces engine-a" in handle.stderr_text()
        # /state is a snapshot the loop refreshes: wait for one taken after the second worker.
        entry = wait_until(
            lambda: [item for item in state_view(handle) if item["dp_rank"] == 0
                     and item["state"] == "live"], timeout=10, what="the new entry live in /state")
        assert entry[0]["engine_id"] == "engine-a2"
        metrics = metrics_text(handle)
        assert "dp_coordinator_kv_bootstrap_replacements_total 1.0" in metrics
        assert 'dp_coordinator_kv_bootstrap_entries{state="live"} 2.0' in metrics
    finally:
        handle.shutdown()


def test_two_live_engines_claiming_one_dp_rank_are_refused_with_the_remedy(
        tmp_path: Path, ctx: Ctx, channels: list[SideChannel]) -> None:
    handle = start(tmp_path)
    try:
        url = handle.addresses["kv_bootstrap"]
        holder, intruder = engine(ctx, channels), engine(ctx, channels)
        register_engine(url, "engine-a", 0, holder)
        before = query(url)
        status, body = register(url, "engine-x", 0, 0, intruder[0].addr)
        assert status == 400 and isinstance(body, dict)
        detail = body["detail"]
        for part in ("engine-a", "engine-x", holder[0].addr, "--data-parallel-rank"):
            assert part in detail
        # The same slot of the holder at a live other address: refused as well.
        status, _ = register(url, "engine-a", 0, 1, intruder[1].addr)
        assert status == 400
        assert query(url) == before
        wait_until(lambda: counters(handle).get("kv_bootstrap.conflicts") == 2, timeout=10,
                   what="the conflicts in /state")
    finally:
        handle.shutdown()


def test_a_killed_coordinator_restarted_with_its_state_file_still_answers_the_query(
        tmp_path: Path, ctx: Ctx, channels: list[SideChannel]) -> None:
    port = free_port()
    handle = start(tmp_path, port=port, state=True)
    second: CoordinatorHandle | None = None
    try:
        url = handle.addresses["kv_bootstrap"]
        live, doomed = engine(ctx, channels), engine(ctx, channels)
        register_engine(url, "engine-a", 0, live)
        register_engine(url, "engine-b", 1, doomed)
        state_file = tmp_path / "state.json"
        wait_until(lambda: state_file.exists() and len(json.loads(
            state_file.read_text()).get("kv_bootstrap", [])) == 2, timeout=10,
            what="both entries in the state file")
        os.kill(handle.pid, signal.SIGKILL)
        handle.process.wait(10)
        # Engine B died with the coordinator down: the restart's probe finds it gone.
        for worker in doomed:
            worker.close()
        second = start(tmp_path, port=port, state=True)
        url = second.addresses["kv_bootstrap"]
        wait_until(lambda: query(url) == {"0": expected("engine-a", live)}, timeout=15,
                   what="the restored entry, with the gone one dropped")
    finally:
        handle.shutdown()
        if second is not None:
            second.shutdown()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_garbage_and_oversize_flood_is_refused_and_valid_registrations_still_served(
        tmp_path: Path, ctx: Ctx, channels: list[SideChannel]) -> None:
    handle = start(tmp_path)
    try:
        url = handle.addresses["kv_bootstrap"]
        parsed = urllib.parse.urlsplit(url)
        target = (parsed.hostname or "127.0.0.1", parsed.port or 0)
        first = engine(ctx, channels)
        register_engine(url, "engine-a", 0, first)
        baseline = rss_kib(handle.pid)
        bad_bodies = [b"{garbage", b"[]", b'{"engine_id": 1}', json.dumps(
            {"engine_id": "x" * 100_000, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
             "addr": "tcp://h:1"}).encode(), json.dumps(
            {"engine_id": "y", "dp_rank": 10**30, "tp_rank": 0, "pp_rank": 0,
             "addr": "tcp://h:1"}).encode()]
        statuses: set[int] = set()
        for round_ in range(40):
            for body in bad_bodies:
                status, _ = request(url, "POST", "/register", body)
                statuses.add(status)
            # Raw garbage, an oversize header block, a huge declared body, half a request.
            for raw in (b"\x00\xff garbage\r\n\r\n", b"GET /query HTTP/1.1\r\nX: "
                        + b"a" * 20_000 + b"\r\n\r\n",
                        b"POST /register HTTP/1.1\r\ncontent-length: 99999999\r\n\r\n",
                        b"POST /register HTTP/1.1\r\ncontent-le"):
                with socket.create_connection(target, timeout=20) as sock:
                    sock.sendall(raw)
                    sock.shutdown(socket.SHUT_WR)
                    while sock.recv(65536):
                        pass
            if round_ % 10 == 0:
                assert query(url) == {"0": expected("engine-a", first)}
        assert statuses <= {413, 422} and 422 in statuses and 413 in statuses
        # Every bad request changed nothing; a valid one is still served.
        second = engine(ctx, channels)
        register_engine(url, "engine-b", 1, second)
        assert query(url) == {"0": expected("engine-a", first), "1": expected("engine-b", second)}
        grown = rss_kib(handle.pid) - baseline
        print(f"\nresident memory after the flood: {grown:+d} KiB")
        assert grown < 32 * 1024, f"the coordinator grew by {grown} KiB under the flood"
        # /state is a snapshot the loop refreshes: wait for one taken after the flood.
        wait_until(lambda: counters(handle).get("kv_bootstrap.refused.bad_payload", 0) >= 40 * 4,
                   timeout=10, what="every bad payload counted in /state")
    finally:
        handle.shutdown()


def silent_side_channel() -> tuple[socket.socket, list[socket.socket], str]:
    """A port that takes no new connection and refuses none (a host that drops packets):
    a listener whose accept queue is full, so the kernel drops further SYNs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    return listener, fillers, f"tcp://127.0.0.1:{port}"


def test_a_silent_old_holder_is_replaced_after_the_probes_bound(
        tmp_path: Path, ctx: Ctx, channels: list[SideChannel]) -> None:
    handle = start(tmp_path, "--kv-bootstrap-probe-timeout-s", "1", tp_size=1)
    listener, fillers, silent = silent_side_channel()
    try:
        url = handle.addresses["kv_bootstrap"]
        assert register(url, "engine-a", 0, 0, silent) == (200, {"status": "ok"})
        new = engine(ctx, channels, tp_size=1)
        began = time.monotonic()
        assert register(url, "engine-a2", 0, 0, new[0].addr) == (200, {"status": "ok"})
        took = time.monotonic() - began
        print(f"\nre-registration with a silent old holder (probe bound 1 s): "
              f"{took * 1000:.0f} ms")
        assert query(url) == {"0": expected("engine-a2", new)}
        assert took < 15.0  # bounded by the probe, not by the peer
    finally:
        handle.shutdown()
        for sock in [*fillers, listener]:
            sock.close()


def raw_exchange(target: tuple[str, int], data: bytes) -> bytes:
    """Send ``data``, half-close, read everything the server sends until it closes."""
    with socket.create_connection(target, timeout=20) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_http_server_keeps_connections_alive_and_refuses_what_it_cannot_read(
        tmp_path: Path, ctx: Ctx, channels: list[SideChannel]) -> None:
    handle = start(tmp_path, tp_size=1)
    try:
        url = handle.addresses["kv_bootstrap"]
        parsed = urllib.parse.urlsplit(url)
        target = (parsed.hostname or "127.0.0.1", parsed.port or 0)
        [worker] = engine(ctx, channels, tp_size=1)
        body = json.dumps({"engine_id": "engine-a", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                           "addr": worker.addr}).encode()
        # Two requests on one connection, the second after an Expect: 100-continue.
        reply = raw_exchange(target, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
                             b"POST /register HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert reply.count(b"HTTP/1.1 200 OK") == 2 and b"HTTP/1.1 100 Continue" in reply
        assert query(url) == {"0": expected("engine-a", [worker])}
        # HTTP/1.0 without keep-alive: one answer, then the server closes.
        reply = raw_exchange(target, b"GET /query HTTP/1.0\r\n\r\nGET /query HTTP/1.0\r\n\r\n")
        assert reply.count(b"HTTP/1.1 200 OK") == 1 and b"connection: close" in reply
        for request_bytes, status in (
                (b"POST /register HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n", b"411"),
                (b"POST /register HTTP/1.1\r\ncontent-length: -1\r\n\r\n", b"400"),
                (b"GET /query SPDY/3\r\n\r\n", b"505"),
                (b"nonsense\r\n\r\n", b"400")):
            reply = raw_exchange(target, request_bytes)
            assert reply.startswith(b"HTTP/1.1 " + status), (request_bytes, reply)
            assert b'"detail"' in reply
        assert query(url) == {"0": expected("engine-a", [worker])}
    finally:
        handle.shutdown()
