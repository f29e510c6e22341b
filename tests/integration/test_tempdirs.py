"""A killed coordinator's temporary directories are removed by the next one to start.

Real processes: `serve` on private ipc (no --ipc-dir) with its own TMPDIR, killed
with SIGKILL, so it cannot clean up; a second one started with the same TMPDIR finds
and removes what the first left, and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.launch import stop_process
from coordinator.server.tempdirs import sweep_stale_dirs

pytestmark = pytest.mark.timeout(120)

STEP = 5.0


class Serve:
    def __init__(self, tmpdir: Path, addr_file: Path, extra: list[str]) -> None:
        self.tmpdir = tmpdir
        env = {**os.environ, "TMPDIR": str(tmpdir)}
        self.log = addr_file.with_suffix(".log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "coordinator", "serve", "--engines", "1",
                 "--addr-file", str(addr_file), *extra],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 4 * STEP
        while not addr_file.exists():
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "no address file"
            time.sleep(0.02)
        self.addresses: dict[str, str] = json.loads(addr_file.read_text())

    def dirs(self) -> set[str]:
        """The directories it made in the temp directory for its ipc sockets."""
        paths = [Path(a[len("ipc://"):]) for a in self.addresses.values()
                 if a.startswith("ipc://")]
        return {str(self.tmpdir / p.relative_to(self.tmpdir).parts[0]) for p in paths}


@pytest.fixture
def started() -> Iterator[list[Serve]]:
    running: list[Serve] = []
    yield running
    for serve in running:
        stop_process(serve.process, timeout=STEP)


@pytest.mark.parametrize(("extra", "made"), [
    ([], ["dp-coordinator-ipc-"]),  # the six sockets and the admin socket's admin.d
    (["--host", "127.0.0.1"], ["dp-coordinator-admin-"]),  # tcp: only the admin socket
])
def test_the_next_start_up_removes_what_a_killed_coordinator_left(
    tmp_path: Path, started: list[Serve], extra: list[str], made: list[str]
) -> None:
    tmpdir = Path(tempfile.mkdtemp(prefix="dpc-t-"))  # short: unix socket paths
    try:
        first = Serve(tmpdir, tmp_path / "first.json", extra)
        started.append(first)
        left = first.dirs()
        assert sorted(Path(d).name.rsplit("-", 1)[0] + "-" for d in left) == [
            f"{prefix}{first.process.pid}-" for prefix in made], left
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=4 * STEP)
        assert all(Path(d).is_dir() for d in left)  # a killed process cleans nothing
        # Not the coordinator's: a live pid's directory, an older name, another file.
        live = tmpdir / f"dp-coordinator-admin-{os.getpid()}-abc"
        older = tmpdir / "dp-coordinator-admin-k2j4h"
        for path in (live, older):
            path.mkdir()
        (tmpdir / f"dp-coordinator-ipc-{first.process.pid}-file").write_text("")

        second = Serve(tmpdir, tmp_path / "second.json", extra)
        started.append(second)
        assert not any(Path(d).exists() for d in left)
        assert live.is_dir() and older.is_dir()
        assert (tmpdir / f"dp-coordinator-ipc-{first.process.pid}-file").is_file()
        assert all(Path(d).is_dir() for d in second.dirs())
        assert "left by coordinators that are gone" in second.log.read_text()
        assert stop_process(second.process, timeout=STEP) == 0
        assert not any(Path(d).exists() for d in second.dirs())
    finally:
        for path in sorted(tmpdir.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        tmpdir.rmdir()


def test_a_missing_temp_directory_is_no_error(tmp_path: Path) -> None:
    assert sweep_stale_dirs(str(tmp_path / "absent")) == []
