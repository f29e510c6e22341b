"""Reading and writing the state file (`--state-file`): IO only.

What goes into the file, and why, is the core's business
(`coordinator.core.persisted`); this module writes it atomically and reads it
back, refusing a file it cannot use with advice on what to do.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import msgspec

from coordinator.core.persisted import STATE_VERSION, SavedState

__all__ = [
    "STATE_VERSION", "SavedState", "StateFileError", "check_writable", "load_state",
    "remove_stale_temps", "save_state",
]


class StateFileError(RuntimeError):
    """The state file exists but cannot be used; the message says what to do."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SavedState)


def save_state(path: str, state: SavedState, *, durable: bool = False) -> None:
    """Write atomically: a crash mid-write leaves the previous file intact.

    `durable` adds an fsync, for shutdown: without it the file survives the
    process being killed (the page cache outlives it) but not the machine dying.
    """
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(_encoder.encode(state))
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_writable(path: str) -> None:
    """StateFileError unless `save_state` can write `path`: said at start-up, not at
    the first save (a state file that cannot be written protects nothing)."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise StateFileError(f"cannot use the state file {path}: it is a directory")
    if not os.path.isdir(directory):
        raise StateFileError(f"cannot write the state file {path}: its directory "
                             f"{directory} does not exist")
    try:
        # What save_state does: a temporary file beside it, renamed over it.
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), dir=directory)
    except OSError as exc:
        raise StateFileError(f"cannot write the state file {path}: cannot create files in "
                             f"{directory} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(tmp)
    if os.path.exists(path) and not os.access(path, os.R_OK):
        raise StateFileError(f"cannot read the state file {path}: permission denied")


def _temp_prefix(path: str) -> str:
    # Named after the state file, so start-up removes only this file's leftovers
    # even when other coordinators keep their state in the same directory.
    return f".{os.path.basename(path)}.state-"


def remove_stale_temps(path: str) -> list[str]:
    """Remove what a write killed mid-way (kill -9) left beside `path`; the names removed.

    Only at start-up, before this process writes: no write of ours is under way,
    and a state file has one coordinator.
    """
    directory = os.path.dirname(os.path.abspath(path)) or "."
    prefix = _temp_prefix(path)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed


def load_state(path: str) -> SavedState | None:
    """The saved state, or None if there is no file yet; stale temporary files are removed."""
    remove_stale_temps(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        return None
    try:
        state = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StateFileError(
            f"state file {path} is unreadable ({exc}); move it away to start from an empty "
            "state (engines re-report waves and loads; stock vLLM engines must then be "
            "restarted to register again)"
        ) from None
    if state.version != STATE_VERSION:
        raise StateFileError(
            f"state file {path} has version {state.version}, this coordinator reads "
            f"version {STATE_VERSION}; move it away to start from an empty state"
        )
    return state
