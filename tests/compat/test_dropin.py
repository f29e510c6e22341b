"""`DPCoordinatorProcess` used the way vLLM 0.33's launcher uses its `DPCoordinator`.

vLLM is not installed here: the launcher's side is played by a small stand-in
for its `ParallelConfig` (the attributes the launcher and the coordinator
read, with `local_engines_only` derived from the LB flags as vLLM derives it),
and the engines and front-end by the raw vLLM-shaped peers of
`tests/vllm_peers.py`, connected to the addresses the drop-in hands out.
"""

from __future__ import annotations

import gc
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import pytest
import zmq

from coordinator.vllm_compat import (
    IPC,
    TCP,
    CoordinatorProcess,
    DPCoordinatorProcess,
    ParallelSettings,
    open_exit_sentinel,
    plan_transports,
    resolve_parallel_settings,
)
from tests.vllm_peers import (
    READY,
    RawEngine,
    RawFrontend,
    engine_outputs,
    full_publish,
    is_wave_publish,
    start_dp_wave_frames,
    stats_report,
    unpack,
    wait_until,
    wave_publish,
)

Ctx = zmq.Context[zmq.Socket[bytes]]


@dataclass
class ParallelConfigStandIn:
    """The parts of vLLM 0.33's ParallelConfig the coordinator is built from."""

    data_parallel_size: int
    data_parallel_size_local: int
    data_parallel_master_ip: str = "127.0.0.1"
    data_parallel_external_lb: bool = False
    data_parallel_hybrid_lb: bool = False
    enable_elastic_ep: bool = False
    data_parallel_rpc_port: int = 29550

    @property
    def local_engines_only(self) -> bool:
        return self.data_parallel_external_lb or self.data_parallel_hybrid_lb


class DropInFactory(Protocol):
    def __call__(
        self, parallel_config: Any = None, enable_wave_coordination: bool = True, **kwargs: Any
    ) -> DPCoordinatorProcess: ...


@pytest.fixture
def dropin() -> Iterator[DropInFactory]:
    """Build drop-ins as vLLM does; every one is shut down in teardown."""
    made: list[DPCoordinatorProcess] = []

    def make(
        parallel_config: Any = None, enable_wave_coordination: bool = True, **kwargs: Any
    ) -> DPCoordinatorProcess:
        kwargs.setdefault("log_sink", None)
        kwargs.setdefault("startup_timeout", 20.0)
        coord = DPCoordinatorProcess(
            parallel_config, enable_wave_coordination=enable_wave_coordination,
            logging_config=None, **kwargs,
        )
        made.append(coord)
        return coord

    yield make
    for coord in made:
        coord.shutdown(timeout=5.0)


def engine_addresses(coord: DPCoordinatorProcess) -> dict[str, str]:
    """What a vLLM engine learns in INIT from vLLM's launcher: only the coordinator's
    two engine sockets (its `inputs` belong to the API servers, not to us)."""
    coordinator_input, coordinator_output = coord.get_engine_socket_addresses()
    return {
        "back_publish": coordinator_input,
        "back_output": coordinator_output,
        "dispatch": coord.addresses["dispatch"],  # RawEngine connects one; nothing uses it
    }


def start_engines(ctx: Ctx, coord: DPCoordinatorProcess, count: int) -> list[RawEngine]:
    engines = []
    for rank in range(count):
        engine = RawEngine(ctx, engine_addresses(coord), rank, dp_size=count, handshake=False)
        engine.connect_plane()
        engines.append(engine)
    for engine in engines:
        engine.subscribe()
    return engines


def vllm_frontend(ctx: Ctx, coord: DPCoordinatorProcess) -> RawFrontend:
    """An API server's stats task: an XSUB on the address the launcher gave it."""
    front = RawFrontend(ctx, {"frontend": coord.addresses["frontend"],
                              "front_publish": coord.get_stats_publish_address()})
    front.subscribe_publishes()
    return front


def next_wave_publish(front: RawFrontend, timeout: float = 3.0) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        buf = front.recv_publish(max(0.0, deadline - time.monotonic()))
        assert buf is not None, "no wave publish"
        if is_wave_publish(buf):
            return buf


# ---- settings and the transport table ----------------------------------------------------


# (dp_size, dp_size_local, external_lb, hybrid_lb, elastic_ep) -> (front, back)
TRANSPORT_TABLE = [
    pytest.param(4, 4, False, False, False, IPC, IPC, id="internal-lb-one-node"),
    pytest.param(4, 2, False, False, False, IPC, TCP, id="internal-lb-remote-engines"),
    pytest.param(4, 0, False, False, False, IPC, TCP, id="internal-lb-headless-rank0"),
    pytest.param(4, 4, False, False, True, IPC, TCP, id="internal-lb-elastic-ep"),
    pytest.param(4, 2, False, True, False, TCP, TCP, id="hybrid-lb-two-nodes"),
    pytest.param(4, 4, False, True, False, TCP, IPC, id="hybrid-lb-one-node"),
    pytest.param(4, 1, True, False, False, TCP, TCP, id="external-lb"),
    pytest.param(4, 1, True, False, True, TCP, TCP, id="external-lb-elastic-ep"),
]


@pytest.mark.parametrize(("size", "local", "external", "hybrid", "elastic", "front", "back"),
                         TRANSPORT_TABLE)
def test_transport_plan_is_vllms_table(
    size: int, local: int, external: bool, hybrid: bool, elastic: bool, front: str, back: str
) -> None:
    """Spec 1.2: front publish ipc iff internal LB; back sockets ipc iff every engine is
    local and elastic EP is off. A mix binds everything on tcp at the master ip."""
    config = ParallelConfigStandIn(size, local, "10.1.2.3", external, hybrid, elastic)
    plan = plan_transports(resolve_parallel_settings(config))
    assert (plan.front_publish, plan.back) == (front, back)
    assert plan.mixed == (front != back)
    if front == back == IPC:
        assert plan.bind_host is None
    else:
        assert plan.bind_host == "10.1.2.3"


def test_settings_come_from_the_config_and_keywords_override() -> None:
    config = ParallelConfigStandIn(8, 2, "10.0.0.7", data_parallel_hybrid_lb=True)
    settings = resolve_parallel_settings(config)
    assert settings == ParallelSettings(8, "10.0.0.7", 2, True, False)
    overridden = resolve_parallel_settings(
        config, data_parallel_size=4, data_parallel_master_ip="127.0.0.1",
        data_parallel_size_local=4, local_engines_only=False, enable_elastic_ep=True,
    )
    assert overridden == ParallelSettings(4, "127.0.0.1", 4, False, True)
    # An object without vLLM's local_engines_only property: the LB flags stand in.
    bare = SimpleNamespace(data_parallel_size=2, data_parallel_external_lb=True)
    assert resolve_parallel_settings(bare).local_engines_only
    assert resolve_parallel_settings(bare, data_parallel_external_lb=False).local_engines_only \
        is False
    # Keywords alone; an unknown local count means every engine is local.
    only_kwargs = resolve_parallel_settings(data_parallel_size=3)
    assert only_kwargs.engines_all_local and not only_kwargs.local_engines_only
    assert plan_transports(only_kwargs).bind_host is None


@pytest.mark.parametrize("bad", [
    {},
    {"data_parallel_size": 0},
    {"data_parallel_size": 65537},
    {"data_parallel_size": "2"},
    {"data_parallel_size": 2, "data_parallel_size_local": 3},
    {"data_parallel_size": 2, "data_parallel_size_local": -1},
    {"data_parallel_size": 2, "data_parallel_master_ip": ""},
])
def test_settings_refuse_what_no_coordinator_can_serve(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        resolve_parallel_settings(**bad)


def test_insecure_is_passed_only_for_a_non_loopback_bind_without_keys() -> None:
    """Stock vLLM peers cannot use CURVE; vLLM's own coordinator binds there unauthenticated."""
    needs = DPCoordinatorProcess._needs_insecure
    assert needs("10.0.0.1", [])
    assert needs("[fd00::1]", ["--heartbeat-s", "1"])
    assert not needs("127.0.0.1", [])
    assert not needs("[::1]", [])
    assert not needs("10.0.0.1", ["--insecure"])
    assert not needs("10.0.0.1", ["--curve-secret-key", "server.key_secret"])


# ---- addresses of a real process ---------------------------------------------------------


@pytest.mark.parametrize(("config", "scheme"), [
    pytest.param(ParallelConfigStandIn(2, 2), "ipc", id="all-ipc"),
    pytest.param(ParallelConfigStandIn(2, 1, data_parallel_external_lb=True), "tcp",
                 id="all-tcp"),
    pytest.param(ParallelConfigStandIn(2, 1), "tcp", id="mixed-internal-lb"),
    pytest.param(ParallelConfigStandIn(2, 2, data_parallel_hybrid_lb=True), "tcp",
                 id="mixed-hybrid-one-node"),
])
def test_addresses_follow_the_plan(
    dropin: DropInFactory, config: ParallelConfigStandIn, scheme: str
) -> None:
    coord = dropin(config)
    front = coord.get_stats_publish_address()
    coord_in, coord_out = coord.get_engine_socket_addresses()
    assert (front, coord_in, coord_out) == (
        coord.addresses["front_publish"], coord.addresses["back_publish"],
        coord.addresses["back_output"],
    )
    for address in (front, coord_in, coord_out):
        if scheme == "ipc":
            assert address.startswith("ipc://")
        else:
            assert address.startswith("tcp://127.0.0.1:")
            assert not address.endswith(":0")  # resolved, as vLLM reads LAST_ENDPOINT
    assert len({front, coord_in, coord_out}) == 3
    assert coord.proc.is_alive() and coord.proc.exitcode is None
    assert coord.proc.name == "dp-coordinator" and coord.proc.pid > 0
    coord._coord_store = object()  # elastic EP parks its TCPStore here


def test_ipc_sockets_go_under_vllm_rpc_base_path(
    dropin: DropInFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tempfile.mkdtemp(prefix="rpc-")  # short: unix socket paths hold 108 bytes
    try:
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", base)
        coord = dropin(ParallelConfigStandIn(2, 2))
        path = coord.get_stats_publish_address().removeprefix("ipc://")
        assert os.path.dirname(os.path.dirname(path)) == base
        assert os.path.exists(path)
        coord.shutdown()
        assert os.listdir(base) == []
    finally:
        os.rmdir(base)


# ---- engines and a front-end through the drop-in -----------------------------------------


@pytest.mark.parametrize("config", [
    pytest.param(ParallelConfigStandIn(2, 2), id="ipc"),
    pytest.param(ParallelConfigStandIn(2, 1, data_parallel_external_lb=True), id="tcp"),
])
def test_vllm_engines_pass_the_gate_and_get_wave_broadcasts(
    dropin: DropInFactory, zmq_ctx: Ctx, config: ParallelConfigStandIn
) -> None:
    coord = dropin(config, enable_wave_coordination=True)
    engines = start_engines(zmq_ctx, coord, 2)
    for engine in engines:
        assert engine.expect_publish() == [READY]
    front = vllm_frontend(zmq_ctx, coord)
    assert front.next_full_publish() == full_publish([(0, 0, 0.0)] * 2, 0, False)

    engines[1].report(stats_report(1, waiting=3, running=1, kv_cache_usage=0.5, step=1))
    want = full_publish([(0, 0, 0.0), (3, 1, 0.5)], 0, False)
    wait_until(lambda: front.next_full_publish() == want, timeout=3.0, what="rank 1's row")

    # An idle engine got a request and started wave 0: everyone else is woken.
    engines[1].report(engine_outputs(1, start_wave=0))
    assert engines[0].expect_publish() == start_dp_wave_frames(0, 1)
    assert engines[1].expect_publish() == start_dp_wave_frames(0, 1)  # it ignores its own
    assert next_wave_publish(front) == wave_publish(0, True)
    engines[0].report(engine_outputs(0, wave_complete=0))
    assert next_wave_publish(front) == wave_publish(1, False)
    assert coord.proc.is_alive()


def test_dense_mode_publishes_stats_and_never_wakes(dropin: DropInFactory, zmq_ctx: Ctx) -> None:
    """`enable_wave_coordination=False` (a non-MoE model): stats only."""
    coord = dropin(ParallelConfigStandIn(2, 2), enable_wave_coordination=False)
    engines = start_engines(zmq_ctx, coord, 2)
    for engine in engines:
        assert engine.expect_publish() == [READY]
    front = vllm_frontend(zmq_ctx, coord)
    front.next_full_publish()
    engines[1].report(engine_outputs(1, start_wave=0))
    engines[0].report(stats_report(0, waiting=2, running=2))
    want = full_publish([(2, 2, 0.0), (0, 0, 0.0)], 0, False)
    wait_until(lambda: front.next_full_publish() == want, timeout=3.0, what="rank 0's row")
    for engine in engines:
        assert engine.recv_publish(0.2) is None


def test_late_engine_subscription_gets_ready(dropin: DropInFactory, zmq_ctx: Ctx) -> None:
    """Elastic EP scale-up: a new engine subscribes after start-up and needs READY."""
    coord = dropin(ParallelConfigStandIn(2, 2, enable_elastic_ep=True))
    assert coord.plan.back == TCP
    engines = start_engines(zmq_ctx, coord, 2)
    for engine in engines:
        assert engine.expect_publish() == [READY]
    late = RawEngine(zmq_ctx, engine_addresses(coord), 2, handshake=False)
    late.connect_plane()
    late.subscribe()
    assert late.expect_publish() == [READY]


# ---- the process surface -----------------------------------------------------------------


def test_sentinel_wakes_a_wait_when_the_process_dies(dropin: DropInFactory) -> None:
    coord = dropin(ParallelConfigStandIn(2, 2))
    proc = coord.proc
    assert multiprocessing.connection.wait([proc.sentinel], timeout=0.2) == []
    # vLLM's start-up loop polls the sentinel with ZeroMQ's poller.
    poller = zmq.Poller()
    poller.register(proc.sentinel, zmq.POLLIN)
    assert poller.poll(100) == []
    os.kill(proc.pid, signal.SIGKILL)
    assert multiprocessing.connection.wait([proc.sentinel], timeout=5.0) == [proc.sentinel]
    assert dict(poller.poll(1000)).get(proc.sentinel) == zmq.POLLIN
    assert proc.exitcode == -signal.SIGKILL
    assert not proc.is_alive()
    ipc_dir = os.path.dirname(coord.get_stats_publish_address().removeprefix("ipc://"))
    assert os.path.isdir(ipc_dir)  # a killed child removes nothing
    coord.shutdown(timeout=1.0)  # a dead process shuts down at once
    assert not os.path.exists(ipc_dir)  # the drop-in owns the directory and removes it


def test_shutdown_is_graceful_bounded_and_idempotent(dropin: DropInFactory, zmq_ctx: Ctx) -> None:
    coord = dropin(ParallelConfigStandIn(2, 2))
    for engine in start_engines(zmq_ctx, coord, 2):  # the loop is up and serving
        assert engine.expect_publish() == [READY]
    ipc_files = [a.removeprefix("ipc://") for a in coord.addresses.values()]
    assert all(os.path.exists(path) for path in ipc_files)
    start = time.monotonic()
    coord.shutdown(timeout=5.0)
    assert time.monotonic() - start < 5.0
    assert coord.proc.exitcode == 0  # SIGTERM is a clean exit, as vLLM's launcher expects
    assert multiprocessing.connection.wait([coord.proc.sentinel], timeout=0) == [
        coord.proc.sentinel
    ]
    assert not any(os.path.exists(path) for path in ipc_files)
    coord.shutdown()  # again: nothing to do
    coord.shutdown(timeout=None)
    assert coord.proc.exitcode == 0


def test_a_forked_copy_does_not_stop_the_coordinator(dropin: DropInFactory) -> None:
    """vLLM forks API servers and engines after building the coordinator."""
    coord = dropin(ParallelConfigStandIn(2, 2))
    front = coord.get_stats_publish_address().removeprefix("ipc://")
    pid = os.fork()
    if pid == 0:  # the copy: what its exit paths would run
        try:
            coord.shutdown(timeout=1.0)
            coord._finalizer()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert coord.proc.is_alive()
    assert os.path.exists(front)
    coord.shutdown()
    assert not coord.proc.is_alive()


def test_dropping_the_object_stops_the_process() -> None:
    """Like vLLM's coordinator, the process does not outlive its owner."""
    coord = DPCoordinatorProcess(ParallelConfigStandIn(2, 2), log_sink=None)
    proc = coord.proc
    del coord
    gc.collect()
    assert multiprocessing.connection.wait([proc.sentinel], timeout=10.0) == [proc.sentinel]
    assert proc.exitcode is not None


def test_start_up_failure_is_a_runtime_error(dropin: DropInFactory) -> None:
    with pytest.raises(RuntimeError, match="heartbeat"):
        dropin(ParallelConfigStandIn(2, 2), extra_args=["--heartbeat-s", "0.01"])


def test_serve_flags_from_the_environment(
    dropin: DropInFactory, zmq_ctx: Ctx, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP_COORDINATOR_SERVE_ARGS reaches `serve` (here: a 0.3 s heartbeat)."""
    monkeypatch.setenv("DP_COORDINATOR_SERVE_ARGS", "--heartbeat-s 0.3")
    coord = dropin(ParallelConfigStandIn(1, 1))
    for engine in start_engines(zmq_ctx, coord, 1):
        assert engine.expect_publish() == [READY]
    front = vllm_frontend(zmq_ctx, coord)
    front.next_full_publish()
    beats = [buf for _, buf in front.drain_publishes(1.0) if not is_wave_publish(buf)]
    assert len(beats) >= 2


def test_child_log_lines_reach_the_sink(dropin: DropInFactory, zmq_ctx: Ctx) -> None:
    lines: list[str] = []
    coord = dropin(ParallelConfigStandIn(2, 2), log_sink=lines.append, log_level="info")
    prefix = f"(dp-coordinator pid={coord.proc.pid}) "
    wait_until(lambda: any("coordinator up" in line for line in lines), timeout=5.0,
               what="the start-up line")
    # Its loop answers, so its signal handlers are in place: SIGTERM is a clean exit.
    RawFrontend(zmq_ctx, coord.addresses).state()
    assert all(line.startswith(prefix) for line in lines)
    coord.shutdown()
    assert any("coordinator stopped" in line for line in lines)  # flushed before returning


@pytest.mark.parametrize("prefer_pidfd", [True, False], ids=["pidfd", "pipe"])
def test_exit_sentinel_for_a_plain_child(prefer_pidfd: bool) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    fd, close = open_exit_sentinel(child, prefer_pidfd=prefer_pidfd)
    try:
        assert multiprocessing.connection.wait([fd], timeout=0.2) == []
        assert child.stdin is not None
        child.stdin.close()
        assert multiprocessing.connection.wait([fd], timeout=5.0) == [fd]
        assert child.wait(5.0) == 0
    finally:
        close()
        close()  # idempotent
        if child.poll() is None:
            child.kill()
            child.wait()


def test_process_view_mirrors_multiprocessing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc = CoordinatorProcess(child, name="x")
    try:
        assert proc.is_alive() and proc.exitcode is None and proc.pid == child.pid
        proc.join(0.05)  # times out quietly
        proc.terminate()
        proc.join(5.0)
        assert proc.exitcode == -signal.SIGTERM and not proc.is_alive()
        proc.kill()  # no-op on a dead process
        assert "exitcode=-15" in repr(proc)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        proc.close()


def test_publishes_decode_as_a_vllm_frontend_reads_them(
    dropin: DropInFactory, zmq_ctx: Ctx
) -> None:
    """0.33 front-ends unpack every row as (waiting, running, kv_cache_usage)."""
    coord = dropin(ParallelConfigStandIn(3, 3))
    engines = start_engines(zmq_ctx, coord, 3)
    for engine in engines:
        assert engine.expect_publish() == [READY]
    front = vllm_frontend(zmq_ctx, coord)
    counts, wave, running = unpack(front.next_full_publish())
    for waiting, running_reqs, kv in counts:
        assert (type(waiting), type(running_reqs), type(kv)) == (int, int, float)
    assert (wave, running) == (0, False)
