"""A flood of garbage and repeats through the real process writes a bounded number of log lines.

Every per-message log line is rate limited by a key that peers cannot vary at
will (not their identity, not their CURVE key), and a connect is logged once
per connection, however many messages that connection sends.
"""

from __future__ import annotations

import os
import time

import zmq

from coordinator.protocol import frontend as fp
from tests import vllm_peers as peers
from tests.conftest import CoordinatorFactory

Ctx = zmq.Context[zmq.Socket[bytes]]
FLOOD_S = 2.0
# Distinct kinds of line the flood below can cause, each at most once per 5 s
# interval (plus the count of those suppressed in the next one), with room to spare.
MAX_LINES = 40


def dealer(ctx: Ctx, address: str, identity: bytes) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    return sock


def test_a_garbage_flood_writes_a_bounded_number_of_log_lines(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    handle = coordinator(2)
    addresses = handle.addresses
    engines = peers.handshake_group(zmq_ctx, addresses, [0, 1], dp_size=2)
    time.sleep(0.3)
    before = handle.stderr_text().count("\n")
    sent = 0

    xsub = zmq_ctx.socket(zmq.XSUB)
    xsub.setsockopt(zmq.LINGER, 0)
    xsub.connect(addresses["back_publish"])
    upstream = zmq_ctx.socket(zmq.XSUB)
    upstream.setsockopt(zmq.LINGER, 0)
    upstream.connect(addresses["front_publish"])
    push = zmq_ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(addresses["back_output"])
    stranger = dealer(zmq_ctx, addresses["handshake"], (9).to_bytes(2, "little"))
    deadline = time.monotonic() + FLOOD_S
    round_index = 0
    while time.monotonic() < deadline:
        round_index += 1
        # A live rank's connection on dispatch: every message is a greeting.
        for _ in range(100):
            engines[0].greet(os.urandom(8))
        # Garbage on the frontend socket from connections that go away at once, each
        # with an identity of its own: every reply fails to send.
        for index in range(10):
            sock = dealer(zmq_ctx, addresses["frontend"],
                          b"fe" + round_index.to_bytes(4, "little") + bytes([index]))
            sock.send(os.urandom(16))
            sock.send_multipart([fp.encode(fp.QueryState(1)), b"payload"])
            sock.close(0)
        # Subscriptions and unsubscriptions; garbage up front_publish; stats for a rank
        # outside the group; HELLOs for a rank outside the group.
        for _ in range(20):
            xsub.send(b"\x01")
            xsub.send(b"\x00")
            upstream.send(os.urandom(12))
            push.send(peers.stats_report(77, waiting=1, running=1, kv_cache_usage=0.1, step=1))
            stranger.send(peers.hello_payload())
        sent += 100 + 20 + 5 * 20
        time.sleep(0.005)
    # Let the coordinator read everything that was sent.
    time.sleep(1.0)
    assert handle.is_alive()
    lines = handle.stderr_text().splitlines()[before:]
    assert sent > 2000
    assert len(lines) <= MAX_LINES, f"{len(lines)} log lines for {sent} messages:\n" + "\n".join(
        lines[:60])
    for sock in (xsub, upstream, push, stranger):
        sock.close(0)
    for engine in engines:
        engine.close()


def test_the_metrics_url_is_logged_once_at_start_up(coordinator: CoordinatorFactory) -> None:
    handle = coordinator(1, extra_args=["--metrics-port", "0"])
    deadline = time.monotonic() + 5.0
    while "metrics" not in handle.stderr_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = handle.stderr_text()
    assert text.count("http://127.0.0.1:") == 1, text
