"""The core's work per submit, alone and step by step (``python -m bench.profile core``).

No sockets, no other process: a ``CoordinatorCore`` of ``--engines`` ranks is brought
up in this process with the events a group causes (HELLO, READY, the dispatch
greeting, the subscriptions, a frontend's registration), and then timed:

* ``submit``: a whole submit to a running group through ``core.handle`` (admission,
  pick, ledger, reply, ``DispatchAdd``), a ``finished`` every 256 as the ``dispatch``
  benchmark sends them;
* each step on its own, calling what ``on_submit`` calls on the same state: the
  header decode the reader does, the frontend's lease renewal, admission, the pick,
  the first-request check of a running group, the ledger, the reply's encoding, the
  actions' construction, the outbox flush, and the server's runner with carriers
  that do no IO;
* ``first request``: a submit that wakes a paused group, timed alone (between
  two of them, a ``wave_complete`` pauses the group again); the median of single
  calls, since on a busy host a mean of 20 µs calls is spoilt by preemptions.

Each figure is the least mean per call in µs over blocks of 50 calls
(``--number`` x ``--repeats`` calls in all): the machine is shared, and the
minimum is what the work costs when nothing else runs. The steps do not add up
to ``submit`` exactly (call overhead, and the steps that must be undone to stay
repeatable).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from coordinator.core.actions import (
    DispatchAdd,
    Log,
    Publish,
    RearmTimer,
    RefreshObserved,
    SaveState,
    Send,
    SetLinger,
)
from coordinator.core.coordinator import CoordinatorCore, CoreConfig
from coordinator.core.dispatch.handlers import Retry
from coordinator.core.events import (
    ENGINE_SUBSCRIBED,
    Bound,
    EngineGreeted,
    FrontendRequestReceived,
    HandshakeReceived,
)
from coordinator.core.runner import ActionRunner
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import rank_to_identity

ADDRESSES = {key: f"ipc:///run/{key}" for key in (
    "handshake", "dispatch", "back_output", "back_publish", "front_publish", "frontend")}
FRONTEND = b"\x00fe-0"
PAYLOAD = [b"\x00" * 1024]


def group(engines: int) -> CoordinatorCore:
    """A core whose ``engines`` ranks are READY and greeted, the gate open, one frontend
    registered; paused (no request yet)."""
    parallel: dict[str, int | str | list[int]] = {
        "data_parallel_master_ip": "127.0.0.1", "data_parallel_master_port": 29500,
        "_data_parallel_master_port_list": [29501], "data_parallel_size": engines}
    core = CoordinatorCore(CoreConfig(rank_start=0, engines=engines), rng=random.Random(0),
                           now=0.0)
    core.handle(Bound(dict(ADDRESSES), parallel), 0.0)
    for rank in range(engines):
        identity = rank_to_identity(rank)
        core.handle(HandshakeReceived(identity, rank, vllm.HandshakeMessage("HELLO"), 0), 0.0)
        core.handle(HandshakeReceived(identity, rank, vllm.HandshakeMessage("READY"), 0), 0.0)
        core.handle(EngineGreeted(rank, 0), 0.0)
    for _ in range(engines):
        core.handle(ENGINE_SUBSCRIBED, 0.0)
    core.handle(FrontendRequestReceived(FRONTEND, fp.Register(1, 0, "ipc:///run/out"), []),
                0.0)
    return core


def null_runner(core: CoordinatorCore) -> ActionRunner:
    """The server's runner with carriers that do no IO (every send succeeds)."""
    def nothing(action: Any) -> None:
        return None
    return ActionRunner(core, {kind: nothing for kind in (
        Send, DispatchAdd, Publish, Log, SaveState, SetLinger, RefreshObserved,
        RearmTimer)}, lambda: 1.0)


def best_us(call: Callable[[], object], number: int, repeats: int, block: int = 50) -> float:
    """The least mean, in µs, over blocks of ``block`` calls (``number * repeats`` calls in
    all): short blocks, so that some escape the preemptions of a busy host."""
    best = float("inf")
    for _ in range(max(1, number * repeats // block)):
        started = time.perf_counter()
        for _ in range(block):
            call()
        best = min(best, (time.perf_counter() - started) / block)
    return best * 1e6


def measure(engines: int = 64, number: int = 2000, repeats: int = 7) -> list[tuple[str, float]]:
    """Each step's cost in µs, in the order ``on_submit`` takes them."""
    core = group(engines)
    runner = null_runner(core)
    now = 1.0
    counter = iter(range(1 << 62))
    # The first submit wakes the group; from then on it runs (no engine reports).
    runner.run(core.handle(FrontendRequestReceived(
        FRONTEND, fp.Submit(0, "wake", 0), list(PAYLOAD)), now))
    in_flight: list[str] = []

    def submit() -> None:
        request_id = f"r{next(counter)}"
        runner.run(core.handle(FrontendRequestReceived(
            FRONTEND, fp.Submit(1, request_id, 0), PAYLOAD), now))
        in_flight.append(request_id)
        if len(in_flight) >= 256:
            runner.run(core.handle(FrontendRequestReceived(
                FRONTEND, fp.Finished(list(in_flight)), []), now))
            in_flight.clear()

    results = [("submit through the core and the runner (no IO)",
                best_us(submit, number, repeats))]
    header = fp.encode(fp.Submit(1, "r-123456", 0))
    dispatch, choice, membership = core.dispatch, core.dispatch.choice, core.membership
    ledger, registry, waves = dispatch.requests, core.frontends.registry, core.waves
    results.append(("decode the header (reader)", best_us(
        lambda: fp.decode_header(header, 1), number, repeats)))
    results.append(("renew the frontend's lease", best_us(
        lambda: registry.touch(FRONTEND, now), number, repeats)))
    results.append(("admission (ledger refusal)", best_us(
        lambda: ledger.refusal("r-new", shutting_down=False), number, repeats)))
    results.append(("pick: dispatchable ranks", best_us(
        membership.dispatchable, number, repeats)))
    candidates = membership.dispatchable()
    results.append(("pick: the policy over an idle group (all tied)", best_us(
        lambda: choice.choose(candidates, None), number, repeats)))
    results.append(("first-request check (group running)", best_us(
        lambda: waves.first_request(0, 0, "r", now, core._out), number, repeats)))

    def ledger_step() -> None:
        choice.loads.note_dispatched(3)
        dispatch.dispatched_by_rank[3] += 1
        ledger.add("r-ledger", 3, FRONTEND)
        ledger.forget("r-ledger")
        choice.loads.note_dispatched(3, -1)
    results.append(("ledger: load, count, in flight (add and forget)", best_us(
        ledger_step, number, repeats)))
    results.append(("encode the reply", best_us(
        lambda: fp.encode(fp.Submitted(1, "r-123456", 3, False)), number, repeats)))

    def build() -> DispatchAdd:
        retry = Retry(FRONTEND, 1, "r-123456", 0, cost=0.0, prompt=None)
        reply = Send("frontend", FRONTEND, (b"reply",))
        return DispatchAdd(3, rank_to_identity(3), PAYLOAD, reply, (), retry)
    results.append(("build the actions (Retry, Send, DispatchAdd)", best_us(
        build, number, repeats)))
    results.append(("event: FrontendRequestReceived", best_us(
        lambda: FrontendRequestReceived(FRONTEND, fp.Submit(1, "r", 0), PAYLOAD, "frontend",
                                        None), number, repeats)))
    results.append(("flush the outbox (core.handle's end)", best_us(
        core._flush, number, repeats)))
    add = build()
    results.append(("the runner over one DispatchAdd (null carriers)", best_us(
        lambda: runner.run((add,)), number, repeats)))

    paused = group(engines)
    paused_runner = null_runner(paused)
    submits: list[float] = []
    # A wave's first request, timed alone; between two, the wave_complete that pauses
    # the group again and the finished that frees its entry. The median of single
    # calls: a call of 20 µs is often enough preempted on a busy host to spoil a mean.
    for wave in range(max(1, number // 4) * repeats):
        request_id = f"f{wave}"
        event = FrontendRequestReceived(FRONTEND, fp.Submit(1, request_id, wave), PAYLOAD)
        started = time.perf_counter()
        paused_runner.run(paused.handle(event, now))
        submits.append(time.perf_counter() - started)
        paused_runner.run(paused.on_engine_report(vllm.EngineReport(
            engine_index=0, wave_complete=wave), now))
        paused.handle(FrontendRequestReceived(FRONTEND, fp.Finished([request_id]), []), now)
    results.append(("a wave's first request (a submit that wakes the group; median)",
                    statistics.median(submits) * 1e6))
    return results


def table(results: list[tuple[str, float]]) -> str:
    lines = ["| step | µs |", "|---|---:|"]
    lines += [f"| {name} | {cost:.2f} |" for name, cost in results]
    return "\n".join(lines)


def main(engines: int, number: int, repeats: int) -> int:
    print(f"core work per submit, {engines} ranks (least mean over blocks of 50 calls, "
          f"{repeats} x {number} calls per step):")
    print(table(measure(engines, number, repeats)))
    return 0
