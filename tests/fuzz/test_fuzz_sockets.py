"""Fuzz all six sockets of ONE coordinator process, then check it still serves.

The generators, the sender and the checks live in `tools/fuzz.py` (which
`python -m tools.fuzz --seconds N` runs for longer). This module keeps one
coordinator for all its tests, with a clean vLLM-shaped engine group and a raw
frontend attached before any fuzzing, and never restarts it: each socket's
pass must leave the process alive, with no handler exception, the same wave
and membership state (counters and lease ages aside) and a grown drop or
refusal counter. The last test runs waves on the old group and on a freshly
handshaken one, proves the state check can see a real change, and stops the
process with SIGTERM (exit 0).

Each pass runs a fixed number of examples (so a loaded machine runs the same
cases as a quiet one, only slower) under a deadline generous enough never to be
reached but on a hang: about 1.5 s a socket on a quiet machine, under 30 s for the
module.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator.launch import CoordinatorHandle, launch
from tests import vllm_peers as peers
from tools.fuzz import (
    SOCKETS,
    FuzzRig,
    PassResult,
    SocketFuzzer,
    check_after_pass,
    check_service,
    comparable_state,
    fuzz_socket,
)

Ctx = zmq.Context[zmq.Socket[bytes]]

ENGINES = 2
# The deadline only stops a pass that hangs; the count is what a pass runs.
EXAMPLES_PER_SOCKET = 300
DEADLINE_PER_SOCKET_S = 120.0


class FuzzModule:
    def __init__(self, handle: CoordinatorHandle, ctx: Ctx, rig: FuzzRig) -> None:
        self.handle = handle
        self.ctx = ctx
        self.rig = rig
        self.fuzzer = SocketFuzzer(ctx, handle.addresses, rig.managed)
        self.results: dict[str, PassResult] = {}


@pytest.fixture(scope="module")
def fuzz_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzModule]:
    workdir = tmp_path_factory.mktemp("fuzz")
    # A unix socket path holds 108 bytes: keep the ipc directory short.
    ipc_dir = tempfile.mkdtemp(prefix="dpc-fz-")
    handle = launch(engines=ENGINES, addr_file=str(workdir / "addresses.json"),
                    extra_args=["--ipc-dir", ipc_dir, "--log-level", "warning"], timeout=20.0)
    ctx: Ctx = zmq.Context()
    try:
        rig = FuzzRig(ctx, handle.addresses, engines=ENGINES, alive=handle.is_alive)
        rig.bring_up()
        rig.run_wave()
        module = FuzzModule(handle, ctx, rig)
        yield module
        module.fuzzer.close()
        rig.close()
    finally:
        ctx.destroy(linger=0)
        died = handle.returncode
        code = handle.shutdown(timeout=5.0)
        if died is not None and died != 0:
            print(f"coordinator exit code {code}; stderr tail:\n{handle.stderr_text()[-4000:]}")
        shutil.rmtree(ipc_dir, ignore_errors=True)


@pytest.mark.parametrize("socket", SOCKETS)
def test_fuzzed_socket_keeps_the_process_and_its_state(
    fuzz_module: FuzzModule, socket: str
) -> None:
    result = fuzz_socket(fuzz_module.rig, fuzz_module.fuzzer, socket,
                         seconds=DEADLINE_PER_SOCKET_S, max_examples=EXAMPLES_PER_SOCKET)
    fuzz_module.results[socket] = result
    print(result.stats.line(socket), f"in {result.seconds:.1f} s")
    print("coordinator counters:", result.delta)
    assert result.seconds < DEADLINE_PER_SOCKET_S, "the pass hit its deadline: a hang?"
    assert result.stats.sent > 50, "the pass sent almost nothing"
    assert not result.problems, "\n".join(result.problems)


def test_clean_groups_run_waves_after_fuzzing(
    fuzz_module: FuzzModule, capsys: pytest.CaptureFixture[str]
) -> None:
    rig = fuzz_module.rig
    handle = fuzz_module.handle
    with capsys.disabled():
        print("\nfuzz summary (one coordinator process, never restarted):")
        for socket, result in fuzz_module.results.items():
            print(f"  {result.stats.line(socket)} in {result.seconds:.1f} s")
    wave_before = rig.state()["wave"]
    problems = check_service(rig)
    assert not problems, "\n".join(problems)
    assert rig.state()["wave"] == wave_before + 2

    # The comparison that guards every pass sees a real change: one valid stats
    # report for a live rank (the kind of message the fuzzer never sends).
    before_state = comparable_state(rig.state())
    before = rig.settle()
    rig.group[0].report(peers.stats_report(rig.managed.start, waiting=5, running=1,
                                           kv_cache_usage=0.5, step=1, wave=before_state["wave"]))
    after = rig.settle()
    changed = check_after_pass(rig, "back_output", before_state, before, after)
    assert any(p.startswith("state changed") for p in changed), changed

    # And it still stops cleanly: SIGTERM, exit 0, ipc socket files removed.
    assert handle.is_alive()
    assert handle.shutdown(timeout=5.0) == 0
    for address in handle.addresses.values():
        if address.startswith("ipc://"):
            assert not Path(address[len("ipc://"):]).exists(), address
