"""back_output's memory is bounded under a flood, and a legitimate engine is not hurt by it.

Four processes push valid vLLM stats as fast as they can, far more than a
coordinator can take in; with vLLM's unbounded receive queue (``RCVHWM 0``)
libzmq kept whatever they sent and the process grew by hundreds of MB a
second. Here each connection may queue ``BACK_OUTPUT_RCVHWM`` messages and the
rest waits at the senders. Meanwhile a fifth engine on its own connection
walks the group through waves at a normal pace: every one of its wave messages
must act, in order, and full publishes must keep coming. RSS is sampled from
/proc throughout.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time

import zmq

from coordinator.server.stats_reader import BACK_OUTPUT_RCVHWM
from tests.conftest import CoordinatorFactory
from tests.vllm_peers import (
    RawFrontend,
    engine_outputs,
    flood_stats,
    is_wave_publish,
    open_gate,
    stats_report,
    wave_publish,
)

Ctx = zmq.Context[zmq.Socket[bytes]]

FLOODERS = 4
FLOOD_S = 3.0
MIB = 1024 * 1024


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def test_a_stats_flood_costs_bounded_memory_and_spares_a_legitimate_engine(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    assert 0 < BACK_OUTPUT_RCVHWM <= 10_000
    engines = FLOODERS + 1
    handle = coordinator(engines)
    addresses = handle.addresses
    plane = open_gate(zmq_ctx, addresses, engines)
    legit = plane[FLOODERS]
    front = RawFrontend(zmq_ctx, addresses)
    front.subscribe_publishes()
    front.next_full_publish(timeout=5.0)
    baseline = rss_kib(handle.pid)["VmRSS"]

    spawn = multiprocessing.get_context("spawn")
    counts = [spawn.Value("q", 0) for _ in range(FLOODERS)]
    floods = [spawn.Process(target=flood_stats, args=(addresses["back_output"], rank, FLOOD_S,
                                                      counts[rank]), daemon=True)
              for rank in range(FLOODERS)]
    for process in floods:
        process.start()
    peak = baseline
    publishes: list[float] = []
    waves: list[bytes] = []
    wave = 0
    next_step = time.monotonic()
    try:
        deadline = time.monotonic() + FLOOD_S + 1.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_step and wave < 20:
                # A legitimate engine's pace: a report and a wave every 100 ms.
                legit.report(stats_report(legit.rank, waiting=wave, running=1, step=wave))
                legit.report(engine_outputs(legit.rank, start_wave=wave))
                legit.report(engine_outputs(legit.rank, wave_complete=wave))
                wave += 1
                next_step = now + 0.1
            buf = front.recv_publish(0.01)
            if buf is not None:
                if is_wave_publish(buf):
                    waves.append(buf)
                else:
                    publishes.append(time.monotonic())
            peak = max(peak, rss_kib(handle.pid)["VmRSS"])
    finally:
        for process in floods:
            process.join(10)
            if process.is_alive():
                process.kill()
    sent = sum(count.value for count in counts)
    assert sent > 100_000, sent  # the flood really was one
    grown_mib = (max(peak, rss_kib(handle.pid)["VmHWM"]) - baseline) / 1024
    assert grown_mib < 64, f"RSS grew by {grown_mib:.0f} MiB under the flood"

    # Every wave message of the legitimate engine acted, in order.
    while (buf := front.recv_publish(1.0)) is not None and len(waves) < 2 * wave:
        if is_wave_publish(buf):
            waves.append(buf)
    assert waves[:2 * wave] == [p for w in range(wave)
                                for p in (wave_publish(w, True), wave_publish(w + 1, False))]
    # Full publishes kept coming (vLLM's coordinator sends none for seconds under a flood).
    assert len(publishes) >= 10, publishes
    # Publishes are due every 100 ms; a starved loop sends none for the whole 3 s
    # flood. The bound sits between the two with room for a loaded machine.
    gaps = [b - a for a, b in itertools.pairwise(publishes)]
    assert max(gaps) < 2.5, gaps
    counters = front.counters()
    assert counters["waves.start_broadcasts"] == wave
    assert handle.is_alive()
