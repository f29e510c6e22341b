"""Restarts: a killed coordinator resumes its group; a restarted engine takes its rank back.

Real processes, real sockets: the coordinator is killed with SIGKILL, so nothing
it had in memory survives except what it wrote to its state file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator.launch import CoordinatorHandle, LaunchError, launch
from tests.vllm_peers import (
    RawEngine,
    RawFrontend,
    engine_outputs,
    handshake_group,
    hello_payload,
    stats_report,
    unpack,
    wait_until,
)

Ctx = zmq.Context[zmq.Socket[bytes]]


class Restartable:
    """One coordinator identity (addresses, state file) that can be killed and restarted."""

    def __init__(self, workdir: Path, engines: int, *, state_file: bool = True) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="dpc-rst-")  # short: unix socket paths
        self.addr_file = str(workdir / "addresses.json")
        self.state_file = str(workdir / "state.json") if state_file else None
        self.engines = engines
        self.handles: list[CoordinatorHandle] = []

    def start(self) -> CoordinatorHandle:
        args = ["--ipc-dir", self.ipc_dir, "--lease-ttl-s", "3"]
        if self.state_file is not None:
            args += ["--state-file", self.state_file]
        handle = launch(engines=self.engines, addr_file=self.addr_file, extra_args=args,
                        timeout=20.0)
        self.handles.append(handle)
        return handle

    def kill(self) -> None:
        handle = self.handles[-1]
        os.kill(handle.pid, signal.SIGKILL)
        handle.process.wait(10)

    def close(self) -> None:
        for handle in self.handles:
            handle.shutdown(timeout=5.0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[type[Restartable]]:
    made: list[Restartable] = []

    def make(engines: int, *, state_file: bool = True) -> Restartable:
        item = Restartable(tmp_path, engines, state_file=state_file)
        made.append(item)
        return item

    yield make  # type: ignore[misc]
    for item in made:
        item.close()


def group_state(frontend: RawFrontend) -> dict[str, object]:
    return frontend.state()


def test_killed_coordinator_resumes_registrations_wave_and_dispatch(
    restartable: type[Restartable], zmq_ctx: Ctx
) -> None:
    coord = restartable(2)
    handle = coord.start()
    engines = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    frontend = RawFrontend(zmq_ctx, handle.addresses)
    frontend.register(0, "ipc:///tmp/frontend-0-outputs")
    engines[1].report(engine_outputs(1, start_wave=5))
    wait_until(lambda: group_state(frontend)["wave"] == 5, timeout=5.0)
    before = group_state(frontend)

    coord.kill()
    handle = coord.start()
    # The engines and the frontend keep their sockets: ZMQ reconnects them.
    after = group_state(frontend)
    assert after["wave"] == 5, "a restart must never move the wave back"
    assert after["frontends"] == 1
    assert [(e[0], e[1], e[2]) for e in after["engines"]] == [  # type: ignore[union-attr]
        (e[0], e[1], e[2]) for e in before["engines"]  # type: ignore[union-attr]
    ]

    # A request submitted after the restart reaches a reconnected stock-shaped engine
    # (once its DEALER has reconnected: until then the coordinator says so, and a rank
    # an ADD found unreachable gets nothing more until a probe reaches it).
    attempt = iter(range(1000))

    def submitted() -> list[object] | None:
        reply = frontend.submit(f"after-restart-{next(attempt)}", b"payload", wave=5)
        if reply[0] == "error":
            assert reply[2] in ("engine_unreachable", "no_ready_engine"), reply
            return None
        return reply

    reply = wait_until(submitted, timeout=5.0, interval=0.05)
    assert reply[0] == "submitted", reply
    rank = reply[3]
    assert engines[rank].recv_dispatch(5.0) == [b"\x00", b"payload"]

    # Engines report a later wave than the state file had: the coordinator follows.
    engines[0].report(stats_report(0, waiting=0, running=1, wave=9, step=1))
    wait_until(lambda: group_state(frontend)["wave"] == 9, timeout=5.0)


def test_without_a_state_file_the_wave_is_rebuilt_from_engine_reports(
    restartable: type[Restartable], zmq_ctx: Ctx
) -> None:
    coord = restartable(2, state_file=False)
    handle = coord.start()
    engines = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    frontend = RawFrontend(zmq_ctx, handle.addresses)
    coord.kill()
    coord.start()
    assert group_state(frontend)["wave"] == 0
    engines[1].report(stats_report(1, waiting=1, running=2, wave=57, step=3))
    wait_until(lambda: group_state(frontend)["wave"] == 57, timeout=5.0)
    # A report from an engine still behind never moves the wave back.
    engines[0].report(stats_report(0, waiting=0, running=0, wave=12, step=1))
    engines[1].report(engine_outputs(1, start_wave=57))
    wait_until(lambda: group_state(frontend)["running"] is True, timeout=5.0)
    assert group_state(frontend)["wave"] == 57


def test_unreadable_state_file_stops_start_up_with_advice(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text("{not json")
    with pytest.raises(LaunchError) as info:
        launch(engines=1, addr_file=str(tmp_path / "a.json"),
               extra_args=["--state-file", str(state)], timeout=20.0)
    assert "is unreadable" in str(info.value)
    assert "move it away" in str(info.value)
    assert state.read_text() == "{not json", "a refused state file is left as it was"


def test_a_state_file_of_another_version_is_refused_and_left_for_a_roll_back(
    restartable: type[Restartable], zmq_ctx: Ctx
) -> None:
    """The upgrade path (docs/OPERATIONS.md): a coordinator whose STATE_VERSION differs
    from the file's refuses to start, naming both, and leaves the file as it was; the
    version that wrote it then resumes from it."""
    coord = restartable(1)
    handle = coord.start()
    handshake_group(zmq_ctx, handle.addresses, [0], dp_size=1)
    assert coord.state_file is not None
    wait_until(lambda: json.loads(Path(coord.state_file).read_text())["leases"], timeout=5.0)
    handle.shutdown(timeout=5.0)
    saved = json.loads(Path(coord.state_file).read_text())
    newer = {**saved, "version": saved["version"] + 1}
    Path(coord.state_file).write_text(json.dumps(newer))
    written = Path(coord.state_file).read_bytes()
    with pytest.raises(LaunchError) as info:
        coord.start()
    assert "exited with code 2" in str(info.value)
    assert (f"has version {newer['version']}, this coordinator reads version "
            f"{saved['version']}; move it away") in str(info.value)
    assert Path(coord.state_file).read_bytes() == written
    Path(coord.state_file).write_text(json.dumps(saved))  # the roll back
    handle = coord.start()
    frontend = RawFrontend(zmq_ctx, handle.addresses)
    assert [e[1] for e in group_state(frontend)["engines"]] == ["ready"]  # type: ignore[union-attr]


def test_restarted_engine_takes_its_rank_back_as_soon_as_the_old_one_is_gone(
    restartable: type[Restartable], zmq_ctx: Ctx
) -> None:
    coord = restartable(2)
    handle = coord.start()
    old = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2,
                          engine_ids={0: "engine-a", 1: "engine-x"})
    for engine in old:
        engine.close_handshake()  # as engines do after READY
    # Let the coordinator see those connections go: until it does, libzmq turns away a
    # new connection with the same identity (a real restart comes much later than this).
    time.sleep(0.5)
    # While the old engine lives, a new one for rank 0 is refused with the remedy.
    rival = RawEngine(zmq_ctx, handle.addresses, 0, dp_size=2)
    rival.send_handshake(hello_payload(engine_id="engine-b"))
    refusal = unpack(rival.expect_handshake())
    assert refusal["status"] == "ERROR"
    assert refusal["reason"].startswith(
        "Engine ID mismatch for dp_rank=0: expected engine-a, got engine-b")
    assert "Stop the old engine" in refusal["reason"]
    rival.close()

    # The old engine dies (its sockets close); the new one is accepted at once,
    # without waiting for the lease to run out.
    old[0].close()
    time.sleep(0.5)  # as above: the rival's handshake connection must be gone first
    new = RawEngine(zmq_ctx, handle.addresses, 0, dp_size=2)
    new.send_handshake(hello_payload(engine_id="engine-b"))
    init = unpack(new.expect_handshake(5.0))
    assert "addresses" in init, init
    frontend = RawFrontend(zmq_ctx, handle.addresses)
    counters = frontend.counters()
    assert counters.get("handshake.replaced", 0) >= 1


def start_one_saved_lease(
    restartable: type[Restartable], zmq_ctx: Ctx
) -> tuple[Restartable, Path]:
    """A one-rank coordinator whose state file holds rank 0's READY lease."""
    coord = restartable(1)
    handle = coord.start()
    handshake_group(zmq_ctx, handle.addresses, [0], dp_size=1)
    assert coord.state_file is not None
    path = Path(coord.state_file)

    def saved_leases() -> object:
        return path.exists() and json.loads(path.read_text())["leases"]

    wait_until(saved_leases, timeout=30.0)
    return coord, path


def test_state_file_is_json_an_operator_can_read(
    restartable: type[Restartable], zmq_ctx: Ctx
) -> None:
    _, path = start_one_saved_lease(restartable, zmq_ctx)
    saved = json.loads(path.read_text())
    assert saved["gate_open"] is True
    assert saved["leases"][0]["rank"] == 0
    assert saved["leases"][0]["state"] == "ready"


def test_start_up_removes_temporary_files_a_killed_write_left_and_uses_the_state_file(
    restartable: type[Restartable], zmq_ctx: Ctx
) -> None:
    coord, path = start_one_saved_lease(restartable, zmq_ctx)
    coord.kill()
    stale = path.parent / f".{path.name}.state-k9stale1"  # as mkstemp names them
    stale.write_bytes(b'{"version": 1, "half wri')
    other = path.parent / ".other.json.state-k9stale1"  # another coordinator's: left alone
    other.write_bytes(b"x")
    handle = coord.start()
    wait_until(lambda: not stale.exists(), timeout=5.0)
    assert other.exists()
    frontend = RawFrontend(zmq_ctx, handle.addresses)
    assert group_state(frontend)["wave"] == 0
    # The state file was read, not replaced by an empty one: rank 0's lease is in it.
    assert json.loads(path.read_text())["leases"][0]["rank"] == 0
