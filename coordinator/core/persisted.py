"""What a coordinator keeps across its own restart: the state file's contents.

Engines re-report their wave and loads, and their sockets reconnect by
themselves, but a stock vLLM engine never says HELLO again and a frontend's
registration is not repeated either. The state file keeps exactly that: the
settled registrations, the frontends, whether the start-up gate had opened and
whether INITs went out, and the last wave (a floor: engine reports can only
move it forward).

Not kept, on purpose: requests in flight. Their outputs go from engine to
frontend without passing through the coordinator, so they still finish; what a
restart loses is the routing entry used to forward an abort or to report the
request failed if its rank dies.

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


class SavedState(msgspec.Struct):
    version: int
    wave: int
    gate_open: bool
    inits_sent: bool
    leases: list[SavedLease]
    frontends: list[SavedFrontend]
    addresses: dict[str, str]
