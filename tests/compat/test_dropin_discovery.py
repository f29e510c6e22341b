"""A coordinator that vLLM's plugin started is found on its host with no arguments.

The drop-in publishes its addresses as `dp-coordinator-<master port>.json`
under vLLM's RPC base path (`VLLM_RPC_BASE_PATH` here, a private directory
per test); `status` and `top` with no `--addr-file` use the one coordinator
that answers there, and say clearly when there is none or several. Real
coordinator processes, real sockets; the command line runs in this process
(one test runs it as its own process, as an operator would).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from coordinator.cli import main
from coordinator.launch import discovery_dir, discovery_path, find_coordinators
from coordinator.vllm_compat import DPCoordinatorProcess

pytestmark = pytest.mark.timeout(90)


class Config:
    """The attributes of vLLM's ParallelConfig the drop-in reads."""

    data_parallel_size = 2
    data_parallel_size_local = 2
    data_parallel_master_ip = "127.0.0.1"
    data_parallel_master_port = 29517
    data_parallel_external_lb = False
    data_parallel_hybrid_lb = False
    enable_elastic_ep = False
    local_engines_only = False


@pytest.fixture
def rpc_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """vLLM's RPC base path for this test: short, since ipc sockets go under it."""
    base = Path(tempfile.mkdtemp(prefix="rpc-"))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(base))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def dropins() -> Iterator[list[DPCoordinatorProcess]]:
    started: list[DPCoordinatorProcess] = []
    yield started
    for coord in started:
        coord.shutdown(timeout=0.0)


def start(dropins: list[DPCoordinatorProcess], **keywords: object) -> DPCoordinatorProcess:
    coord = DPCoordinatorProcess(Config(), log_sink=None, startup_timeout=20.0,
                                 **keywords)  # type: ignore[arg-type]
    dropins.append(coord)
    return coord


def run_cli(capsys: pytest.CaptureFixture[str], args: Sequence[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def stale_address_file(path: Path) -> None:
    """An address file left by a coordinator that was killed: nothing listens there."""
    keys = ("handshake", "dispatch", "back_output", "back_publish", "front_publish",
            "frontend")
    path.write_text(json.dumps({key: f"ipc://{path.parent}/gone-{key}" for key in keys}))


def test_the_address_file_is_where_the_docs_say_and_goes_at_shutdown(
    rpc_base: Path, dropins: list[DPCoordinatorProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    coord = start(dropins)
    assert discovery_dir() == str(rpc_base)
    expected = rpc_base / "dp-coordinator-29517.json"
    assert coord.discovery_file == str(expected) == discovery_path("29517")
    assert json.loads(expected.read_text()) == coord.addresses

    code, out, err = run_cli(capsys, ["status", "--json"])
    assert code == 0, err
    state = json.loads(out)
    assert (state["rank_start"], state["rank_count"]) == (0, 2)
    code, out, err = run_cli(capsys, ["top", "--once"])
    assert code == 0, err
    assert coord.addresses["frontend"] in out and "absent" in out

    coord.shutdown(timeout=0.0)
    assert not expected.exists()
    assert find_coordinators() == []


def test_an_operator_on_the_host_needs_no_arguments(
    rpc_base: Path, dropins: list[DPCoordinatorProcess]
) -> None:
    """`dp-coordinator status` as its own process, with vLLM's environment."""
    start(dropins)
    done = subprocess.run([sys.executable, "-m", "coordinator", "status", "--json"],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "VLLM_RPC_BASE_PATH": str(rpc_base)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rank_count"] == 2


def test_none_found_says_where_it_looked(
    rpc_base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = rpc_base / "dp-coordinator-29999.json"
    stale_address_file(stale)
    (rpc_base / "dp-coordinator-notes.json").write_text("[]")  # not an address file
    for command in (["status"], ["top", "--once"]):
        code, out, err = run_cli(capsys, command)
        assert code == 1 and out == "", command
        assert "no coordinator started by vLLM's plugin answers on this host" in err
        assert str(rpc_base / "dp-coordinator-*.json") in err
        assert "--addr-file" in err and "VLLM_RPC_BASE_PATH" in err
        assert f"{stale} (its coordinator does not answer)" in err
        assert "notes" not in err


def test_a_stale_file_beside_a_live_one_is_not_chosen(
    rpc_base: Path, dropins: list[DPCoordinatorProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    stale_address_file(rpc_base / "dp-coordinator-1.json")
    coord = start(dropins)
    found = {f.path: f.answering for f in find_coordinators()}
    assert found == {str(rpc_base / "dp-coordinator-1.json"): False,
                     coord.discovery_file: True}
    code, out, err = run_cli(capsys, ["status", "--json"])
    assert code == 0, err
    assert json.loads(out)["rank_count"] == 2


def test_several_are_listed_and_one_is_chosen_with_addr_file(
    rpc_base: Path, dropins: list[DPCoordinatorProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    first = start(dropins, data_parallel_master_port=29601)
    second = start(dropins, data_parallel_master_port=29602)
    for command in (["status"], ["top", "--once"]):
        code, out, err = run_cli(capsys, command)
        assert code == 1 and out == "", command
        assert "2 coordinators started by vLLM's plugin answer on this host" in err
        assert "choose one with --addr-file" in err
        for coord in (first, second):
            assert f"{coord.discovery_file}  (frontend {coord.addresses['frontend']})" in err
    assert second.discovery_file is not None
    code, out, err = run_cli(capsys, ["status", "--json", "--addr-file", second.discovery_file])
    assert code == 0, err


def test_a_live_coordinator_keeps_its_name_and_a_stale_one_gives_it_up(
    rpc_base: Path, dropins: list[DPCoordinatorProcess]
) -> None:
    name = rpc_base / "dp-coordinator-29517.json"
    stale_address_file(name)
    first = start(dropins)
    assert first.discovery_file == str(name)  # the stale file was replaced
    second = start(dropins)
    # Same master port while the first one lives: the second is named after its pid.
    assert second.discovery_file == str(rpc_base / f"dp-coordinator-29517-{second.proc.pid}.json")
    assert json.loads(name.read_text()) == first.addresses
    second.shutdown(timeout=0.0)
    assert json.loads(name.read_text()) == first.addresses  # not the second one's to remove
    assert [f.path for f in find_coordinators()] == [str(name)]


def test_without_a_master_port_the_pid_names_it(
    rpc_base: Path, dropins: list[DPCoordinatorProcess]
) -> None:
    coord = DPCoordinatorProcess(data_parallel_size=1, log_sink=None, startup_timeout=20.0)
    dropins.append(coord)
    assert coord.discovery_file == str(rpc_base / f"dp-coordinator-pid{coord.proc.pid}.json")


def test_a_bad_master_port_is_refused_before_anything_starts(rpc_base: Path) -> None:
    with pytest.raises(ValueError, match="data_parallel_master_port"):
        DPCoordinatorProcess(data_parallel_size=1, data_parallel_master_port=70000,
                             log_sink=None)
    assert os.listdir(rpc_base) == []
