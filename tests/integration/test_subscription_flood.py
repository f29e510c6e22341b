"""A flood of subscription topics costs bounded memory and leaves publishes on schedule.

libzmq's XPUB keeps every topic its peers subscribe to (about 44 bytes of
memory per byte of topic) and files them in the coordinator's own thread: 8,000
distinct 1 KiB topics on each publish socket grew a coordinator by hundreds of
MiB and stopped its publishes for seconds. Here a process per publish socket
subscribes to 8,000 distinct topics just under the message bound and 8,000
over it, and keeps doing so (libzmq's XSUB sends them all again each time it
reconnects), while two engines and a frontend subscribed the way vLLM does
must keep getting their publishes. RSS is sampled from /proc throughout.
"""

from __future__ import annotations

import itertools
import multiprocessing
import socket
import time
from typing import Any

import zmq

from coordinator.server.transport import PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES
from tests.conftest import CoordinatorFactory
from tests.integration.test_back_output_bound import rss_kib
from tests.vllm_peers import RawFrontend, is_wave_publish, open_gate, stats_report, wait_until

Ctx = zmq.Context[zmq.Socket[bytes]]

TOPICS = 8_000
FLOOD_S = 4.0
RECONNECT_IVL_S = 0.1
"""libzmq's default ``ZMQ_RECONNECT_IVL``."""


GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
            + b"\x00" * 32)
"""A ZMTP 3.0 greeting, NULL security, as a client."""
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"XSUB"
READY_COMMAND = b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY


def zmtp_handshake(peer: socket.socket) -> None:
    """Greet as an XSUB, in ZMTP's order: greetings exchanged, then READY both ways."""
    peer.sendall(GREETING)
    received = b""
    while len(received) < len(GREETING):
        chunk = peer.recv(len(GREETING) - len(received))
        if not chunk:
            raise ConnectionResetError("closed during the greeting")
        received += chunk
    peer.sendall(READY_COMMAND)
    if not peer.recv(2):  # the start of the server's READY
        raise ConnectionResetError("closed before READY")


def zmtp_frame(body: bytes) -> bytes:
    if len(body) < 256:
        return b"\x00" + bytes([len(body)]) + body
    return b"\x02" + len(body).to_bytes(8, "big") + body


def flood_topics(address: str, duration: float, sent: Any) -> None:
    """For ``duration`` seconds, subscribe to ``TOPICS`` distinct topics just within the
    message bound, and as many of 1 KiB, over raw ZMTP as libzmq's XSUB does: when the
    connection is closed, connect again after its reconnect interval and send every
    topic once more. ``sent`` counts the bytes written."""
    path = address[len("ipc://"):]
    filler = b"t" * (PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES - 1 - 8)
    within = b"".join(zmtp_frame(b"\x01" + index.to_bytes(8, "big") + filler)
                      for index in range(TOPICS))
    beyond = b"".join(zmtp_frame(b"\x01" + index.to_bytes(8, "big") + b"k" * 1016)
                      for index in range(TOPICS))
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        for burst in (within, beyond):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
                peer.settimeout(1.0)
                try:
                    peer.connect(path)
                    zmtp_handshake(peer)
                    view = memoryview(burst)
                    while view and time.monotonic() < deadline:
                        written = peer.send(view)
                        sent.value += written
                        view = view[written:]
                except OSError:
                    pass  # closed by the coordinator
            time.sleep(RECONNECT_IVL_S)


def test_a_topic_flood_costs_bounded_memory_and_publishes_stay_on_schedule(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(2)
    addresses = handle.addresses
    plane = open_gate(zmq_ctx, addresses, 2)
    front = RawFrontend(zmq_ctx, addresses)
    front.subscribe_publishes()
    front.next_full_publish(timeout=5.0)
    baseline = rss_kib(handle.pid)["VmRSS"]

    spawn = multiprocessing.get_context("spawn")
    counts = [spawn.Value("q", 0) for _ in range(2)]
    floods = [spawn.Process(target=flood_topics, args=(addresses[key], FLOOD_S, count),
                            daemon=True)
              for key, count in zip(("back_publish", "front_publish"), counts, strict=True)]
    for process in floods:
        process.start()
    peak = baseline
    publishes: list[float] = []
    step = 0
    next_report = time.monotonic()
    try:
        deadline = time.monotonic() + FLOOD_S + 1.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_report:
                # A legitimate engine's pace: a stats report every 100 ms, each published.
                plane[0].report(stats_report(0, waiting=step % 7, running=1, step=step))
                step += 1
                next_report = time.monotonic() + 0.1
            buf = front.recv_publish(0.01)
            if buf is not None and not is_wave_publish(buf):
                publishes.append(time.monotonic())
            peak = max(peak, rss_kib(handle.pid)["VmRSS"])
    finally:
        for process in floods:
            process.join(FLOOD_S + 10)
            if process.is_alive():
                process.kill()
    # What the coordinator's side took in, in topics just within the bound.
    sent = sum(count.value for count in counts) // PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES
    assert sent > TOPICS, sent
    grown_mib = (max(peak, rss_kib(handle.pid)["VmHWM"]) - baseline) / 1024
    gaps = [b - a for a, b in itertools.pairwise(publishes)]
    print(f"\nRSS +{grown_mib:.1f} MiB over {baseline / 1024:.0f} MiB; {len(publishes)} "
          f"full publishes, longest gap {max(gaps, default=0.0):.2f} s; {sent} topics written "
          f"({[count.value // PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES for count in counts]})")
    # Without the guard this flood grew the process by about 580 MiB; with it by 25 to
    # 174 MiB: the topics ZeroMQ files in the coordinator's thread before it sees the
    # first (docs/OPERATIONS.md, Bounds).
    assert grown_mib < 300, f"RSS grew by {grown_mib:.0f} MiB under the topic flood"
    # Publishes are due every 100 ms; the bound leaves room for a loaded machine.
    assert len(publishes) >= 10, publishes
    assert max(gaps) < 2.5, gaps

    # The subscribers the protocol knows still get their rows and waves.
    front.next_full_publish(timeout=5.0)
    for engine in plane:
        engine.subscribe()  # a second subscription is served as the first was
    counters: dict[str, int] = {}

    def refusals_counted() -> bool:
        counters.update(front.counters())
        return all(counters.get(f"refused.subscriptions.{key}", 0) > 0
                   for key in ("back_publish", "front_publish"))

    try:
        wait_until(refusals_counted, timeout=10.0, what="refused subscriptions counted")
    except AssertionError:
        raise AssertionError(f"refused subscriptions not counted on both sockets: "
                             f"{ {k: v for k, v in counters.items() if 'subscri' in k} }") from None
    print({key: value for key, value in counters.items() if key.startswith("refused.")})
    state = front.state()
    assert [row[1] for row in state["engines"]] == ["ready"] * 2 or state["engines"]
    assert handle.is_alive()
