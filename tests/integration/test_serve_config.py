"""`serve` configured as operators do: a --config file, DP_COORDINATOR_* variables,
`--check`, JSON logs, and the process metrics, through the real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from coordinator import __version__
from coordinator.cli.keygen import generate_keypair

CLI = (sys.executable, "-m", "coordinator", "serve")
DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_COORDINATOR_")}
    env.update(extra)
    return env


def start(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env or environment())


def run(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60,
                          env=env or environment())


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[1])
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    _, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err
    return err


def get(url: str) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A TCP port on 127.0.0.1 that someone else holds."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    with sock:
        yield sock


def test_the_config_file_sets_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    from_file, from_flag = tmp_path / "file.json", tmp_path / "flag.json"
    port = free_port()
    config = tmp_path / "coordinator.toml"
    config.write_text(f'engines = 2\naddr-file = "{from_file}"\nmetrics_port = {port}\n'
                      'log-format = "json"\nno-wave-coordination = true\n')
    proc = start("--config", str(config), "--addr-file", str(from_flag))
    try:
        wait_for(from_flag, proc)
        state = json.loads(get(f"http://127.0.0.1:{port}/state"))
        assert state["rank_count"] == 2 and state["lockstep"] is False
        assert state["version"] == __version__
        metrics = get(f"http://127.0.0.1:{port}/metrics")
        status = subprocess.run([sys.executable, "-m", "coordinator", "status", "--addr-file",
                                 str(from_flag)], capture_output=True, text=True, timeout=60)
        assert f"v{__version__}" in status.stdout, status.stderr
        as_json = subprocess.run([sys.executable, "-m", "coordinator", "status", "--json",
                                  "--addr-file", str(from_flag)],
                                 capture_output=True, text=True, timeout=60)
        assert json.loads(as_json.stdout)["version"] == __version__
    finally:
        err = stop(proc)
    assert not from_file.exists()
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in metrics.splitlines() if line and not line.startswith("#")}
    assert samples["process_resident_memory_bytes"] > 1e6
    assert samples["process_open_fds"] >= 10
    assert samples["process_cpu_seconds_total"] > 0
    assert abs(samples["process_start_time_seconds"] - time.time()) < 600
    assert samples[f'dp_coordinator_build_info{{version="{__version__}"}}'] == 1.0
    # --log-format json from the file: every line is one object.
    lines = [json.loads(line) for line in err.splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    (started,) = [line for line in lines if line.get("event") == "started"]
    assert started["version"] == __version__ and started["engines"] == 2
    assert __version__ in started["message"] and started["level"] == "info"
    assert lines[-1]["event"] == "stopped"


def test_environment_variables_lie_between_the_flags_and_the_file(tmp_path: Path) -> None:
    from_file, from_env = tmp_path / "file.json", tmp_path / "env.json"
    config = tmp_path / "c.toml"
    config.write_text(f'engines = 1\naddr_file = "{from_file}"\nlog-level = "warning"\n')
    proc = start(env=environment(DP_COORDINATOR_CONFIG=str(config),
                                 DP_COORDINATOR_ADDR_FILE=str(from_env),
                                 DP_COORDINATOR_LOG_FORMAT="json",
                                 DP_COORDINATOR_LOG_LEVEL="info"))
    try:
        wait_for(from_env, proc)
    finally:
        err = stop(proc)
    assert not from_file.exists()
    assert any(json.loads(line).get("event") == "started" for line in err.splitlines())


@pytest.mark.parametrize(("text", "named"), [
    ("enginez = 2\n", "unknown key 'enginez'"),
    ('engines = "two"\n', "engines: 'two' is not an integer"),
    ('engines = 1\nlog-format = "yaml"\n', "log-format: 'yaml' is not one of text, json"),
])
def test_a_bad_config_file_exits_2_in_one_line_before_binding(
    tmp_path: Path, text: str, named: str
) -> None:
    addr = tmp_path / "a.json"
    config = tmp_path / "c.toml"
    config.write_text(text)
    result = run("--config", str(config), "--addr-file", str(addr), "--engines", "1")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.stderr
    assert str(config) in result.stderr
    assert not addr.exists()


def test_a_bad_environment_variable_is_named(tmp_path: Path) -> None:
    result = run("--engines", "1", env=environment(DP_COORDINATOR_PORT_BASE="seven"))
    assert result.returncode == 2
    assert result.stderr == ("dp-coordinator serve: error: environment: "
                             "DP_COORDINATOR_PORT_BASE: 'seven' is not an integer\n")


def test_check_says_ok_and_leaves_nothing_behind(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    clients = keys / "clients"
    clients.mkdir(parents=True)
    _, secret = generate_keypair(str(keys), "coordinator")
    generate_keypair(str(clients), "engine")
    os.unlink(clients / "engine.key_secret")
    config = tmp_path / "c.toml"
    config.write_text(f'engines = 2\nhost = "127.0.0.1"\nport-base = {free_port()}\n'
                      f'state-file = "{tmp_path / "state.json"}"\n'
                      f'curve-secret-key = "{secret}"\ncurve-clients-dir = "{clients}"\n')
    result = run("--config", str(config), "--addr-file", str(tmp_path / "a.json"),
                 "--metrics-port", str(free_port()), "--check")
    assert (result.returncode, result.stdout, result.stderr) == (0, "ok\n", "")
    assert sorted(os.listdir(tmp_path)) == ["c.toml", "keys"]


def test_check_lists_every_problem(tmp_path: Path, listening: socket.socket) -> None:
    taken = int(listening.getsockname()[1])
    keys = tmp_path / "keys"
    _, secret = generate_keypair(str(keys), "coordinator")
    os.chmod(secret, 0o644)
    config = tmp_path / "c.toml"
    config.write_text(f'engines = 2\nstate-file = "{tmp_path}/missing/state.json"\n'
                      'colour = "blue"\n')
    result = run("--config", str(config), "--host", "127.0.0.1", "--port-base", str(taken),
                 "--addr-file", str(tmp_path / "nowhere" / "a.json"),
                 "--curve-secret-key", secret, "--curve-clients-dir", str(tmp_path / "none"),
                 "--metrics-port", str(taken), "--check")
    assert result.returncode == 2 and result.stdout == ""
    problems = result.stderr.splitlines()
    assert all(line.startswith("dp-coordinator serve --check: ") for line in problems)
    expected = [
        "unknown key 'colour'",
        f"{tmp_path}/missing does not exist",
        f"--addr-file {tmp_path / 'nowhere' / 'a.json'}: its directory",
        "can be read by its group or by everyone (mode 644): chmod 600 it",
        f"--curve-clients-dir: client key directory {tmp_path / 'none'} does not exist",
        f"socket handshake: port {taken} on 127.0.0.1:",
        f"--metrics-port {taken} on 127.0.0.1:",
    ]
    for text in expected:
        assert sum(text in line for line in problems) == 1, (text, problems)
    assert len(problems) == len(expected), problems
    assert sorted(os.listdir(tmp_path)) == ["c.toml", "keys"]


def test_check_reports_an_unresolvable_host_as_such() -> None:
    result = run("--engines", "1", "--host", "no-such-host.invalid", "--check")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "dp-coordinator serve --check: --host 'no-such-host.invalid' does not resolve "
        + result.stderr.split("does not resolve ", 1)[1].splitlines()[0]]
