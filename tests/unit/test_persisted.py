"""The state file's format: pinned bytes, so moving the structs can never change it."""

from __future__ import annotations

import msgspec

from coordinator.core.persisted import (
    STATE_VERSION,
    SavedFrontend,
    SavedLease,
    SavedState,
)

# A version-1 file as the coordinator has written it since the state file exists.
GOLDEN = (
    b'{"version":1,"wave":7,"gate_open":true,"inits_sent":true,'
    b'"leases":[{"rank":0,"engine_id":"e0","incarnation":3,"state":"ready","local":true,'
    b'"headless":false,"parallel_config_hash":"abc"},{"rank":1,"engine_id":null,'
    b'"incarnation":1,"state":"cordoned","local":false,"headless":true,'
    b'"parallel_config_hash":null}],'
    b'"frontends":[{"client_index":0,"identity_hex":"00aa","output_address":"ipc:///o0",'
    b'"input_address":null}],'
    b'"addresses":{"dispatch":"ipc:///d"}}'
)

STATE = SavedState(
    version=1,
    wave=7,
    gate_open=True,
    inits_sent=True,
    leases=[
        SavedLease(0, "e0", 3, "ready", True, False, "abc"),
        SavedLease(1, None, 1, "cordoned", False, True, None),
    ],
    frontends=[SavedFrontend(0, "00aa", "ipc:///o0", None)],
    addresses={"dispatch": "ipc:///d"},
)


def test_the_version_is_still_one() -> None:
    assert STATE_VERSION == 1


def test_encoding_is_byte_identical_to_the_golden_file() -> None:
    assert msgspec.json.encode(STATE) == GOLDEN


def test_the_golden_file_decodes_to_the_same_state() -> None:
    assert msgspec.json.decode(GOLDEN, type=SavedState) == STATE


def test_pinned_output_addresses_are_an_optional_field_of_version_one() -> None:
    # Written only when there are pins; older files and older readers are unaffected.
    with_pins = msgspec.structs.replace(STATE, pinned={0: "ipc:///o0", 3: "ipc:///gone"})
    raw = msgspec.json.encode(with_pins)
    assert raw == GOLDEN[:-1] + b',"pinned":{"0":"ipc:///o0","3":"ipc:///gone"}}'
    assert msgspec.json.decode(raw, type=SavedState) == with_pins
    assert msgspec.json.decode(GOLDEN, type=SavedState).pinned is None
