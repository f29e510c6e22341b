"""The coordinator's temporary directories: named after the process that made them, so
that a later start-up can remove those whose process is gone.

A coordinator removes its own at exit; one killed (SIGKILL, a crash, the OOM killer)
cannot. Each start-up sweeps the temp directory for ``dp-coordinator-<kind>-<pid>-*``
directories of this user whose process no longer exists. A directory whose pid is
alive (perhaps reused by another process) is left alone: removing a live
coordinator's sockets would cut it off.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Final

log = logging.getLogger("coordinator.server")

PREFIXES: Final = {"ipc": "dp-coordinator-ipc-", "admin": "dp-coordinator-admin-"}
_OWN_NAME: Final = re.compile(r"^dp-coordinator-(?:ipc|admin)-(\d+)-[^/]+$")


def make_own_dir(kind: str) -> str:
    """A new private temporary directory for `kind` (``ipc`` or ``admin``)."""
    return tempfile.mkdtemp(prefix=f"{PREFIXES[kind]}{os.getpid()}-")


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def sweep_stale_dirs(directory: str | None = None) -> list[str]:
    """Remove the directories coordinators that are gone left in `directory` (the temp
    directory by default); return their paths."""
    directory = directory or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _OWN_NAME.match(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(
                    follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if process_exists(int(match.group(1))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            removed.append(entry.path)
    if removed:
        log.info("removed %d temporary director%s left by coordinators that are gone: %s",
                 len(removed), "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed
