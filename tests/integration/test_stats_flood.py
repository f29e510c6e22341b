"""A stats flood with wave messages in it, through the real process: none lost or reordered.

The coordinator reads ``back_output`` in batches and skips stats reports that a
newer report of the same engine supersedes (coordinator/server/stats_reader.py).
Here two processes flood it with vLLM-shaped stats while one of them walks the
group through a long run of waves, its ``start_wave`` and ``wave_complete``
messages (some carrying statistics too) scattered among the stats on its pipe.
Every wave message must act, once and in order: each ``start_wave`` relays one
``START_DP_WAVE`` to every engine and each change is published, so the exact
sequences on ``back_publish`` and ``front_publish`` prove it; the counters must
account for every stats report (applied or superseded) and show that reports
were in fact superseded, or the batching was never exercised.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import zmq

from tests.conftest import CoordinatorFactory
from tests.vllm_peers import (
    RawFrontend,
    engine_outputs,
    is_wave_publish,
    open_gate,
    scheduler_stats,
    start_dp_wave_frames,
    stats_report,
    wait_until,
    wave_publish,
)

Ctx = zmq.Context[zmq.Socket[bytes]]

ENGINES = 4
WAVES = 60
STATS_BETWEEN = 250
# The coordinator queues at most 128 messages per connection, so most of a flood waits
# in the sender's own queue. libzmq's linger delivers a closing socket's queue but may
# drop the last write buffer it could not hand to the kernel yet: a sender keeps its
# socket open until the test saw every report taken in.
LINGER_MS = 5_000
HOLD_S = 120.0


def flood_with_waves(address: str, waves: int, sent: Any, may_close: Any) -> None:
    """Stats of every rank, with start_wave(w) and wave_complete(w) for each wave among them."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, LINGER_MS)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(address)
    stats = 0

    def burst() -> None:
        nonlocal stats
        for _ in range(STATS_BETWEEN):
            stats += 1
            push.send(stats_report(stats % ENGINES, waiting=stats % 7, running=stats % 5,
                                   step=stats))

    try:
        for wave in range(waves):
            burst()
            sender = wave % ENGINES
            if wave % 3 == 0:  # a wave message that carries statistics as well
                stats += 1
                push.send(engine_outputs(sender, start_wave=wave,
                                         stats=scheduler_stats(waiting=1, step=stats)))
            else:
                push.send(engine_outputs(sender, start_wave=wave))
            burst()
            push.send(engine_outputs(0, wave_complete=wave))
        burst()
    finally:
        sent.value = stats
        may_close.wait(HOLD_S)
        push.close()
        ctx.term()


def flood_stats_only(address: str, count: int, sent: Any, may_close: Any) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, LINGER_MS)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(address)
    try:
        for n in range(count):
            push.send(stats_report(1 + n % (ENGINES - 1), waiting=n % 11, step=n))
    finally:
        sent.value = count
        may_close.wait(HOLD_S)
        push.close()
        ctx.term()


def test_no_wave_message_is_lost_or_reordered_in_a_stats_flood(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(ENGINES)
    addresses = handle.addresses
    engines = open_gate(zmq_ctx, addresses, ENGINES)
    front = RawFrontend(zmq_ctx, addresses)
    front.subscribe_publishes()
    front.next_full_publish(timeout=5.0)

    spawn = multiprocessing.get_context("spawn")
    with_waves, stats_only = spawn.Value("q", 0), spawn.Value("q", 0)
    may_close = spawn.Event()
    floods = [
        spawn.Process(target=flood_with_waves,
                      args=(addresses["back_output"], WAVES, with_waves, may_close), daemon=True),
        spawn.Process(target=flood_stats_only,
                      args=(addresses["back_output"], 40_000, stats_only, may_close), daemon=True),
    ]
    for process in floods:
        process.start()

    try:
        # Every wave publish, in order, until the group pauses after the last wave.
        expected = [publish for w in range(WAVES)
                    for publish in (wave_publish(w, True), wave_publish(w + 1, False))]
        seen: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(seen) < len(expected) and time.monotonic() < deadline:
            buf = front.recv_publish(1.0)
            if buf is not None and is_wave_publish(buf):
                seen.append(buf)
        assert seen == expected

        # Every start_wave was relayed once, in order, to every engine.
        want = [start_dp_wave_frames(w, w % ENGINES) for w in range(WAVES)]
        for engine in engines:
            got = []
            while (frames := engine.recv_publish(0.5 if len(got) < WAVES else 0.05)) is not None:
                got.append(frames)
            assert got == want, engine.rank

        # Every stats report is accounted for: applied or superseded, none dropped.
        wait_until(lambda: with_waves.value and stats_only.value, timeout=HOLD_S,
                   what="the floods to finish sending")
        total = with_waves.value + stats_only.value
        taken: list[dict[str, int]] = []

        def all_taken_in() -> bool:
            taken[:] = [front.counters()]
            return sum(taken[0].get(k, 0) for k in ("stats.reports", "stats.superseded")) >= total

        try:
            wait_until(all_taken_in, timeout=30.0, what="the coordinator to take in every report")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {total} sent, counters {taken}") from None
    finally:
        may_close.set()
    for process in floods:
        process.join(30)
        assert process.exitcode == 0
    counters = front.counters()
    assert counters.get("stats.reports", 0) + counters.get("stats.superseded", 0) == total
    assert counters.get("stats.superseded", 0) > 0, counters
    assert counters["waves.start_broadcasts"] == WAVES
    assert not {k: v for k, v in counters.items()
                if k.startswith(("dropped.", "internal_error"))}, counters
    assert handle.is_alive()
