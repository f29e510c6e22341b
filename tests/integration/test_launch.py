"""`coordinator.launch`: start-up failures say why, stopping never raises, nothing is left.

Every process here is a real `python -m coordinator serve`. The temp dir is
private to each test, so "no file left behind" is "that directory is empty".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.launch import (
    KILL_WAIT_S,
    LAUNCHER_FLAGS,
    SIGTERM_GRACE_S,
    CoordinatorHandle,
    LauncherFlagError,
    LaunchError,
    find_flags,
    launch,
    serve_option_names,
    stop_process,
    unknown_flags,
)


@pytest.fixture
def scratch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private temp dir for `launch` (its launch directory lands here), checked empty."""
    root = Path(tempfile.mkdtemp(prefix="launch-"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    try:
        yield root
    finally:
        monkeypatch.undo()
        while _started:
            _started.pop().shutdown(timeout=5.0)
        leftovers = sorted(str(p) for p in root.rglob("*"))
        subprocess.run(["rm", "-rf", str(root)], check=True)
        assert leftovers == [], f"files left behind: {leftovers}"


_started: list[CoordinatorHandle] = []


def start(**kwargs: object) -> CoordinatorHandle:
    kwargs.setdefault("timeout", 20.0)
    handle = launch(engines=2, **kwargs)  # type: ignore[arg-type]
    _started.append(handle)
    return handle


def test_a_healthy_coordinator_stops_cleanly_with_timeout_zero(scratch: Path) -> None:
    handle = start()
    launch_dir = os.path.dirname(handle.addr_file)
    sockets = [a.removeprefix("ipc://") for a in handle.addresses.values()]
    # launch owns the ipc directory too: it sits in the launch directory.
    assert all(path.startswith(launch_dir + os.sep) for path in sockets)
    assert all(os.path.exists(path) for path in sockets)
    assert handle.shutdown(timeout=0.0) == 0
    assert not os.path.exists(launch_dir)
    assert "coordinator stopped" in handle.stderr_text()  # kept after the directory went
    assert handle.shutdown(timeout=0.0) == 0  # again: nothing to do


def test_a_stopped_coordinator_is_killed_and_its_sockets_removed(scratch: Path) -> None:
    handle = start()
    os.kill(handle.pid, signal.SIGSTOP)
    begun = time.monotonic()
    assert handle.shutdown(timeout=0.0) == -signal.SIGKILL
    assert SIGTERM_GRACE_S - 0.1 <= time.monotonic() - begun < SIGTERM_GRACE_S + KILL_WAIT_S
    # The child could not remove its ipc files; the launch directory held them.


def test_a_dead_coordinator_shuts_down_at_once(scratch: Path) -> None:
    handle = start()
    os.kill(handle.pid, signal.SIGKILL)
    handle.process.wait(5.0)
    begun = time.monotonic()
    assert handle.shutdown(timeout=None) == -signal.SIGKILL
    assert time.monotonic() - begun < 1.0


def test_a_child_that_ignores_sigterm_gets_the_timeout_then_sigkill() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "print('ready', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    begun = time.monotonic()
    assert stop_process(child, timeout=SIGTERM_GRACE_S + 0.5) == -signal.SIGKILL
    assert SIGTERM_GRACE_S + 0.4 <= time.monotonic() - begun < SIGTERM_GRACE_S + 0.5 + KILL_WAIT_S
    child.stdout.close()


def test_exit_during_start_up_raises_with_the_reason_and_leaves_nothing(scratch: Path) -> None:
    with pytest.raises(LaunchError) as failed:
        start(extra_args=["--heartbeat-s", "0.01"])
    message = str(failed.value)
    assert "exited with code 2 during start-up" in message
    assert "need 0 < --publish-interval-ms <= --heartbeat-s" in message


def test_a_start_up_timeout_carries_the_log_tail(scratch: Path) -> None:
    """The log lives in the launch directory, which is gone when the error is raised."""
    hang = Path(tempfile.mkdtemp(prefix="hang-", dir="/tmp"))
    try:
        (hang / "sitecustomize.py").write_text(
            "import sys, time\n"
            "sys.stderr.write('stuck before serving: planted by the test\\n')\n"
            "sys.stderr.flush()\n"
            "time.sleep(60)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(hang)}
        with pytest.raises(LaunchError) as failed:
            start(timeout=1.0, env=env)
    finally:
        subprocess.run(["rm", "-rf", str(hang)], check=True)
    message = str(failed.value)
    assert "did not write" in message and "within 1 s" in message
    assert message.endswith("stuck before serving: planted by the test")


def test_a_silent_failure_still_has_a_reason(scratch: Path) -> None:
    """A child that says nothing: the reason says so instead of being empty."""
    quiet = Path(tempfile.mkdtemp(prefix="quiet-", dir="/tmp"))
    try:
        (quiet / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
        with pytest.raises(LaunchError) as failed:
            start(env={**os.environ, "PYTHONPATH": str(quiet)})
    finally:
        subprocess.run(["rm", "-rf", str(quiet)], check=True)
    assert str(failed.value).endswith("(the coordinator wrote nothing to stderr)")


@pytest.mark.parametrize("extra", [
    ["--addr-file", "x.json"],
    ["--addr-file=x.json"],
    ["--addr", "x.json"],
    ["--engines", "3"],
    ["--host=127.0.0.1"],
    ["--no-wave"],
])
def test_launcher_flags_in_extra_args_are_refused_before_anything_starts(
    scratch: Path, extra: list[str]
) -> None:
    begun = time.monotonic()
    with pytest.raises(LauncherFlagError, match="use the keywords"):
        start(extra_args=extra)
    assert time.monotonic() - begun < 1.0
    assert not os.path.exists("x.json")


# ---- how flags are recognised -------------------------------------------------------------


def test_serve_options_match_the_serve_parser() -> None:
    import argparse

    from coordinator.cli import build_parser

    parsers = [action for action in build_parser()._actions
               if isinstance(action, argparse._SubParsersAction)]
    serve = parsers[0].choices["serve"]
    assert serve_option_names() == {
        option for option in serve._option_string_actions if option.startswith("--")
    }


def test_unknown_flags_are_what_serve_would_refuse() -> None:
    args = ["--metrics-port", "9400", "--metrics-prot", "1", "--ho=h", "--h", "x",
            "--state-file=s", "-v", "value", "--", "--after"]
    # --h abbreviates --host, --heartbeat-s and --handshake-timeout-s; --ho only --host.
    assert unknown_flags(args) == ["--metrics-prot", "--h"]
    assert unknown_flags([]) == []


def test_find_flags_sees_every_spelling_argparse_accepts() -> None:
    known = serve_option_names()
    assert set(LAUNCHER_FLAGS) <= known and "--metrics-port" in known
    args = ["--addr-file", "a", "--addr-file=b", "--addr", "c", "--engines=4",
            "--metrics-port", "9400", "--log-level", "debug", "--no-wave", "--", "--host"]
    assert find_flags(args, LAUNCHER_FLAGS) == [
        ("--addr-file", "--addr-file"),
        ("--addr-file", "--addr-file=b"),
        ("--addr-file", "--addr"),
        ("--engines", "--engines=4"),
        ("--no-wave-coordination", "--no-wave"),
    ]  # nothing after "--"
    # An ambiguous prefix (`--h`: --host, --heartbeat-s, --handshake-timeout-s) is
    # refused by `serve` itself; an unknown flag too.
    assert find_flags(["--h", "x", "--hostname", "y", "-e", "3", "x.json"], LAUNCHER_FLAGS) == []
    assert find_flags(["--ho", "h"], LAUNCHER_FLAGS) == [("--host", "--ho")]
