"""Who holds a rank, through the real process: vanished HELLOs, live holders, dispatch claims.

Peers are raw pyzmq sockets sending vLLM 0.33's bytes (tests/vllm_peers.py), or
a separate process when a peer must freeze (SIGSTOP) rather than leave. The
rules are core.claims'; these tests check what the wire shows of them, and
measure how long a rank stays locked by a peer that is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from coordinator.core.ranks import liveness
from coordinator.core.ranks.claims import GREETING_GRACE_S
from tests.conftest import TRANSPORTS, CoordinatorFactory
from tests.vllm_peers import (
    READY,
    RawEngine,
    RawFrontend,
    engine_outputs,
    handshake_group,
    hello_payload,
    pack,
    ready_payload,
    unpack,
    wait_until,
)

Ctx = zmq.Context[zmq.Socket[bytes]]

pytestmark = pytest.mark.timeout(60)


def hello_until_init(ctx: Ctx, addresses: dict[str, str], rank: int, *, within: float,
                     **extra: object) -> tuple[RawEngine, float, list[str]]:
    """Say HELLO for ``rank`` on a fresh connection each try (as an operator restarting an
    engine would) until INIT comes; returns the engine, when, and the refusals met."""
    refusals: list[str] = []
    deadline = time.monotonic() + within
    while True:
        engine = RawEngine(ctx, addresses, rank, dp_size=2)
        engine.send_handshake(hello_payload(**extra))
        raw = engine.recv_handshake(0.02)
        if raw is not None:
            reply = unpack(raw)
            if "addresses" in reply:
                engine.init = reply
                return engine, time.monotonic(), refusals
            refusals.append(reply["reason"])
        engine.close()
        assert time.monotonic() < deadline, (
            f"dp_rank={rank} still not free after {within} s; refusals: {refusals[-2:]}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_hello_from_a_peer_that_then_vanishes_frees_the_rank_at_once(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, transport: str
) -> None:
    handle = coordinator(2, transport=transport)
    intruder = RawEngine(zmq_ctx, handle.addresses, 0, dp_size=2)
    intruder.hello(engine_id="intruder")  # two messages (HELLO, and INIT back), then gone
    intruder.close()
    gone = time.monotonic()
    engine, at, refusals = hello_until_init(zmq_ctx, handle.addresses, 0, within=5.0,
                                            engine_id="engine-a")
    print(f"\n{transport}: a vanished HELLO freed dp_rank=0 after {at - gone:.3f} s")
    assert not [r for r in refusals if "expires in" in r], refusals
    front = RawFrontend(zmq_ctx, handle.addresses)
    engines = front.state()["engines"]
    assert engines[0][2] == "engine-a"
    engine.close()


def _frozen_hello(address: str, rank: int) -> subprocess.Popen[bytes]:
    """A separate process that says HELLO for ``rank``, gets INIT, and then just sits."""
    script = (
        "import sys, zmq, msgspec\n"
        "ctx = zmq.Context(); s = ctx.socket(zmq.DEALER)\n"
        f"s.setsockopt(zmq.IDENTITY, ({rank}).to_bytes(2, 'little')); s.connect(sys.argv[1])\n"
        "s.send(msgspec.msgpack.encode({'status': 'HELLO', 'local': True, "
        "'headless': False, 'engine_id': 'frozen'}))\n"
        "assert s.poll(10000); s.recv(); print('init', flush=True)\n"
        "import time; time.sleep(300)\n"
    )
    return subprocess.Popen([sys.executable, "-c", script, address], stdout=subprocess.PIPE)


def test_a_hello_holder_that_stops_answering_frees_its_rank_within_the_heartbeat_bound(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """A peer that vanishes without closing (a frozen process, a host cut off) is cut off
    by the ZMTP heartbeats: the rank is free within liveness.heard_within_s."""
    ttl = 2.0
    handle = coordinator(2, transport="tcp", extra_args=["--lease-ttl-s", str(ttl)])
    holder = _frozen_hello(handle.addresses["handshake"], 0)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"init"
        os.kill(holder.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        bound = liveness.heard_within_s(ttl)
        engine, at, _ = hello_until_init(zmq_ctx, handle.addresses, 0,
                                         within=bound + 5.0, engine_id="engine-a")
        print(f"\na frozen HELLO holder freed dp_rank=0 after {at - frozen:.3f} s "
              f"(heartbeat bound {bound:g} s)")
        assert at - frozen <= bound + 1.5
        engine.close()
    finally:
        holder.kill()
        holder.wait(10)


_FROZEN_ENGINE = """
import sys, msgspec, zmq
handshake, rank = sys.argv[1], int(sys.argv[2])
identity = rank.to_bytes(2, "little")
ctx = zmq.Context()
hs = ctx.socket(zmq.DEALER); hs.setsockopt(zmq.IDENTITY, identity); hs.connect(handshake)
hs.send(msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True}))
assert hs.poll(10000)
addresses = msgspec.msgpack.decode(hs.recv())["addresses"]
dispatch = ctx.socket(zmq.DEALER); dispatch.setsockopt(zmq.IDENTITY, identity)
dispatch.connect(addresses["inputs"][0])
sub = ctx.socket(zmq.XSUB); sub.connect(addresses["coordinator_input"]); sub.send(b"\\x01")
dispatch.send(msgspec.msgpack.encode({"data_parallel_rank": rank}))
assert sub.poll(10000) and sub.recv() == b"READY"
hs.send(msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True}))
hs.close(linger=5000)
print("ready", flush=True)
import time; time.sleep(300)
"""


def test_a_new_engine_takes_over_from_a_frozen_one_whose_connection_stays_open(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """A crashed or frozen host keeps its tcp connection open, holding the rank's identity
    on dispatch: once nothing arrives on it, a new HELLO takes the rank over and the
    coordinator cuts that connection, so the new engine can connect there."""
    ttl = 2.0
    handle = coordinator(2, transport="tcp", extra_args=["--lease-ttl-s", str(ttl)])
    frozen = subprocess.Popen([sys.executable, "-c", _FROZEN_ENGINE,
                               handle.addresses["handshake"], "0"], stdout=subprocess.PIPE)
    try:
        other = RawEngine(zmq_ctx, handle.addresses, 1, dp_size=2)
        other.hello()
        other.connect_plane()
        other.subscribe()
        other.greet()
        assert other.expect_publish() == [READY]
        other.send_ready()
        assert frozen.stdout is not None and frozen.stdout.readline().strip() == b"ready"
        front = RawFrontend(zmq_ctx, handle.addresses)
        wait_until(lambda: [e[1] for e in front.state()["engines"]] == ["ready", "ready"],
                   what="both ranks ready")
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        engine, at, refusals = hello_until_init(zmq_ctx, handle.addresses, 0, within=10.0)
        print(f"\na frozen engine's rank was taken over {at - stopped:.3f} s after it "
              f"froze ({len(refusals)} refusals while it still counted as heard)")
        assert at - stopped <= liveness.silent_after_s(ttl) + 2.0
        engine.connect_plane()
        engine.subscribe()
        engine.greet()
        engine.send_ready()
        wait_until(lambda: front.counters().get("dispatch.greetings") == 3,
                   what="the new engine's greeting on dispatch")
        reply = front.submit("to-the-new-engine", b"req", dp_rank=0)
        assert reply[0] == "submitted", reply
        frames = engine.recv_dispatch(5.0)
        while frames is not None and frames[0] == b"\x01":  # probes may come first
            frames = engine.recv_dispatch(5.0)
        assert frames == [b"\x00", b"req"]
        assert "cut a stale connection on dispatch" in handle.stderr_text()
        engine.close()
        other.close()
    finally:
        frozen.kill()
        frozen.wait(10)


def test_a_connected_vllm_engine_keeps_its_rank_until_it_is_gone(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(2)
    peers = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    for peer in peers:
        peer.close_handshake()  # as vLLM does after READY
    front = RawFrontend(zmq_ctx, handle.addresses)
    # Until libzmq has seen the holder's handshake connection go, it turns a second one
    # away by itself; after that, the coordinator answers.
    second, refusal = None, ""
    deadline = time.monotonic() + 5.0
    while not refusal:
        second = RawEngine(zmq_ctx, handle.addresses, 1, dp_size=2)
        second.send_handshake(hello_payload())
        raw = second.recv_handshake(0.1)
        if raw is not None:
            refusal = unpack(raw)["reason"]
        second.close()
        assert time.monotonic() < deadline
    assert refusal.startswith("dp_rank=1 is held by a live engine (ready, incarnation 1, "
                              "still connected"), refusal
    assert "Stop the old engine" in refusal
    counters = front.counters()
    assert counters["refused.handshake.rank_held"] >= 1
    assert [e[1] for e in front.state()["engines"]] == ["ready", "ready"]
    reply = front.submit("still-mine", b"req", dp_rank=1)
    assert reply[0] == "submitted", reply
    # The holder's process ends: its rank is taken over at once.
    peers[1].close()
    engine, _, _ = hello_until_init(zmq_ctx, handle.addresses, 1, within=5.0)
    assert [e[1] for e in front.state()["engines"]] == ["ready", "handshaking"]
    engine.close()


def test_a_second_connection_claiming_a_live_ranks_dispatch_identity_gets_nothing(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(2)
    peers = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    for peer in peers:
        peer.close_handshake()
    spoof = zmq_ctx.socket(zmq.DEALER)
    spoof.setsockopt(zmq.LINGER, 0)
    spoof.setsockopt(zmq.IDENTITY, b"\x00\x00")  # rank 0's identity, no handshake
    spoof.connect(handle.addresses["dispatch"])
    spoof.send(pack({"data_parallel_rank": 0}))
    front = RawFrontend(zmq_ctx, handle.addresses)
    requests = 200
    for index in range(requests):
        reply = front.submit(f"r{index}", b"req", dp_rank=0)
        assert reply[0] == "submitted", reply
    got = 0
    while got < requests:
        frames = peers[0].recv_dispatch(5.0)
        assert frames is not None, f"rank 0's engine got only {got} of {requests} ADDs"
        if frames[0] == b"\x00":
            got += 1
    assert not spoof.poll(300), "the second connection received rank 0's requests"

    def silent_counted() -> int:
        return int(front.counters().get("dispatch.silent_connections", 0))

    wait_until(silent_counted, timeout=GREETING_GRACE_S + 5.0, interval=0.1,
               what="the silent dispatch connection counted")
    time.sleep(1.5)  # more lease checks: it is counted (and logged) once
    assert silent_counted() == 1
    log = handle.stderr_text()
    assert log.count("a connection on dispatch from pid") == 1, log[-2000:]

    # A real restart (the old engine's connections gone) takes the rank over at once.
    peers[0].close()
    engine, _, _ = hello_until_init(zmq_ctx, handle.addresses, 0, within=5.0)
    engine.connect_plane()
    engine.subscribe()
    engine.greet()
    engine.send_handshake(ready_payload(parallel_config_hash="cfg-hash-1"))
    wait_until(lambda: [e[1] for e in front.state()["engines"]] == ["ready", "ready"],
               what="the restarted rank 0 ready")
    # Its greeting (dispatch) and its READY (handshake) come on different sockets.
    wait_until(lambda: front.counters().get("dispatch.greetings") == 3,
               what="the restarted rank 0's greeting")
    reply = front.submit("after-restart", b"req-2", dp_rank=0)
    assert reply[0] == "submitted", reply
    frames = engine.recv_dispatch(5.0)
    while frames is not None and frames[0] == b"\x01":  # probes may come first
        frames = engine.recv_dispatch(5.0)
    assert frames == [b"\x00", b"req-2"]
    assert not spoof.poll(300)
    spoof.close(0)
    engine.close()


def test_a_vllm_engines_ready_gets_no_reply_and_makes_no_noise(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """vLLM engines close their handshake socket right after READY; nothing is sent there."""
    handle = coordinator(4)
    engines = [RawEngine(zmq_ctx, handle.addresses, rank, dp_size=4) for rank in range(4)]
    for engine in engines:
        engine.hello()
        engine.connect_plane()
        engine.subscribe()
        engine.greet()
    for engine in engines:
        engine.expect_publish()
    for engine in engines:
        engine.send_ready("cfg")
        engine.close_handshake()
    front = RawFrontend(zmq_ctx, handle.addresses)
    wait_until(lambda: [e[1] for e in front.state()["engines"]] == ["ready"] * 4,
               what="every rank ready")
    time.sleep(0.3)
    counters = front.counters()
    assert not {k: v for k, v in counters.items() if k.startswith("send_dropped.handshake")}
    assert "could not send on handshake" not in handle.stderr_text()


def test_a_rank_that_dies_leaves_the_rest_of_a_running_group_running(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """The surviving engines are still in the wave: a death publishes no pause."""
    handle = coordinator(2, extra_args=["--lease-ttl-s", "1"])
    peers = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    front = RawFrontend(zmq_ctx, handle.addresses)
    front.subscribe_publishes()
    peers[0].report(engine_outputs(0, start_wave=0))
    wait_until(lambda: front.state()["running"], what="the wave running")
    front.drain_publishes(0.2)
    peers[1].close()  # its process exits mid-wave
    wait_until(lambda: [e[1] for e in front.state()["engines"]] == ["ready", "dead"],
               timeout=5.0, what="dp_rank=1 declared dead")
    published = [unpack(buf) for _, buf in front.drain_publishes(0.5)]
    assert all(running for _, _, running in published), published
    assert front.state()["running"]
