"""Stats ingest per message, against a no-logic reader (``python -m bench.profile ingest``).

One process, an inproc PUSH -> PULL pair (no I/O thread, so only the reading thread's
work is timed), a core of 64 ranks (``bench.core_cost.group``) and the server's own
``StatsReader``. Batches of 256 vLLM 0.33 stats reports (the load processes'
18-key template) from the 64 engines in turn, four per engine per batch, as a flood
gives them; in lockstep their step moves every ten batches. Per message, in µs:

* ``no-logic reader``: the reader's own receive loop (``StatsReader._receive``),
  every frame taken off the socket and dropped;
* ``receive + plan``: that, and the batch plan (peeks, envelope checks, the decodes
  of the reports that are kept) without the core;
* ``whole drain``: ``StatsReader.read_batch``, the core applying what is kept.

Each figure is the quickest batch of ``repeats`` runs of ``batches`` batches, the
variants taking turns in one run of this module, so the three share the machine's
state.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from bench import core_cost
from bench.wire import StatsTemplate
from coordinator.server.stats_reader import StatsReader, plan_batch

ENGINES = 64
BATCH = 256
STEP_EVERY = 10 * BATCH
"""Messages per lockstep step: a flood of about 250k messages a second against
10 ms steps (``bench.wire.lockstep_step``) gives a new step every ten batches or so."""


def _fill(push: zmq.Socket[bytes], templates: list[StatsTemplate], batches: int,
          start: int) -> int:
    counter = start
    for _ in range(batches * BATCH):
        template = templates[counter % ENGINES]
        push.send(bytes(template.set_counter(counter, counter // STEP_EVERY)))
        counter += 1
    return counter


def measure(batches: int = 40, repeats: int = 5) -> list[tuple[str, float]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind("inproc://ingest")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect("inproc://ingest")
    core = core_cost.group(ENGINES)
    runner = core_cost.null_runner(core)
    reader = StatsReader(pull, core, runner.run, clock=lambda: 1.0,
                         on_error=lambda name, exc: None, max_message_bytes=1 << 20,
                         batch=BATCH)
    templates = [StatsTemplate(rank) for rank in range(ENGINES)]
    counter = 0

    def receive_only() -> None:
        reader._receive()

    def receive_and_plan() -> None:
        plan_batch(reader._receive(), core.rank_range, core.skippable_wave(),
                   core.step_state())

    def whole() -> None:
        reader.read_batch()

    variants = (("no-logic reader (receive and drop)", receive_only),
                ("receive + plan (no core)", receive_and_plan),
                ("whole drain (StatsReader.read_batch)", whole))
    best = [float("inf")] * len(variants)
    try:
        for _ in range(repeats):  # the variants take turns, so that they share the machine
            for index, (_, drain) in enumerate(variants):
                counter = _fill(push, templates, batches, counter)
                best[index] = min(best[index], _timed(drain, batches))
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
    superseded = core.counter_values().get("stats.superseded", 0)
    reports = core.counter_values().get("stats.reports", 0)
    share = superseded / max(1, superseded + reports)
    return [(name, cost / BATCH * 1e6) for (name, _), cost in zip(
        variants, best, strict=True)] + [("(share of reports superseded)", share)]


def _timed(drain: Callable[[], None], batches: int) -> float:
    """The quickest of ``batches`` drains (one batch each): short enough that some
    escape the preemptions of a busy host."""
    best = float("inf")
    for _ in range(batches):
        started = time.perf_counter()
        drain()
        best = min(best, time.perf_counter() - started)
    return best


def main(batches: int, repeats: int) -> int:
    results = measure(batches, repeats)
    print(f"stats ingest per message, {ENGINES} engines, batches of {BATCH} "
          f"(quickest of {repeats} x {batches} batches):")
    print("| step | µs per message |\n|---|---:|")
    for name, cost in results:
        print(f"| {name} | {cost:.2f} |")
    floor = results[0][1]
    print(f"\nwhole drain / no-logic reader: {results[2][1] / floor:.2f}x")
    return 0
