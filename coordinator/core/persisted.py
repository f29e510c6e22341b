"""What a coordinator keeps across its own restart: the state file's contents.

Engines re-report their wave and loads, and their sockets reconnect by
themselves, but a stock vLLM engine never says HELLO again and a frontend's
registration is not repeated either. The state file keeps exactly that: the
settled registrations, the frontends, whether the start-up gate had opened and
whether INITs went out (and the output addresses they carried), and the last
wave (a floor: engine reports can only move it forward).

Not kept, on purpose: requests in flight (the file would be rewritten on every
submit). Their outputs go from engine to frontend without passing through the
coordinator, so they still finish; if their rank dies later, every registered
frontend is told (``RankLost``) and the SDK fails the requests it sent there
itself, the ones the new process never heard of included. What a restart loses
is only an abort through the coordinator for a request sent before it.

These are plain data (msgspec structs, written as JSON by the server); the
core builds them (``CoordinatorCore.saved_state``) and restores from them
(the ``Restore`` event). Field names and order are the file format.
"""

from __future__ import annotations

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


class SavedBootstrapEntry(msgspec.Struct):
    """One DP rank's entry of the KV bootstrap registry (``core.bootstrap``)."""

    dp_rank: int
    engine_id: str
    workers: dict[int, dict[int, str]]
    """``{tp_rank: {pp_rank: side-channel address}}``."""


class SavedState(msgspec.Struct, omit_defaults=True):
    version: int
    wave: int
    gate_open: bool
    inits_sent: bool
    leases: list[SavedLease]
    frontends: list[SavedFrontend]
    addresses: dict[str, str]
    pinned: dict[int, str] | None = None
    """Output addresses by client index that INITs carried (``core.frontends``), whether
    or not a frontend holds the index now. Added without a version change: it is
    written only when there are pins, a file without it reads as None (no pins), and
    older coordinators ignore it."""
    kv_bootstrap: list[SavedBootstrapEntry] | None = None
    """The KV bootstrap registry's entries (``--kv-bootstrap-port``): prefill workers
    register once, at start-up, so a restarted coordinator must still know them. Added
    like ``pinned``: written only when the registry is served, None when absent."""
