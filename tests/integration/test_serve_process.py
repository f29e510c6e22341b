"""The serve process itself: per-socket binds, signals at awkward moments, bad flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


def serve(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator", "serve", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.002)


def test_bind_overrides_put_chosen_sockets_on_private_ipc(tmp_path: Path) -> None:
    ipc = tempfile.mkdtemp(prefix="dpc-bind-")  # short: unix socket paths
    addr = tmp_path / "a.json"
    proc = serve("--engines", "1", "--host", "127.0.0.1", "--addr-file", str(addr),
                 "--bind", f"frontend=ipc://{ipc}/fe", "--bind", f"handshake=ipc://{ipc}/hs")
    try:
        wait_for_file(addr, proc)
        addresses = json.loads(addr.read_text())
        assert addresses["frontend"] == f"ipc://{ipc}/fe"
        assert addresses["handshake"] == f"ipc://{ipc}/hs"
        for key in ("dispatch", "back_output", "back_publish", "front_publish"):
            assert addresses[key].startswith("tcp://127.0.0.1:"), addresses
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    assert os.listdir(ipc) == [], "ipc socket files are removed on exit"
    os.rmdir(ipc)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bind", "nope=ipc:///tmp/x"], "unknown socket"),
        (["--bind", "frontend=udp://x"], "use an ipc:// or tcp:// endpoint"),
        (["--bind", "frontend"], "--bind wants KEY=ENDPOINT"),
        (["--port-base", "7000"], "--port-base needs --host"),
        (["--master-ip", "10.0.0.9"], "give its port with --master-port"),
        (["--host", "0.0.0.0"], "--insecure"),
    ],
)
def test_bad_flags_exit_non_zero_with_a_reason(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--engines", "1", *args],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_sigterm_right_after_the_address_file_appears_still_cleans_up(tmp_path: Path) -> None:
    """Launchers may stop the coordinator as soon as it reports its addresses."""
    for attempt in range(3):
        addr = tmp_path / f"a{attempt}.json"
        proc = serve("--engines", "1", "--addr-file", str(addr))
        wait_for_file(addr, proc)
        addresses = json.loads(addr.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not addr.exists()
        for endpoint in addresses.values():
            assert not os.path.exists(endpoint[len("ipc://"):])


def serve_in_own_group(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator", "serve", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )


def stops_cleanly(proc: subprocess.Popen[bytes], addr: Path, addresses: dict[str, str]) -> str:
    _, err = proc.communicate(timeout=60)
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert not addr.exists()
    for endpoint in addresses.values():
        assert not os.path.exists(endpoint[len("ipc://"):])
    assert not os.path.exists(os.path.dirname(addresses["frontend"][len("ipc://"):]))
    return stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_stop_signal_during_shutdown_is_ignored(tmp_path: Path, signum: int) -> None:
    for attempt in range(3):
        addr = tmp_path / f"a{attempt}.json"
        proc = serve("--engines", "1", "--addr-file", str(addr))
        wait_for_file(addr, proc)
        addresses = json.loads(addr.read_text())
        proc.send_signal(signum)
        proc.send_signal(signum)
        stops_cleanly(proc, addr, addresses)


def wait_for_line(proc: subprocess.Popen[bytes], text: bytes) -> bytes:
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    seen = b""
    while text not in seen:
        assert time.monotonic() < deadline, seen.decode()
        line = proc.stderr.readline()
        assert line, f"stderr closed: exit {proc.wait(10)}: {seen.decode()}"
        seen += line
    return seen


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_stop_signal_during_cleanup_is_ignored(tmp_path: Path, signum: int) -> None:
    """The window that killed it: after the loop ends, while sockets and files go."""
    addr = tmp_path / "a.json"
    proc = serve("--engines", "1", "--addr-file", str(addr))
    wait_for_file(addr, proc)
    addresses = json.loads(addr.read_text())
    proc.send_signal(signum)
    wait_for_line(proc, b"closing the sockets")
    proc.send_signal(signum)
    stops_cleanly(proc, addr, addresses)


def test_timeout_style_signal_to_the_child_then_its_group(tmp_path: Path) -> None:
    """GNU timeout signals the child, then the whole group."""
    for attempt in range(3):
        addr = tmp_path / f"a{attempt}.json"
        proc = serve_in_own_group("--engines", "1", "--addr-file", str(addr))
        wait_for_file(addr, proc)
        addresses = json.loads(addr.read_text())
        os.kill(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGTERM)
        stops_cleanly(proc, addr, addresses)


def test_sighup_keeps_serving_and_says_so(tmp_path: Path) -> None:
    addr = tmp_path / "a.json"
    proc = serve("--engines", "1", "--addr-file", str(addr))
    wait_for_file(addr, proc)
    addresses = json.loads(addr.read_text())
    proc.send_signal(signal.SIGHUP)
    seen = wait_for_line(proc, b"SIGHUP received")
    assert b"nothing to reload" in seen
    assert proc.poll() is None
    assert addr.exists()
    proc.send_signal(signal.SIGTERM)
    stops_cleanly(proc, addr, addresses)


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keys = tmp_path_factory.mktemp("keys")
    for name in ("coordinator", "client"):
        subprocess.run([sys.executable, "-m", "coordinator", "keygen", "--dir", str(keys),
                        "--name", name], check=True, capture_output=True, timeout=60)
    clients = keys / "clients"
    clients.mkdir()
    (clients / "client.key").write_bytes((keys / "client.key").read_bytes())
    (keys / "garbage.key_secret").write_text("this is not a key file\n")
    return keys


@pytest.mark.parametrize(
    ("secret", "clients", "message"),
    [
        ("missing.key_secret", "clients", "cannot read key file"),
        ("coordinator.key", "clients", "holds only a public key"),
        ("garbage.key_secret", "clients", "garbage.key_secret"),
        ("coordinator.key_secret", "no-such-dir", "does not exist"),
    ],
)
def test_curve_key_problems_are_one_line_and_exit_2(
        curve_keys: Path, secret: str, clients: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--engines", "1", "--host", "127.0.0.1",
         "--curve-secret-key", str(curve_keys / secret),
         "--curve-clients-dir", str(curve_keys / clients)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_curve_keys_on_ipc_only_and_a_readable_secret_key_are_warned_about(
        curve_keys: Path, tmp_path: Path) -> None:
    secret = tmp_path / "coordinator.key_secret"
    secret.write_bytes((curve_keys / "coordinator.key_secret").read_bytes())
    secret.chmod(0o644)
    addr = tmp_path / "a.json"
    proc = serve("--engines", "1", "--addr-file", str(addr), "--curve-secret-key", str(secret),
                 "--curve-clients-dir", str(curve_keys / "clients"))
    wait_for_file(addr, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert b"can be read by its group or by everyone" in err
    assert b"protect nothing" in err


def one_error_line(*args: str) -> tuple[int, str]:
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--engines", "1", *args],
        capture_output=True, text=True, timeout=60,
    )
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    return result.returncode, errors[0]


def test_an_unwritable_address_file_directory_is_named_as_the_cause(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "a.json"
    code, error = one_error_line("--addr-file", str(missing))
    assert code == 2
    assert "could not bind" not in error
    assert f"cannot write the address file {missing}" in error, error


def test_an_unresolvable_host_is_said_not_to_resolve() -> None:
    code, error = one_error_line("--host", "no-such-host.invalid")
    assert code == 2
    assert "does not resolve" in error and "CURVE" not in error, error


def test_a_taken_port_names_its_socket() -> None:
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, error = one_error_line("--host", "127.0.0.1",
                                     "--bind", f"dispatch=tcp://127.0.0.1:{port}")
    assert code == 1
    assert f"socket dispatch on tcp://127.0.0.1:{port}" in error, error


def test_sigusr1_dumps_the_recorder_at_info(tmp_path: Path) -> None:
    addr = tmp_path / "a.json"
    proc = serve("--engines", "1", "--addr-file", str(addr))
    wait_for_file(addr, proc)
    addresses = json.loads(addr.read_text())
    proc.send_signal(signal.SIGUSR1)
    seen = wait_for_line(proc, b"flight recorder:")
    line = next(line for line in seen.splitlines() if b"flight recorder:" in line)
    assert b" INFO " in line, line
    proc.send_signal(signal.SIGTERM)
    stops_cleanly(proc, addr, addresses)


@pytest.mark.parametrize("where", ["missing-dir", "a-directory", "proc"])
def test_an_unusable_state_file_is_refused_at_start_up(tmp_path: Path, where: str) -> None:
    path = {
        "missing-dir": tmp_path / "no-such-dir" / "state.json",
        "a-directory": tmp_path,
        "proc": Path("/proc/dpc-state.json"),  # no one, root included, creates files there
    }[where]
    addr = tmp_path / "a.json"
    code, error = one_error_line("--state-file", str(path), "--addr-file", str(addr))
    assert code == 2
    assert str(path) in error and "state file" in error, error
    assert not addr.exists(), "it never reported ready"
