"""The little a restarted coordinator cannot learn again from its peers.

Engines re-report their wave and loads, and their sockets reconnect by
themselves, but a stock vLLM engine never says HELLO again and a frontend's
registration is not repeated either. `--state-file` keeps exactly that: the
settled registrations, the frontends, whether the start-up gate had opened, and
the last wave (a floor: engine reports can only move it forward).

Not kept, on purpose: requests in flight. Their outputs go from engine to
frontend without passing through here, so they still finish; what a restart
loses is the routing entry used to forward an abort or to report the request
failed if its rank dies.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import msgspec

STATE_VERSION = 1


class SavedLease(msgspec.Struct):
    rank: int
    engine_id: str | None
    incarnation: int
    state: str
    local: bool
    headless: bool
    parallel_config_hash: str | None


class SavedFrontend(msgspec.Struct):
    client_index: int
    identity_hex: str
    output_address: str
    input_address: str | None


class SavedState(msgspec.Struct):
    version: int
    wave: int
    gate_open: bool
    inits_sent: bool
    leases: list[SavedLease]
    frontends: list[SavedFrontend]
    addresses: dict[str, str]


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
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=directory)
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


def load_state(path: str) -> SavedState | None:
    """The saved state, or None if there is no file yet."""
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
