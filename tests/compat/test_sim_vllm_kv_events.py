"""Simulated engines read by vLLM 0.33's own frontend and KV event code.

A coordinator runs with a raw frontend (this project's protocol on plain
sockets, plus vLLM-style output and input sockets of its own), and a group
of simulated engines runs as its own process, publishing KV events on
vLLM's endpoint convention. What the engines send is decoded with vLLM's
unmodified code from the pinned wheel (`tools/vllm_wheel.py`): the ready
greeting as `EngineCoreReadyResponse`, outputs through vLLM's
`MsgpackDecoder(EngineCoreOutputs)`, event batches as `KVEventBatch`.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from coordinator.protocol.kv_events import encode_replay_request
from coordinator.sim.request import answer_tokens, encode_vllm_request
from tests.compat.vllm_stand_ins import KV_STAND_INS, KVEventsConfigStandIn
from tests.conftest import CoordinatorFactory
from tests.vllm_peers import RawFrontend, pack, recv_frames, wait_until
from tools import vllm_wheel

pytestmark = pytest.mark.timeout(120)

RANKS = 2
BS = 4
WAIT_S = 10.0
TOPIC = b"kv"
UTILITY = b"\x03"


@pytest.fixture(scope="module")
def vllm() -> dict[str, types.ModuleType]:
    try:
        kv = vllm_wheel.load("vllm.distributed.kv_events", stand_ins=KV_STAND_INS)
        engine = vllm_wheel.load(
            "vllm.v1.engine", "vllm.v1.serial_utils", real=vllm_wheel.COORDINATOR_REAL,
            stand_ins={"vllm.config.kv_events": {"KVEventsConfig": KVEventsConfigStandIn}})
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_wheel.VLLM_VERSION} wheel unavailable: {exc}")
    return {**kv, **engine}


def _bind_consecutive(ctx: zmq.Context[zmq.Socket[bytes]], count: int
                      ) -> tuple[list[zmq.Socket[bytes]], int]:
    """`count` SUB sockets bound on consecutive loopback ports (where publishers connect)."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20_000, 60_000)
        subs: list[zmq.Socket[bytes]] = []
        try:
            for offset in range(count):
                sub = ctx.socket(zmq.SUB)
                subs.append(sub)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.bind(f"tcp://127.0.0.1:{base + offset}")
        except zmq.ZMQError:
            for sub in subs:
                sub.close(linger=0)
            continue
        return subs, base
    raise AssertionError("no run of free loopback ports for the subscribers")


def _watch_handshakes(subs: list[zmq.Socket[bytes]]) -> list[zmq.Socket[bytes]]:
    return [sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) for sub in subs]


def _attach(subs: list[zmq.Socket[bytes]], monitors: list[zmq.Socket[bytes]]) -> None:
    """Wait until each publisher has connected, then let each SUB send its subscription.

    A SUB takes a new connection on (and sends its subscription over it) only
    when it next processes commands, which an idle socket does not do: a
    publisher that connects to a SUB nobody reads loses what it sends first.
    """
    for sub, monitor in zip(subs, monitors, strict=True):
        assert monitor.poll(int(WAIT_S * 1000)), "a publisher never connected"
        monitor.recv_multipart()
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.getsockopt(zmq.EVENTS)


def _free_consecutive(count: int) -> int:
    """A base port with `count` free loopback ports after it (probed, then released)."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20_000, 60_000)
        probes = []
        try:
            for offset in range(count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return base
    raise AssertionError("no run of free loopback ports for the replay sockets")


class Peer:
    """The raw frontend: protocol DEALER, output PULL, input ROUTER (engines connect)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], addresses: dict[str, str],
                 where: Path) -> None:
        self.front = RawFrontend(ctx, addresses)
        self.outputs = ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(f"ipc://{where}/out")
        self.inputs = ctx.socket(zmq.ROUTER)
        self.inputs.setsockopt(zmq.LINGER, 0)
        self.inputs.bind(f"ipc://{where}/in")
        reply = self.front.register(0, f"ipc://{where}/out", f"ipc://{where}/in")
        assert reply[0] == "registered", reply

    def submit(self, request_id: str, prompt: list[int], rank: int, max_tokens: int) -> None:
        wave = self.front.state()["wave"]
        payload = encode_vllm_request(request_id, prompt, max_tokens=max_tokens,
                                      client_index=0, current_wave=wave)
        reply = self.front.submit(request_id, payload, wave=wave, dp_rank=rank)
        assert reply[0] == "submitted" and reply[3] == rank, reply

    def outputs_until_finished(self, decoder: Any, request_id: str) -> list[Any]:
        """vLLM-decoded EngineCoreOutputs until one says `request_id` finished."""
        got = []
        deadline = time.monotonic() + WAIT_S
        while True:
            frames = recv_frames(self.outputs, deadline - time.monotonic())
            assert frames is not None, f"{request_id} did not finish"
            message = decoder.decode(frames)
            got.append(message)
            if request_id in (message.finished_requests or ()):
                return got


def _next_batch(sub: zmq.Socket[bytes], decoder: Any) -> tuple[int, Any, bytes]:
    frames = recv_frames(sub, WAIT_S)
    assert frames is not None, "no KV event batch arrived"
    topic, seq, payload = frames
    assert topic == TOPIC and len(seq) == 8
    return int.from_bytes(seq, "big"), decoder.decode(payload), payload


def _replay(ctx: zmq.Context[zmq.Socket[bytes]], address: str, start: int
            ) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    dealer.send_multipart(encode_replay_request(start))
    replayed = []
    while True:
        frames = recv_frames(dealer, WAIT_S)
        assert frames is not None, "the replay did not answer"
        empty, topic, seq, payload = frames
        assert empty == b""
        if seq == b"\xff" * 8:
            dealer.close(linger=0)
            return replayed
        assert topic == TOPIC
        replayed.append((int.from_bytes(seq, "big"), payload))


@pytest.fixture
def sim_processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def start_sim(handle_addresses: dict[str, str], ranks: int, where: Path, *events: str
              ) -> subprocess.Popen[bytes]:
    """`python -m coordinator.sim group` with a small cache and the given KV event flags."""
    stderr = open(where / "sim.err", "wb")  # noqa: SIM115 - the child holds it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "coordinator.sim", "group", "--engines", str(ranks),
             "--handshake", handle_addresses["handshake"], "--step-ms", "2",
             "--block-size", str(BS), "--kv-blocks", "64", "--kv-events-topic", TOPIC.decode(),
             "--log-level", "WARNING", *events],
            stdout=subprocess.PIPE, stderr=stderr, env=env)
    finally:
        stderr.close()


def greet(peer: Peer, ranks: int, decoder: Any, where: Path) -> dict[int, Any]:
    """Every engine's greeting on the frontend's input socket, vLLM-decoded."""
    greetings: dict[int, Any] = {}
    while len(greetings) < ranks:
        frames = recv_frames(peer.inputs, WAIT_S)
        assert frames is not None, (where / "sim.err").read_text()[-2000:]
        identity, payload = frames
        greetings[int.from_bytes(identity, "little")] = decoder.decode(payload)
    wait_until(lambda: [e[1] for e in peer.front.state()["engines"]] == ["ready"] * ranks,
               timeout=WAIT_S, what="engines ready")
    return greetings


def test_vllm_reads_a_simulated_groups_greetings_outputs_events_and_resets(
    coordinator: CoordinatorFactory,
    zmq_ctx: zmq.Context[zmq.Socket[bytes]],
    vllm: dict[str, types.ModuleType],
    tmp_path: Path,
    sim_processes: list[subprocess.Popen[bytes]],
) -> None:
    kv, engine, serial = (vllm["vllm.distributed.kv_events"], vllm["vllm.v1.engine"],
                          vllm["vllm.v1.serial_utils"])
    batch_decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    outputs_decoder = serial.MsgpackDecoder(engine.EngineCoreOutputs)

    handle = coordinator(engines=RANKS, frontends=1)
    peer = Peer(zmq_ctx, handle.addresses, tmp_path)
    # A publisher given a non-wildcard host connects, so the subscribers bind, on
    # consecutive ports: each rank adds its rank to the port.
    subs, live_base = _bind_consecutive(zmq_ctx, RANKS)
    monitors = _watch_handshakes(subs)
    replay_base = _free_consecutive(RANKS)
    proc = start_sim(handle.addresses, RANKS, tmp_path,
                     "--kv-events-endpoint", f"tcp://127.0.0.1:{live_base}",
                     "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_base}")
    sim_processes.append(proc)

    # 1. Every engine greets as a vLLM engine does: block size, blocks, its publisher.
    greetings = greet(peer, RANKS, msgspec.msgpack.Decoder(engine.EngineCoreReadyResponse),
                      tmp_path)
    for rank, greeting in greetings.items():
        assert (greeting.block_size, greeting.num_gpu_blocks, greeting.data_parallel_rank) == (
            BS, 65, rank)
        assert greeting.kv_events_config == KVEventsConfigStandIn(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{live_base + rank}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_base + rank}", topic="kv")
    _attach(subs, monitors)
    time.sleep(0.1)  # the subscriptions cross to the publishers

    # 2. A request on rank 1: its outputs as vLLM's frontend decodes them, and its
    # blocks on rank 1's stream as vLLM's own event structs.
    prompt = list(range(1000, 1022))  # 22 tokens; with 3 answer tokens, 24 have KV
    peer.submit("r1", prompt, rank=1, max_tokens=3)
    messages = peer.outputs_until_finished(outputs_decoder, "r1")
    outputs = [o for m in messages for o in m.outputs]
    answer = answer_tokens(prompt, 3)
    assert [o.new_token_ids for o in outputs] == [[answer[0]], [answer[2]]]
    assert outputs[0].prefill_stats.num_prompt_tokens == 22
    assert outputs[0].prefill_stats.num_cached_tokens == 0
    assert [o.finish_reason for o in outputs][1] == engine.FinishReason.LENGTH
    stats = [m.scheduler_stats for m in messages if m.scheduler_stats is not None]
    assert [(s.prefix_cache_stats.queries, s.prefix_cache_stats.hits) for s in stats] == [
        (22, 0)]
    stored: list[Any] = []
    last = -1
    while sum(len(e.block_hashes) for e in stored) < 6:
        seq, batch, _ = _next_batch(subs[1], batch_decoder)
        assert batch.data_parallel_rank == 1 and seq == last + 1
        last = seq
        stored += [e for e in batch.events if isinstance(e, kv.BlockStored)]
    assert [t for e in stored for t in e.token_ids] == (prompt + answer)[:24]
    assert stored[0].parent_block_hash is None
    assert stored[-1].parent_block_hash == stored[-2].block_hashes[-1]
    assert {(e.block_size, e.medium, e.group_idx, e.lora_name) for e in stored} == {
        (BS, "GPU", 0, None)}

    # 3. The same prompt again: a hit on everything but the last token's block.
    peer.submit("r1-again", prompt, rank=1, max_tokens=1)
    again = peer.outputs_until_finished(outputs_decoder, "r1-again")
    first = next(o for m in again for o in m.outputs)
    assert (first.prefill_stats.num_cached_tokens, first.prefill_stats.num_computed_tokens) == (
        20, 2)

    # 4. vLLM's reset_prefix_cache utility, sent from the frontend's input socket.
    while recv_frames(subs[1], 0.05) is not None:
        pass
    peer.inputs.send_multipart([(1).to_bytes(2, "little"), UTILITY,
                                pack([0, 77, "reset_prefix_cache", []])])
    frames = recv_frames(peer.outputs, WAIT_S)
    assert frames is not None, "no utility reply"
    reply = outputs_decoder.decode(frames)
    assert (reply.engine_index, reply.utility_output.call_id) == (1, 77)
    assert reply.utility_output.failure_message is None
    assert reply.utility_output.result.result is True
    _, cleared, _ = _next_batch(subs[1], batch_decoder)
    assert [type(e).__name__ for e in cleared.events] == ["AllBlocksCleared"]

    # 5. SIGUSR2 resets every rank of the process.
    proc.send_signal(signal.SIGUSR2)
    for sub in subs:
        _, cleared, _ = _next_batch(sub, batch_decoder)
        assert [type(e).__name__ for e in cleared.events] == ["AllBlocksCleared"]

    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0
    summaries = [msgspec.json.decode(line) for line in out.splitlines()]
    rank1 = next(s for s in summaries if s["rank"] == 1)
    assert (rank1["prompt_tokens"], rank1["hit_tokens"], rank1["prefix_cache_resets"]) == (
        44, 20, 2)
    for sub in subs:
        sub.close(linger=0)


def test_replay_fills_the_gap_a_subscriber_of_a_binding_publisher_leaves(
    coordinator: CoordinatorFactory,
    zmq_ctx: zmq.Context[zmq.Socket[bytes]],
    vllm: dict[str, types.ModuleType],
    tmp_path: Path,
    sim_processes: list[subprocess.Popen[bytes]],
) -> None:
    """An ipc publisher binds: what it sends while nobody is connected is gone, but kept
    for replay, which vLLM's own structs decode."""
    kv, engine, serial = (vllm["vllm.distributed.kv_events"], vllm["vllm.v1.engine"],
                          vllm["vllm.v1.serial_utils"])
    batch_decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    outputs_decoder = serial.MsgpackDecoder(engine.EngineCoreOutputs)
    handle = coordinator(engines=1, frontends=1)
    peer = Peer(zmq_ctx, handle.addresses, tmp_path)
    live_address, replay_address = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    sim_processes.append(start_sim(handle.addresses, 1, tmp_path,
                                   "--kv-events-endpoint", live_address,
                                   "--kv-events-replay-endpoint", replay_address))
    greeting = greet(peer, 1, msgspec.msgpack.Decoder(engine.EngineCoreReadyResponse),
                     tmp_path)[0]
    assert (greeting.kv_events_config.endpoint,
            greeting.kv_events_config.replay_endpoint) == (live_address, replay_address)

    def subscriber() -> zmq.Socket[bytes]:
        sub = zmq_ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(live_address)
        return sub

    def until_a_batch_arrives(sub: zmq.Socket[bytes], tag: str) -> tuple[int, bytes]:
        # A new subscription takes a moment to reach the publisher: send small
        # requests until one's batch gets through.
        for attempt in range(100):
            peer.submit(f"{tag}-{attempt}", [3000 + attempt] * 9, rank=0, max_tokens=1)
            peer.outputs_until_finished(outputs_decoder, f"{tag}-{attempt}")
            frames = recv_frames(sub, 0.2)
            if frames is not None:
                return int.from_bytes(frames[1], "big"), frames[2]
        raise AssertionError("the publisher never reached the subscriber")

    first = subscriber()
    last, _ = until_a_batch_arrives(first, "warm")
    first.close(linger=0)
    peer.submit("missed", list(range(2000, 2013)), rank=0, max_tokens=1)
    peer.outputs_until_finished(outputs_decoder, "missed")
    second = subscriber()
    seen, seen_payload = until_a_batch_arrives(second, "again")
    assert seen > last + 1, "no gap"
    replayed = _replay(zmq_ctx, replay_address, last + 1)
    assert [seq for seq, _ in replayed] == list(range(last + 1, seen + 1))
    assert dict(replayed)[seen] == seen_payload
    missed = batch_decoder.decode(dict(replayed)[last + 1])
    assert missed.data_parallel_rank == 0
    assert [type(e).__name__ for e in missed.events] == ["BlockStored"]
    assert missed.events[0].token_ids == list(range(2000, 2012))
    # A start older than the buffer is answered from what is kept; a bad request
    # is dropped and the socket keeps serving.
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_address)
    dealer.send_multipart([b"", b"\x00"])
    assert recv_frames(dealer, 0.3) is None
    dealer.close(linger=0)
    assert next(seq for seq, _ in _replay(zmq_ctx, replay_address, 0)) == 0
    second.close(linger=0)


def _try_bind(sock: zmq.Socket[bytes], address: str) -> bool:
    try:
        sock.bind(address)
    except zmq.ZMQError:
        return False
    return True
