"""What a stock vLLM 0.33 front-end reads from front_publish and sends up it, byte for byte.

vLLM's front-end stats task decodes each publish as `counts, wave, running`
and unpacks every row as exactly `waiting, running, kv_cache_usage`; its Rust
front-end decodes `(counts, wave: u32, running: bool)` and refuses anything but
one frame. Upstream it sends subscription frames and `["SCALE_ELASTIC_EP", n]`.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from tests.conftest import TRANSPORTS, CoordinatorFactory
from tests.vllm_peers import (
    RawEngine,
    RawFrontend,
    engine_outputs,
    full_publish,
    is_wave_publish,
    open_gate,
    pack,
    stats_report,
    unpack,
    wait_until,
)

Ctx = zmq.Context[zmq.Socket[bytes]]


def hexb(text: str) -> bytes:
    return bytes.fromhex(text)


def vllm_frontend_reads(buf: bytes) -> tuple[list[tuple[int, int, float]] | None, int, bool]:
    """What vLLM 0.33's stats task does with a publish (and the Rust front-end's type rules)."""
    counts, wave, running = unpack(buf)
    assert type(wave) is int and 0 <= wave < 2**32
    assert type(running) is bool
    if counts is None:
        return None, wave, running
    rows = []
    for waiting, running_reqs, kv_cache_usage in counts:  # exactly three, or it raises
        assert type(waiting) is int and type(running_reqs) is int
        assert type(kv_cache_usage) is float
        rows.append((waiting, running_reqs, kv_cache_usage))
    return rows, wave, running


def next_wave_publish(front: RawFrontend, timeout: float = 3.0) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        buf = front.recv_publish(max(0.0, deadline - time.monotonic()))
        assert buf is not None, "no wave publish"
        if is_wave_publish(buf):
            return buf


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_publishes_are_the_spec_bytes(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, transport: str
) -> None:
    """Appendix A: `[[[0,5,0.0],[1,2,0.5]], 3, true]` and `[nil, 4, false]`."""
    handle = coordinator(2, transport=transport, extra_args=["--heartbeat-s", "0.5"])
    engines = open_gate(zmq_ctx, handle.addresses, 2)
    front = RawFrontend(zmq_ctx, handle.addresses)
    front.subscribe_publishes()
    first = front.next_full_publish()
    assert first == hexb("93 92 93 00 00 cb 0000000000000000 93 00 00 cb 0000000000000000 00 c2")

    engines[0].report(stats_report(0, waiting=0, running=5, step=1))
    engines[1].report(stats_report(1, waiting=1, running=2, kv_cache_usage=0.5, step=1))
    engines[1].report(engine_outputs(1, start_wave=3))
    assert next_wave_publish(front) == hexb("93 c0 03 c3")
    want = hexb("93 92 93 00 05 cb 0000000000000000 93 01 02 cb 3fe0000000000000 03 c3")
    assert want == full_publish([(0, 5, 0.0), (1, 2, 0.5)], 3, True)
    wait_until(lambda: front.next_full_publish() == want, timeout=3.0, what="the spec publish")

    engines[0].report(engine_outputs(0, wave_complete=3))
    assert next_wave_publish(front) == hexb("93 c0 04 c2")


def test_every_publish_parses_as_vllm_and_rust_front_ends_do(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(3, extra_args=["--heartbeat-s", "0.3"])
    engines = open_gate(zmq_ctx, handle.addresses, 3)
    front = RawFrontend(zmq_ctx, handle.addresses)
    front.subscribe_publishes()
    front.next_full_publish()
    for wave in range(3):
        engines[2].report(engine_outputs(2, start_wave=wave))
        for rank in range(3):
            engines[rank].report(stats_report(rank, waiting=rank + wave, running=1,
                                              kv_cache_usage=0.125 * rank, step=1, wave=wave))
        engines[0].report(engine_outputs(0, wave_complete=wave))
    samples = front.drain_publishes(0.8)  # recv_publish already insists on one frame
    parsed = [vllm_frontend_reads(buf) for _, buf in samples]
    assert any(rows is None for rows, _, _ in parsed)
    assert any(rows is not None for rows, _, _ in parsed)
    for rows, _, _ in parsed:
        assert rows is None or len(rows) == 3
    assert parsed[-1][1:] == (3, False)


def test_plain_sub_socket_gets_publishes(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    """A front-end using SUB + subscribe("") instead of XSUB + b"\\x01" works the same."""
    handle = coordinator(1)
    open_gate(zmq_ctx, handle.addresses, 1)
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(handle.addresses["front_publish"])
    assert sub.poll(3000)
    assert sub.recv_multipart() == [full_publish([(0, 0, 0.0)], 0, False)]


def test_late_front_end_is_not_left_blind_until_the_heartbeat(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """vLLM leaves a late subscriber without counts for up to 5 s; here it hears soon."""
    handle = coordinator(2)  # default 5 s heartbeat
    engines = open_gate(zmq_ctx, handle.addresses, 2)
    engines[1].report(stats_report(1, waiting=4, running=1, step=1))
    time.sleep(0.3)  # the changed-stats publish has gone out to nobody
    front = RawFrontend(zmq_ctx, handle.addresses)
    start = time.monotonic()
    front.subscribe_publishes()
    buf = front.next_full_publish(timeout=2.0)
    assert time.monotonic() - start < 1.0
    assert buf == full_publish([(0, 0, 0.0), (4, 1, 0.0)], 0, False)


def test_upstream_messages_of_a_vllm_front_end(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Subscribe/unsubscribe frames, SCALE_ELASTIC_EP, and the legacy wake ignored as 0.33
    does (``--frontend-wake ignore``; tests/compat/test_legacy_mode.py: honoured)."""
    # Resizing is allowed within --min-engines..--max-engines (by default, not at all).
    handle = coordinator(2, extra_args=["--heartbeat-s", "0.5", "--max-engines", "3",
                                        "--frontend-wake", "ignore"])
    engines = open_gate(zmq_ctx, handle.addresses, 2)
    front = RawFrontend(zmq_ctx, handle.addresses)
    front.subscribe_publishes()
    front.next_full_publish()

    # Pre-0.33 front-ends asked for a wake with [engine_index, wave]; 0.33 ignores it.
    front.send_upstream(pack([1, 0]))
    front.send_upstream(pack([b"\x01\x00", 0]))  # the identity-bytes variant
    for engine in engines:
        assert engine.recv_publish(0.3) is None, "an ignored legacy wake must not broadcast"
    counters = wait_until(
        lambda: (c := front.counters()).get("dropped.front_publish.legacy_first_request") == 2
        and c, timeout=3.0, what="legacy wakes counted",
    )
    assert not any(k.startswith("internal_error") for k in counters)

    # ["SCALE_ELASTIC_EP", 3], exactly as the spec writes it.
    front.send_upstream(hexb("92 b0") + b"SCALE_ELASTIC_EP" + hexb("03"))
    def three_rows() -> Any:
        rows = unpack(front.next_full_publish())[0]
        return rows if len(rows) == 3 else None

    rows = wait_until(three_rows, timeout=3.0, what="a 3-row publish")
    assert rows == [[0, 0, 0.0]] * 3
    new = RawEngine(zmq_ctx, handle.addresses, 2, handshake=False)
    new.connect_plane()
    new.subscribe()
    assert new.expect_publish() == [b"READY"]
    new.report(stats_report(2, waiting=9, running=9, kv_cache_usage=1.0, step=1))
    want = full_publish([(0, 0, 0.0), (0, 0, 0.0), (9, 9, 1.0)], 0, False)
    wait_until(lambda: front.next_full_publish() == want, timeout=3.0, what="row 2")
    assert handle.is_alive()


def test_rows_are_indexed_by_global_rank(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    """vLLM front-ends slice counts[first_rank:last_rank+1]: row i must be global rank i."""
    handle = coordinator(2, rank_start=2, extra_args=["--heartbeat-s", "0.5"])
    engines = [RawEngine(zmq_ctx, handle.addresses, r, handshake=False) for r in (2, 3)]
    for engine in engines:
        engine.connect_plane()
        engine.subscribe()
    for engine in engines:
        assert engine.expect_publish() == [b"READY"]
    front = RawFrontend(zmq_ctx, handle.addresses)
    front.subscribe_publishes()
    front.next_full_publish()
    engines[1].report(stats_report(3, waiting=6, running=2, step=1))
    engines[0].report(stats_report(1, waiting=99, step=1))  # rank 1 is not ours
    want = full_publish([(0, 0, 0.0), (0, 0, 0.0), (0, 0, 0.0), (6, 2, 0.0)], 0, False)
    wait_until(lambda: front.next_full_publish() == want, timeout=3.0, what="row 3")
    counters = wait_until(
        lambda: (c := front.counters()).get("dropped.back_output.rank_out_of_range") and c,
        timeout=3.0, what="rank 1 dropped",
    )
    assert counters["dropped.back_output.rank_out_of_range"] == 1
