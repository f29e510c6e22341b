"""Stopping the drop-in the way vLLM 0.33 stops its coordinator, and flags it refuses.

vLLM calls `coordinator.shutdown(timeout=...)` in a `finally`: `vllm serve`
passes what is left of `shutdown_timeout` (0 by default, so 0.0), its client's
resource cleanup passes nothing. Whatever the process is doing, the call must
return without raising, stop a healthy coordinator with SIGTERM (exit code 0,
its own clean-up done) and leave no file behind: no launch directory (address
file, stderr), no ipc directory.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator.launch import KILL_WAIT_S, SIGTERM_GRACE_S
from coordinator.vllm_compat import DPCoordinatorProcess
from tests.vllm_peers import READY, RawEngine, RawFrontend

Ctx = zmq.Context[zmq.Socket[bytes]]


class Config:
    """The parts of vLLM 0.33's ParallelConfig the drop-in reads: two local engines."""

    data_parallel_size = 2
    data_parallel_size_local = 2
    data_parallel_master_ip = "127.0.0.1"
    data_parallel_external_lb = False
    data_parallel_hybrid_lb = False
    enable_elastic_ep = False
    local_engines_only = False


@pytest.fixture
def rpc_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """vLLM's ipc base path and the temp dir, both private: every file the drop-in
    makes lands in one of them, so "nothing left" is "both empty"."""
    base = Path(tempfile.mkdtemp(prefix="rpc-"))  # short: unix socket paths hold 108 bytes
    scratch = Path(tempfile.mkdtemp(prefix="tmp-"))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(base))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    try:
        yield base
    finally:
        monkeypatch.undo()
        leftovers = sorted(str(p) for root in (base, scratch) for p in root.rglob("*"))
        for root in (base, scratch):
            for path in sorted(root.rglob("*"), reverse=True):
                path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
            root.rmdir()
        assert leftovers == [], f"files left behind: {leftovers}"


def files_under(*roots: str | Path) -> list[str]:
    return sorted(str(p) for root in roots for p in Path(root).rglob("*"))


_started: list[DPCoordinatorProcess] = []


@pytest.fixture(autouse=True)
def _stop_leftovers() -> Iterator[None]:
    """A failed assertion must not leave a process (or its files) behind."""
    yield
    while _started:
        _started.pop().shutdown(timeout=5.0)


def start(**kwargs: object) -> DPCoordinatorProcess:
    coord = DPCoordinatorProcess(  # type: ignore[arg-type]
        Config(), enable_wave_coordination=True, logging_config=None, log_sink=None,
        startup_timeout=20.0, **kwargs,
    )
    _started.append(coord)
    return coord


def serving(coord: DPCoordinatorProcess, ctx: Ctx) -> None:
    """Engines past the gate and a state answer: the loop and its signal handlers are up."""
    coord_in, coord_out = coord.get_engine_socket_addresses()
    engines = [RawEngine(ctx, {"back_publish": coord_in, "back_output": coord_out,
                               "dispatch": coord.addresses["dispatch"]}, rank, dp_size=2,
                         handshake=False) for rank in range(2)]
    for engine in engines:
        engine.connect_plane()
        engine.subscribe()
    for engine in engines:
        assert engine.expect_publish() == [READY]
    RawFrontend(ctx, coord.addresses).state()


def launch_paths(coord: DPCoordinatorProcess) -> list[str]:
    """The launch directory (address file, stderr) and the ipc directory."""
    ipc_dir = os.path.dirname(coord.get_stats_publish_address().removeprefix("ipc://"))
    launch_dir = os.path.dirname(coord._handle.addr_file)
    assert os.path.isfile(coord._handle.addr_file)
    assert os.path.isfile(coord._handle._stderr_path)
    assert os.path.isdir(ipc_dir)
    return [launch_dir, ipc_dir]


# ---- item: shutdown(timeout=...) as vLLM calls it ---------------------------------------


@pytest.mark.parametrize("timeout", [0.0, 0.05, 0.5, None],
                         ids=["serve-default-0", "small", "half-second", "cleanup-none"])
def test_shutdown_stops_cleanly_never_raises_and_leaves_nothing(
    rpc_base: Path, zmq_ctx: Ctx, timeout: float | None
) -> None:
    coord = start()
    serving(coord, zmq_ctx)
    paths = launch_paths(coord)
    begun = time.monotonic()
    coord.shutdown(timeout=timeout)
    # SIGTERM got its grace: a clean exit 0, not a SIGKILL, even with timeout 0.
    assert coord.proc.exitcode == 0, coord.stderr_text()[-2000:]
    assert time.monotonic() - begun < SIGTERM_GRACE_S + 1.0
    assert not any(os.path.exists(path) for path in paths)
    assert "coordinator stopped" in coord.stderr_text()  # its own clean-up ran
    coord.shutdown(timeout=0.0)  # vLLM may call it again from a finalizer


@pytest.mark.parametrize("timeout", [0.0, 0.2])
def test_shutdown_of_a_stopped_coordinator_kills_it_without_raising(
    rpc_base: Path, timeout: float
) -> None:
    """A process that cannot react to SIGTERM (SIGSTOP) is SIGKILLed after the grace."""
    coord = start()
    paths = launch_paths(coord)
    os.kill(coord.proc.pid, signal.SIGSTOP)
    begun = time.monotonic()
    coord.shutdown(timeout=timeout)
    elapsed = time.monotonic() - begun
    assert coord.proc.exitcode == -signal.SIGKILL
    assert SIGTERM_GRACE_S - 0.1 <= elapsed < SIGTERM_GRACE_S + KILL_WAIT_S
    assert not any(os.path.exists(path) for path in paths)


def test_shutdown_of_a_dead_coordinator_cleans_up_without_raising(rpc_base: Path) -> None:
    coord = start()
    paths = launch_paths(coord)
    os.kill(coord.proc.pid, signal.SIGKILL)
    coord.proc.join(5.0)
    assert coord.proc.exitcode == -signal.SIGKILL
    begun = time.monotonic()
    coord.shutdown(timeout=0.0)
    assert time.monotonic() - begun < 1.0  # nothing to wait for
    assert not any(os.path.exists(path) for path in paths)


# ---- item: flags the drop-in owns ----------------------------------------------------------


@pytest.mark.parametrize(("serve_args", "named"), [
    ("--addr-file coord.json", ["--addr-file"]),
    ("--addr-file=coord.json", ["--addr-file (given as --addr-file=coord.json)"]),
    ("--addr coord.json", ["--addr-file (given as --addr)"]),
    ("--metrics-port 9400 --engines=8 --host 10.0.0.1 --ipc-dir /tmp/x",
     ["--engines (given as --engines=8)", "--host", "--ipc-dir"]),
    ("--rank-start 2 --frontends 1 --no-wave-coordination",
     ["--rank-start", "--frontends", "--no-wave-coordination"]),
])
def test_owned_flags_in_the_environment_are_refused_at_once(
    rpc_base: Path, monkeypatch: pytest.MonkeyPatch, serve_args: str, named: list[str]
) -> None:
    """The child would get two of them; with two --addr-file flags it writes the
    other file and start-up waited for two minutes, then failed with no reason."""
    monkeypatch.setenv("DP_COORDINATOR_SERVE_ARGS", serve_args)
    begun = time.monotonic()
    with pytest.raises(ValueError) as refused:
        start()
    assert time.monotonic() - begun < 2.0  # refused, not timed out
    message = str(refused.value)
    assert message.startswith(f"DP_COORDINATOR_SERVE_ARGS sets {', '.join(named)}, ")
    assert "remove" in message
    assert files_under(rpc_base) == []
    assert not os.path.exists("coord.json")


@pytest.mark.parametrize(("serve_args", "named"), [
    ("--no-such-flag", "--no-such-flag"),
    ("--metrics-prot 9400", "--metrics-prot"),  # a typo
    ("--recorder-size 50 --m=1", "--m=1"),  # abbreviates several flags
])
def test_flags_serve_does_not_know_are_refused_before_the_child_starts(
    rpc_base: Path, monkeypatch: pytest.MonkeyPatch, serve_args: str, named: str
) -> None:
    """Not after the child started and exited: the message names the flag, and nothing
    was made (no process, no file)."""
    monkeypatch.setenv("DP_COORDINATOR_SERVE_ARGS", serve_args)
    with pytest.raises(ValueError) as refused:
        start()
    assert str(refused.value).startswith(f"DP_COORDINATOR_SERVE_ARGS has {named}, which "
                                         "`dp-coordinator serve` does not know")
    assert files_under(rpc_base) == []


def test_owned_flags_in_extra_args_are_refused_too(rpc_base: Path) -> None:
    with pytest.raises(ValueError, match=r"^extra_args sets --engines, "):
        start(extra_args=["--engines", "4"])


def test_flags_the_drop_in_does_not_own_still_reach_serve(
    rpc_base: Path, monkeypatch: pytest.MonkeyPatch, zmq_ctx: Ctx
) -> None:
    """`--log-level` there wins over the keyword (and VLLM_LOGGING_LEVEL)."""
    monkeypatch.setenv("DP_COORDINATOR_SERVE_ARGS", "--log-level info --recorder-size 50")
    coord = start(log_level="error")
    serving(coord, zmq_ctx)
    assert " INFO coordinator.server: coordinator up" in coord.stderr_text()
    coord.shutdown(timeout=0.0)
    assert coord.proc.exitcode == 0


def test_a_start_up_that_times_out_says_why(
    rpc_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reason carries the end of the child's log, even though its launch
    directory (where that log lives) is removed before the error is raised."""
    hang = rpc_base / "hang"  # outside the launch directory, removed by the fixture
    hang.mkdir()
    (hang / "sitecustomize.py").write_text(
        "import sys, time\n"
        "sys.stderr.write('stuck before serving: planted by the test\\n')\n"
        "sys.stderr.flush()\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(hang))
    begun = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        DPCoordinatorProcess(Config(), log_sink=None, startup_timeout=1.5)
    (hang / "sitecustomize.py").unlink()
    hang.rmdir()
    assert time.monotonic() - begun < 1.5 + SIGTERM_GRACE_S + KILL_WAIT_S
    message = str(failed.value)
    assert "did not write" in message and "within 1.5 s" in message
    assert "stuck before serving: planted by the test" in message
