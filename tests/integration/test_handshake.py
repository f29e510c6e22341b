"""The engine handshake against a real coordinator process, over ipc and tcp.

Peers are raw pyzmq sockets sending vLLM 0.33's bytes (tests/vllm_peers.py),
so these tests check the coordinator's wire behaviour, not the project's codecs:
HELLO -> INIT (addresses and parallel_config), the back_publish subscription
gate, the greeting on dispatch, READY -> ACCEPTED, every refusal, and INIT
held back until the expected frontends registered.
"""

from __future__ import annotations

import ast
import random
import time
from typing import Any

import pytest
import zmq

from tests.conftest import TRANSPORTS, CoordinatorFactory
from tests.vllm_peers import (
    ACCEPTED_REPLY,
    IDENTITY_ERROR_PREFIX,
    READY,
    RawEngine,
    RawFrontend,
    error_reply,
    handshake_group,
    hello_payload,
    init_payload,
    is_lease_probe,
    pack,
    ready_payload,
    recv_frames,
    unpack,
    wait_until,
)

Ctx = zmq.Context[zmq.Socket[bytes]]

PARALLEL_CONFIG_KEYS = {
    "data_parallel_master_ip",
    "data_parallel_master_port",
    "_data_parallel_master_port_list",
    "data_parallel_size",
}


def reason_of(reply: bytes) -> str:
    """The reason of an ERROR reply, checking the reply is exactly vLLM-style ERROR bytes."""
    decoded = unpack(reply)
    assert isinstance(decoded, dict) and decoded.get("status") == "ERROR", decoded
    assert list(decoded) == ["status", "reason"], decoded
    reason = decoded["reason"]
    assert reply == error_reply(reason)
    return str(reason)


def assert_no_internal_errors(counters: dict[str, int]) -> None:
    bad = {k: v for k, v in counters.items() if k.startswith("internal_error")}
    assert not bad, f"handler exceptions: {bad}"


def check_init(init_raw: bytes, addresses: dict[str, str], *, dp_size: int,
               outputs: list[str] | None = None, inputs: list[str] | None = None) -> dict[str, Any]:
    init = unpack(init_raw)
    assert list(init) == ["addresses", "parallel_config"]
    addrs = init["addresses"]
    assert list(addrs) == [
        "inputs", "outputs", "coordinator_input", "coordinator_output",
        "frontend_stats_publish_address",
    ]
    assert addrs["inputs"][0] == addresses["dispatch"]
    if inputs is not None:
        assert addrs["inputs"] == inputs
    assert addrs["outputs"] == (outputs or [])
    assert addrs["coordinator_input"] == addresses["back_publish"]
    assert addrs["coordinator_output"] == addresses["back_output"]
    assert addrs["frontend_stats_publish_address"] == addresses["front_publish"]
    pc = init["parallel_config"]
    assert set(pc) >= PARALLEL_CONFIG_KEYS, pc
    assert set(pc) <= PARALLEL_CONFIG_KEYS | {"_coord_store_port"}, pc
    assert pc["data_parallel_size"] == dp_size
    assert isinstance(pc["data_parallel_master_ip"], str) and pc["data_parallel_master_ip"]
    assert isinstance(pc["data_parallel_master_port"], int)
    assert 0 < pc["data_parallel_master_port"] < 65536
    ports = pc["_data_parallel_master_port_list"]
    assert isinstance(ports, list) and all(isinstance(p, int) and 0 < p < 65536 for p in ports)
    # Byte-identical to vLLM's launcher encoding of EngineHandshakeMetadata.
    assert init_raw == init_payload(addrs, pc)
    return init  # type: ignore[no-any-return]


# ---- the happy path ------------------------------------------------------------


@pytest.mark.parametrize(
    ("engines", "transport"),
    [(1, "ipc"), (2, "ipc"), (4, "ipc"), (16, "ipc"), (4, "tcp"), (16, "tcp")],
)
def test_group_handshake_in_random_order(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, engines: int, transport: str
) -> None:
    """HELLO -> INIT, gate opens only at the Nth subscription, READY (no reply for vLLM)."""
    handle = coordinator(engines, transport=transport)
    addrs = handle.addresses
    rng = random.Random(1000 + engines)
    peers: dict[int, RawEngine] = {}
    order = list(range(engines))
    rng.shuffle(order)
    parallel_configs = []
    for rank in order:
        peers[rank] = RawEngine(zmq_ctx, addrs, rank, dp_size=engines)  # connects now
        peers[rank].send_handshake(hello_payload(local=True, headless=False))
        raw = peers[rank].expect_handshake()
        init = check_init(raw, addrs, dp_size=engines)
        peers[rank].init = init
        parallel_configs.append(init["parallel_config"])
        peers[rank].connect_plane()
    # Every rank must get the same torch DP meeting point.
    assert all(pc == parallel_configs[0] for pc in parallel_configs)

    rng.shuffle(order)
    for count, rank in enumerate(order, start=1):
        peers[rank].subscribe()
        peers[rank].greet()
        if count < engines:
            # Give the coordinator time to read this subscription, then check that
            # nobody has been released yet.
            quiet = 0.25 if count == engines - 1 else 0.02
            for earlier in order[:count]:
                assert peers[earlier].recv_publish(quiet if earlier == rank else 0) is None
    for rank in order:
        assert peers[rank].expect_publish() == [READY]
    # Exactly one READY each: nothing else follows on back_publish.
    for rank in order:
        assert peers[rank].recv_publish(0.05 if rank == order[0] else 0.0) is None

    rng.shuffle(order)
    for rank in order:
        peers[rank].send_handshake(ready_payload(parallel_config_hash="0123abcd"))
    # vLLM engines close their handshake socket after READY: nothing is sent back.
    front = RawFrontend(zmq_ctx, addrs)
    wait_until(lambda: [e[1] for e in front.state()["engines"]] == ["ready"] * engines,
               what="every rank ready")
    assert all(peers[rank].recv_handshake(0.0) is None for rank in order)
    state = front.state()
    assert [e[1] for e in state["engines"]] == ["ready"] * engines
    assert [e[0] for e in state["engines"]] == list(range(engines))
    counters = state["counters"]
    assert counters["handshake.hello.accepted"] == engines
    assert counters["handshake.ready.accepted"] == engines
    assert counters["dispatch.greetings"] == engines
    assert not any(k.startswith("refused.") for k in counters), counters
    assert_no_internal_errors(counters)
    assert handle.is_alive()


def test_stock_vllm_engine_bytes_complete_the_handshake(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Hand-written vLLM 0.33 bytes (no helpers at all) get a stock engine to READY."""
    handle = coordinator(2)
    addrs = handle.addresses
    hello = (
        b"\x83\xa6status\xa5HELLO\xa5local\xc3\xa8headless\xc2"
    )  # {"status":"HELLO","local":true,"headless":false}, spec appendix A
    assert hello == hello_payload(local=True, headless=False)
    cfg_hash = "9f" * 32
    ready = b"\x84\xa6status\xa5READY\xa5local\xc3\xa8headless\xc2" + (
        b"\xb4parallel_config_hash\xd9\x40" + cfg_hash.encode()
    )
    assert ready == ready_payload(parallel_config_hash=cfg_hash)

    sockets = []
    for rank in (0, 1):
        hs = zmq_ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
        hs.setsockopt(zmq.LINGER, 5000)  # as vLLM's handshake socket
        hs.connect(addrs["handshake"])
        hs.send(hello)
        assert hs.poll(5000)
        init = msgspec_decode_init(hs.recv())
        a = init["addresses"]
        inputs = []
        for address in a["inputs"]:
            dealer = zmq_ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(address)
            inputs.append(dealer)
        xsub = zmq_ctx.socket(zmq.XSUB)
        xsub.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
        xsub.setsockopt(zmq.LINGER, 0)
        xsub.connect(a["coordinator_input"])
        xsub.send(b"\x01")
        greeting = pack({"max_model_len": 2048, "num_gpu_blocks": 10, "block_size": 16,
                         "dp_stats_address": a["frontend_stats_publish_address"]})
        for dealer in inputs:
            dealer.send(greeting)
        sockets.append((hs, inputs, xsub))
    for hs, _, xsub in sockets:
        assert xsub.poll(5000)
        assert xsub.recv_multipart() == [b"READY"]
        hs.send(ready)
        # A stock engine never reads the reply; it closes the handshake socket.
        hs.close()

    front = RawFrontend(zmq_ctx, addrs)
    # READY travels on the closed handshake socket (linger): poll until it is read.
    def both_ready() -> dict[str, Any] | None:
        state = front.state()
        return state if [e[1] for e in state["engines"]] == ["ready"] * 2 else None

    state = wait_until(both_ready, timeout=5.0, what="both stock engines to be ready")
    assert state["counters"]["handshake.ready.accepted"] == 2
    # The coordinator can now route to it over dispatch, as vLLM's ROUTER would.
    reply = front.submit("req-1", b"payload-bytes", dp_rank=1)
    assert reply[0] == "submitted", reply
    _, inputs1, _ = sockets[1]
    deadline = time.monotonic() + 5.0
    frames = recv_frames(inputs1[0], 5.0)
    while frames is not None and is_lease_probe(frames):
        frames = recv_frames(inputs1[0], max(0.0, deadline - time.monotonic()))
    assert frames == [b"\x00", b"payload-bytes"]


def test_idle_stock_engines_stay_dispatchable_past_the_lease_ttl(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """vLLM engines send nothing while idle; silence must not make them dead."""
    handle = coordinator(2, extra_args=["--lease-ttl-s", "0.6"])
    peers = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    for peer in peers:
        peer.close_handshake()
    time.sleep(1.8)  # three TTLs of silence from the engines
    front = RawFrontend(zmq_ctx, handle.addresses)
    assert [e[1] for e in front.state()["engines"]] == ["ready", "ready"]
    for rank, peer in enumerate(peers):
        reply = front.submit(f"after-idle-{rank}", b"req", dp_rank=rank)
        assert reply[0] == "submitted", reply
        # Liveness probes (empty ABORTs) may come first; a vLLM engine ignores them.
        assert peer.recv_dispatch(3.0) == [b"\x00", b"req"]


def msgspec_decode_init(raw: bytes) -> dict[str, Any]:
    init = unpack(raw)
    assert isinstance(init, dict) and set(init) == {"addresses", "parallel_config"}, init
    return init


def test_dense_mode_init_has_empty_parallel_config(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """vLLM sends parallel_config only for coordinated (MoE) DP; dense engines get {}."""
    handle = coordinator(2, lockstep=False)
    engine = RawEngine(zmq_ctx, handle.addresses, 0, dp_size=2)
    init = engine.hello()
    assert init["parallel_config"] == {}


def test_master_flags_reach_every_init(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    """--master-ip/--master-port set the DP meeting point for a rank 0 on another host."""
    handle = coordinator(2, extra_args=["--master-ip", "10.11.12.13", "--master-port", "29600"])
    pcs = []
    for rank in (0, 1):
        engine = RawEngine(zmq_ctx, handle.addresses, rank, dp_size=2)
        pcs.append(engine.hello()["parallel_config"])
    assert pcs[0] == pcs[1]
    assert pcs[0]["data_parallel_master_ip"] == "10.11.12.13"
    assert pcs[0]["data_parallel_master_port"] == 29600
    assert pcs[0]["data_parallel_size"] == 2


# ---- refusals ------------------------------------------------------------------------


def start_group(ctx: Ctx, addrs: dict[str, str], ranks: list[int], dp_size: int,
                **hello_extra: Any) -> dict[int, RawEngine]:
    peers = {r: RawEngine(ctx, addrs, r, dp_size=dp_size) for r in ranks}
    for peer in peers.values():
        peer.hello(**hello_extra)
        peer.connect_plane()
    return peers


def finish_group(peers: dict[int, RawEngine], cfg_hash: str | None = "h-1") -> None:
    for peer in peers.values():
        peer.subscribe()
        peer.greet()
    for peer in peers.values():
        assert peer.expect_publish() == [READY]
    for peer in peers.values():
        assert peer.ready(cfg_hash) == (ACCEPTED_REPLY if peer.answered_after_ready else None)


def assert_group_ready(front: RawFrontend, engines: int) -> dict[str, Any]:
    state = front.state()
    assert [e[1] for e in state["engines"]] == ["ready"] * engines, state["engines"]
    assert_no_internal_errors(state["counters"])
    return state


@pytest.mark.parametrize(
    ("bad_identity", "transport"), [(b"\x01", "ipc"), (b"\x01\x00\x00", "tcp")]
)
def test_identity_of_wrong_length_is_refused(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, bad_identity: bytes, transport: str
) -> None:
    handle = coordinator(2, transport=transport)
    addrs = handle.addresses
    front = RawFrontend(zmq_ctx, addrs)
    peers = start_group(zmq_ctx, addrs, [0], 2)
    bad = RawEngine(zmq_ctx, addrs, 1, ident=bad_identity)
    bad.send_handshake(hello_payload())
    assert reason_of(bad.expect_handshake()) == IDENTITY_ERROR_PREFIX + repr(bad_identity)
    peers.update(start_group(zmq_ctx, addrs, [1], 2))
    finish_group(peers)
    state = assert_group_ready(front, 2)
    assert state["counters"]["refused.handshake.identity_length"] == 1


def test_unset_identity_gets_the_auto_identity_refused(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """ZMQ cannot set an empty identity; unset, the ROUTER invents a 5-byte one (0x00 + 4)."""
    probe = zmq_ctx.socket(zmq.DEALER)
    with pytest.raises(zmq.ZMQError):
        probe.setsockopt(zmq.IDENTITY, b"")
    probe.close(0)
    handle = coordinator(1)
    bad = RawEngine(zmq_ctx, handle.addresses, 0, ident=RawEngine.NO_IDENTITY)
    bad.send_handshake(hello_payload())
    reason = reason_of(bad.expect_handshake())
    assert reason.startswith(IDENTITY_ERROR_PREFIX)
    auto = ast.literal_eval(reason[len(IDENTITY_ERROR_PREFIX):])
    assert isinstance(auto, bytes) and len(auto) == 5 and auto[0] == 0
    # The refused peer holds nothing: rank 0 still handshakes.
    finish_group(start_group(zmq_ctx, handle.addresses, [0], 1))
    front = RawFrontend(zmq_ctx, handle.addresses)
    assert assert_group_ready(front, 1)["counters"]["refused.handshake.identity_length"] == 1


def test_rank_out_of_range_is_refused(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    handle = coordinator(2)
    addrs = handle.addresses
    peers = start_group(zmq_ctx, addrs, [0, 1], 2)
    for bad_rank in (2, 3, 65535):
        bad = RawEngine(zmq_ctx, addrs, bad_rank)
        bad.send_handshake(hello_payload())
        reason = reason_of(bad.expect_handshake())
        assert reason.startswith(
            f"dp_rank={bad_rank} is outside this coordinator's range (valid ranks are 0..1)"
        ), reason
        assert "--rank-start/--engines" in reason  # the remedy
        # A READY from it is refused the same way.
        bad.send_handshake(ready_payload(parallel_config_hash="h-1"))
        assert reason_of(bad.expect_handshake()).startswith(f"dp_rank={bad_rank} is outside")
    finish_group(peers)
    front = RawFrontend(zmq_ctx, addrs)
    state = assert_group_ready(front, 2)
    assert state["counters"]["refused.handshake.rank_out_of_range"] == 6
    assert state["rank_count"] == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_live_rank_claimed_by_another_engine_id_is_refused(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, transport: str
) -> None:
    """The holder closed its handshake socket after READY (as vLLM does) but is alive."""
    handle = coordinator(2, transport=transport)
    addrs = handle.addresses
    peers = start_group(zmq_ctx, addrs, [0, 1], 2, engine_id="engine-a")
    finish_group(peers)
    for peer in peers.values():
        peer.close_handshake()
    # Let the ROUTER see the old connection go: until then libzmq itself rejects a
    # second connection with the same identity (see the next test).
    time.sleep(0.3)
    intruder = RawEngine(zmq_ctx, addrs, 1)
    intruder.send_handshake(hello_payload(engine_id="engine-b"))
    reason = reason_of(intruder.expect_handshake())
    prefix = "Engine ID mismatch for dp_rank=1: expected engine-a, got engine-b"
    assert reason.startswith(prefix), reason
    remedy = reason[len(prefix):]
    assert len(remedy) > 20 and ("Stop" in remedy or "stop" in remedy), reason
    # A vLLM engine (no engine_id) cannot take a rank held by an SDK engine either.
    intruder.send_handshake(hello_payload())
    assert reason_of(intruder.expect_handshake()).startswith(
        "Engine ID mismatch for dp_rank=1: expected engine-a, got None"
    )
    front = RawFrontend(zmq_ctx, addrs)
    state = assert_group_ready(front, 2)
    assert [e[2] for e in state["engines"]] == ["engine-a", "engine-a"]
    assert state["counters"]["refused.handshake.engine_id_mismatch"] == 2


@pytest.mark.xfail(
    strict=True,
    reason="libzmq limit: while the holder's handshake connection is open, a second "
    "connection with the same identity is dropped by the ROUTER before the coordinator "
    "sees it (the engine times out after vLLM's 5 minutes). ROUTER_HANDOVER would let it "
    "through, but black-holes the holder's connection instead (next test), so the "
    "holder is kept.",
)
def test_duplicate_rank_during_handshake_gets_an_answer(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Two engines started with the same rank at once: ideally the second hears why.

    The first still has its handshake socket open (between HELLO and READY). DESIGN
    rule 1 wants a reply the peer can read; ZMQ identities make that impossible
    without harming the first engine, which must keep priority.
    """
    handle = coordinator(2)
    addrs = handle.addresses
    first = RawEngine(zmq_ctx, addrs, 0, dp_size=2)
    first.hello(engine_id="engine-a")
    second = RawEngine(zmq_ctx, addrs, 0, dp_size=2)
    second.send_handshake(hello_payload(engine_id="engine-b"))
    reply = second.recv_handshake(2.0)
    assert reply is not None, (
        "the second engine for dp_rank=0 got no reply at all: it waits out vLLM's "
        "5-minute handshake timeout with no error"
    )
    assert reason_of(reply).startswith("Engine ID mismatch for dp_rank=0")


def test_rank_holder_mid_handshake_still_completes_after_a_duplicate(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Refusing a second engine for a rank must not cost the holder its handshake.

    The holder said HELLO and got INIT; while it loads its model, a second engine
    for the same rank says HELLO and is refused. The holder's READY (sent once,
    as vLLM does) must still be accepted and the rank must become ready.
    """
    handle = coordinator(2, transport="tcp")
    addrs = handle.addresses
    holder = RawEngine(zmq_ctx, addrs, 0, dp_size=2)
    holder.hello(engine_id="engine-a")
    holder.connect_plane()
    intruder = RawEngine(zmq_ctx, addrs, 0, dp_size=2)
    intruder.send_handshake(hello_payload(engine_id="engine-b"))
    intruder.recv_handshake(2.0)  # answered or not, see the previous test
    intruder.close()
    other = start_group(zmq_ctx, addrs, [1], 2)
    peers = {0: holder, **other}
    for peer in peers.values():
        peer.subscribe()
        peer.greet()
    for peer in peers.values():
        assert peer.expect_publish() == [READY]
    reply = holder.ready("h-1")
    assert reply is None, (
        f"the rank holder's READY got {reply!r}; the rank stays handshaking and is never "
        "dispatched to"
    )
    assert other[1].ready("h-1") is None
    assert_group_ready(RawFrontend(zmq_ctx, addrs), 2)


def test_config_hash_mismatch_is_refused_and_the_rank_can_rejoin(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(3)
    addrs = handle.addresses
    peers = start_group(zmq_ctx, addrs, [0, 1, 2], 3)
    for peer in peers.values():
        peer.subscribe()
        peer.greet()
    for peer in peers.values():
        assert peer.expect_publish() == [READY]
    assert peers[0].ready("hash-good") is None
    assert peers[2].ready("hash-good") is None
    peers[1].send_ready("hash-other")
    reason = reason_of(peers[1].expect_handshake())
    assert reason.startswith("parallel config hash mismatch for dp_rank=1"), reason
    assert "hash-good" in reason and "hash-other" in reason
    front = RawFrontend(zmq_ctx, addrs)
    state = front.state()
    assert [e[1] for e in state["engines"]] == ["ready", "dead", "ready"]
    assert state["counters"]["refused.handshake.config_hash_mismatch"] == 1
    # Restarted with the right settings, the rank joins.
    peers[1].hello(protocol_version=1)  # this time as the project's SDK, which hears back
    assert peers[1].ready("hash-good") == ACCEPTED_REPLY
    assert_group_ready(front, 3)


def test_ready_before_hello_is_refused(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    handle = coordinator(2)
    addrs = handle.addresses
    early = RawEngine(zmq_ctx, addrs, 1, dp_size=2)
    early.send_ready("h-1")
    reason = reason_of(early.expect_handshake())
    assert reason.startswith("READY from dp_rank=1 before any HELLO"), reason
    front = RawFrontend(zmq_ctx, addrs)
    assert [e[1] for e in front.state()["engines"]] == ["absent", "absent"]
    # Once it follows the protocol, it joins with the others.
    peers = start_group(zmq_ctx, addrs, [0], 2)
    early.hello()
    early.connect_plane()
    peers[1] = early
    finish_group(peers)
    state = assert_group_ready(front, 2)
    assert state["counters"]["refused.handshake.out_of_order"] == 1
    # READY is accepted once per HELLO.
    early.send_ready("h-1")
    reason = reason_of(early.expect_handshake())
    assert reason.startswith("duplicate READY from dp_rank=1"), reason
    state = assert_group_ready(front, 2)
    assert state["counters"]["refused.handshake.out_of_order"] == 2


GARBAGE_PAYLOADS = [
    (b"\xc1", "decode"),  # never-used msgpack byte
    (b"", "decode"),
    (b"\x83\xa6status", "decode"),  # truncated
    (pack([1, 2, 3]), "bad_value"),  # valid msgpack, not a map
    (pack({"local": True, "headless": False}), "bad_value"),  # no status
    (pack({"status": 5, "local": True, "headless": False}), "bad_value"),
    (pack({"status": "HELLO", "local": "yes", "headless": False}), "bad_value"),
    (pack({"status": "BOGUS", "local": True, "headless": False}), "unknown_status"),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_garbage_handshake_payloads_are_refused(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, transport: str
) -> None:
    handle = coordinator(2, transport=transport)
    addrs = handle.addresses
    peers = start_group(zmq_ctx, addrs, [0], 2)
    noisy = RawEngine(zmq_ctx, addrs, 1, dp_size=2)
    for payload, _ in GARBAGE_PAYLOADS:
        noisy.send_handshake(payload)
        reason = reason_of(noisy.expect_handshake())
        assert reason.startswith("bad handshake payload from dp_rank=1") or (
            "dp_rank=1" in reason
        ), reason
    # Two payload frames: refused, not treated as a HELLO.
    noisy.send_handshake(hello_payload(), hello_payload())
    assert reason_of(noisy.expect_handshake()) == "expected exactly one payload frame"
    # The same peer, behaving, completes.
    noisy.hello()
    noisy.connect_plane()
    peers[1] = noisy
    finish_group(peers)
    front = RawFrontend(zmq_ctx, addrs)
    counters = assert_group_ready(front, 2)["counters"]
    expected: dict[str, int] = {}
    for _, token in GARBAGE_PAYLOADS:
        expected[f"refused.handshake.{token}"] = expected.get(f"refused.handshake.{token}", 0) + 1
    for key, count in expected.items():
        assert counters.get(key) == count, (key, counters)
    assert counters["dropped.handshake.frame_count"] == 1


def test_refused_peers_interleaved_with_a_completing_group(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Every kind of refusal at once, mixed into one group's startup."""
    handle = coordinator(4, transport="tcp")
    addrs = handle.addresses
    rng = random.Random(7)
    bad: list[tuple[RawEngine, bytes, str]] = [
        (RawEngine(zmq_ctx, addrs, 0, ident=b"\x07"), hello_payload(), "identity_length"),
        (RawEngine(zmq_ctx, addrs, 0, ident=b"abc"), hello_payload(), "identity_length"),
        (RawEngine(zmq_ctx, addrs, 4), hello_payload(), "rank_out_of_range"),
        (RawEngine(zmq_ctx, addrs, 9), ready_payload(), "rank_out_of_range"),
        # The payload is read before the rank range: garbage from rank 300 is bad_value.
        (RawEngine(zmq_ctx, addrs, 300), pack(["HELLO"]), "bad_value"),
    ]
    good = {r: RawEngine(zmq_ctx, addrs, r, dp_size=4) for r in range(4)}
    steps: list[Any] = [("bad", b) for b in bad] + [("good", r) for r in range(4)]
    rng.shuffle(steps)
    for kind, item in steps:
        if kind == "bad":
            peer, payload, _ = item
            peer.send_handshake(payload)
            reply = peer.expect_handshake()
            assert unpack(reply)["status"] == "ERROR"
        else:
            good[item].hello()
            good[item].connect_plane()
    finish_group(good)
    front = RawFrontend(zmq_ctx, addrs)
    counters = assert_group_ready(front, 4)["counters"]
    assert counters["refused.handshake.identity_length"] == 2
    assert counters["refused.handshake.rank_out_of_range"] == 2
    assert counters["refused.handshake.bad_value"] == 1
    assert counters["handshake.hello.accepted"] == 4


# ---- frontends ------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_init_waits_for_all_frontends(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, transport: str
) -> None:
    handle = coordinator(2, transport=transport, frontends=2)
    addrs = handle.addresses
    peers = {r: RawEngine(zmq_ctx, addrs, r, dp_size=2) for r in (0, 1)}
    for peer in peers.values():
        peer.send_handshake(hello_payload())
    for peer in peers.values():
        assert peer.recv_handshake(0.3) is None, "INIT sent before any frontend registered"

    out = {i: f"ipc:///tmp/frontend-{i}-outputs" for i in (0, 1)}
    front1 = RawFrontend(zmq_ctx, addrs)
    reply = front1.register(1, out[1], "tcp://10.0.0.2:5001")
    assert reply[0] == "registered" and reply[2] == 1, reply
    for peer in peers.values():
        assert peer.recv_handshake(0.3) is None, "INIT sent with only 1 of 2 frontends"

    front0 = RawFrontend(zmq_ctx, addrs)
    reply = front0.register(0, out[0])
    assert reply[0] == "registered" and reply[2] == 0, reply
    for peer in peers.values():
        init = check_init(
            peer.expect_handshake(), addrs, dp_size=2, outputs=[out[0], out[1]],
            inputs=[addrs["dispatch"], "tcp://10.0.0.2:5001"],
        )
        peer.init = init
        peer.connect_plane()
    # An engine arriving after registration gets INIT at once, same addresses.
    finish_group(peers)
    assert_group_ready(front0, 2)


def test_frontend_client_index_beyond_expected_is_refused(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(1, frontends=1)
    front = RawFrontend(zmq_ctx, handle.addresses)
    reply = front.register(1, "ipc:///tmp/x")
    assert reply[0] == "error", reply
    engine = RawEngine(zmq_ctx, handle.addresses, 0)
    engine.send_handshake(hello_payload())
    assert engine.recv_handshake(0.3) is None
    assert front.register(0, "ipc:///tmp/y")[0] == "registered"
    check_init(engine.expect_handshake(), handle.addresses, dp_size=1, outputs=["ipc:///tmp/y"])


def test_handshake_group_helper_with_engine_ids(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """The reusable full-startup helper works and leaves engines in the state query."""
    handle = coordinator(3)
    handshake_group(zmq_ctx, handle.addresses, [0, 1, 2], dp_size=3, rng=random.Random(3),
                    engine_ids={0: "e0", 1: "e1", 2: "e2"})
    state = RawFrontend(zmq_ctx, handle.addresses).state()
    assert [(e[0], e[1], e[2]) for e in state["engines"]] == [
        (0, "ready", "e0"), (1, "ready", "e1"), (2, "ready", "e2")
    ]


def test_each_ranks_vllm_version_is_in_the_state_and_a_mix_is_logged(
    coordinator: CoordinatorFactory, zmq_ctx: Any
) -> None:
    """The greeting's vllm_version, per rank, in the state reply; ranks that run
    different releases are logged once (the wire differs between them)."""
    from tests.vllm_peers import RawEngine, RawFrontend, pack, ready_response

    handle = coordinator(2)
    engines = [RawEngine(zmq_ctx, handle.addresses, rank, dp_size=2) for rank in (0, 1)]
    for engine, version in zip(engines, ("0.33.0", "0.32.0"), strict=True):
        engine.hello()
        engine.connect_plane()
        engine.subscribe()
        engine.greet(pack({**ready_response(engine.rank, 2), "vllm_version": version}))
    for engine in engines:
        assert engine.expect_publish() == [READY]
        assert engine.ready("cfg-hash-1") is None
    front = RawFrontend(zmq_ctx, handle.addresses)
    versions = wait_until(
        lambda: (v := [e[9] for e in front.state()["engines"]]) == ["0.33.0", "0.32.0"] and v,
        timeout=5.0, what="both versions in the state")
    assert versions
    wait_until(lambda: "different vLLM versions" in handle.stderr_text(), timeout=5.0,
               what="the mix logged")
    assert handle.stderr_text().count("different vLLM versions") == 1


def test_require_supported_vllm_cordons_an_old_rank_and_says_why(
    coordinator: CoordinatorFactory, zmq_ctx: Any
) -> None:
    """With --require-supported-vllm a rank whose greeting names a vLLM outside the
    supported range stays in the wave but is cordoned, counted and logged with the
    override."""
    from tests.vllm_peers import RawEngine, RawFrontend, pack, ready_response

    handle = coordinator(2, extra_args=["--require-supported-vllm"])
    engines = [RawEngine(zmq_ctx, handle.addresses, rank, dp_size=2) for rank in (0, 1)]
    for engine, version in zip(engines, ("0.33.0", "0.28.1"), strict=True):
        engine.hello()
        engine.connect_plane()
        engine.subscribe()
        engine.greet(pack({**ready_response(engine.rank, 2), "vllm_version": version}))
    for engine in engines:
        assert engine.expect_publish() == [READY]
        engine.send_ready("cfg-hash-1")
    front = RawFrontend(zmq_ctx, handle.addresses)
    states = wait_until(
        lambda: (s := [e[1] for e in front.state()["engines"]]) == ["ready", "cordoned"] and s,
        timeout=10.0, what="rank 1 cordoned for its version")
    assert states
    assert wait_until(lambda: front.counters().get("refused.dispatch.vllm_version") == 1,
                      timeout=10.0, what="the refusal counted")
    wait_until(lambda: "uncordon 1" in handle.stderr_text(), timeout=10.0,
               what="the refusal logged with its override")
    assert "dp_rank=1 runs vLLM '0.28.1'" in handle.stderr_text()
