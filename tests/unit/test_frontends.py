"""Frontend registrations, the INIT hold and the output-address pin, row by row."""

from __future__ import annotations

import pytest

from coordinator.core.frontends.registry import (
    FrontendPeer,
    FrontendRegistry,
    InitStep,
    RegisterVerdict,
    init_step,
    register_verdict,
)

A, B = b"\x00conn-a", b"\x00conn-b"


def verdict(**overrides: object) -> RegisterVerdict:
    args: dict[str, object] = {
        "client_index": 0, "identity": A, "output_address": "ipc:///o", "previous": None,
        "expected": 0, "max_frontends": 8, "inits_sent": False, "pinned": None,
    }
    args.update(overrides)
    return register_verdict(**args)  # type: ignore[arg-type]


PEER = FrontendPeer(A, 0, "ipc:///o", None)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"client_index": 2, "expected": 2}, RegisterVerdict.OUT_OF_RANGE),
        # Without K the limit is max_frontends; with K above it, K frontends still fit.
        ({"client_index": 8}, RegisterVerdict.OUT_OF_RANGE),
        ({"expected": 10, "client_index": 9}, RegisterVerdict.NEW),
        # An index an INIT carried keeps its address, registered or not.
        ({"pinned": "ipc:///other"}, RegisterVerdict.PINNED),
        ({"pinned": "ipc:///o"}, RegisterVerdict.NEW),
        ({"client_index": 8, "pinned": "ipc:///other"}, RegisterVerdict.OUT_OF_RANGE),
        ({"previous": PEER, "output_address": "ipc:///moved", "inits_sent": True},
         RegisterVerdict.PINNED),
        # Before any INIT went out the address may still move.
        ({"previous": PEER, "output_address": "ipc:///moved"}, RegisterVerdict.RENEWED),
        ({"previous": PEER, "identity": B, "inits_sent": True}, RegisterVerdict.MOVED),
        ({"previous": PEER, "pinned": "ipc:///o"}, RegisterVerdict.RENEWED),
        ({}, RegisterVerdict.NEW),
    ],
)
def test_register_verdict_rows(overrides: dict[str, object], expected: RegisterVerdict) -> None:
    assert verdict(**overrides) is expected


@pytest.mark.parametrize(
    ("expected", "registered", "step"),
    [(0, 0, InitStep.SEND), (2, 2, InitStep.SEND), (2, 3, InitStep.SEND),
     (2, 1, InitStep.HOLD), (1, 0, InitStep.HOLD)],
)
def test_init_hold_rows(expected: int, registered: int, step: InitStep) -> None:
    assert init_step(expected=expected, registered=registered) is step


def test_held_inits_go_out_at_the_kth_registration_and_only_once() -> None:
    registry = FrontendRegistry(expected=2, max_frontends=8)
    assert registry.init_step() is InitStep.HOLD
    registry.hold_init(1, b"\x01\x00")
    registry.hold_init(0, b"\x00\x00")
    registry.hold_init(1, b"\x01\x00")  # a repeated HELLO keeps one entry
    registry.register(0, A, "ipc:///o0", None)
    assert registry.release_inits() == []
    registry.register(1, B, "ipc:///o1", "ipc:///i1")
    assert registry.release_inits() == [(0, b"\x00\x00"), (1, b"\x01\x00")]
    assert registry.release_inits() == []
    assert registry.init_step() is InitStep.SEND
    assert registry.output_addresses() == ["ipc:///o0", "ipc:///o1"]
    assert registry.input_addresses() == ["ipc:///i1"]


def test_a_refused_registration_changes_nothing_and_says_why() -> None:
    registry = FrontendRegistry(expected=0, max_frontends=1)
    assert registry.register(0, A, "ipc:///o", None).verdict is RegisterVerdict.NEW
    registry.inits_sent = True
    full = registry.register(1, B, "ipc:///p", None)
    assert full.verdict is RegisterVerdict.OUT_OF_RANGE
    assert full.refusal == "client_index 1 is outside 0..0 (at most 1 frontends)"
    pinned = registry.register(0, B, "ipc:///elsewhere", None)
    assert pinned.verdict is RegisterVerdict.PINNED
    assert pinned.refusal is not None and "ipc:///o, which engines already use" in pinned.refusal
    assert registry.peers() == [FrontendPeer(A, 0, "ipc:///o", None)]


def test_out_of_range_names_the_flag() -> None:
    registry = FrontendRegistry(expected=2, max_frontends=8)
    result = registry.register(3, A, "ipc:///o", None)
    assert result.refusal == (
        "client_index 3 is outside 0..1 (the coordinator was started with --frontends 2)"
    )
    assert len(registry) == 0


def test_a_new_connection_takes_the_index_over() -> None:
    registry = FrontendRegistry(expected=0, max_frontends=8)
    registry.register(0, A, "ipc:///o", None)
    moved = registry.register(0, B, "ipc:///o", None)
    assert moved.verdict is RegisterVerdict.MOVED and moved.previous == PEER
    assert registry.identities() == [B]


def test_saved_and_restored_registrations_round_trip() -> None:
    registry = FrontendRegistry(expected=0, max_frontends=8)
    registry.register(1, B, "ipc:///o1", None)
    registry.register(0, A, "ipc:///o0", "ipc:///i0")
    again = FrontendRegistry(expected=0, max_frontends=8)
    again.restore(registry.saved(), inits_sent=True)
    assert again.peers() == registry.peers() and again.inits_sent


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        FrontendRegistry(expected=-1, max_frontends=8)
