"""The hang watchdog, when every rank of a running lockstep group is dead.

Two coordinators run side by side on the same machine, each with a lockstep
group that started wave 0 and then went silent. In one the engines stay
connected (a hung collective looks like this): the watchdog alarms and
re-broadcasts START_DP_WAVE. In the other every engine goes away: its ranks
die, which their own logs and alerts say, and the watchdog stays quiet: a
group with no live rank cannot hang in a collective, and a re-wake would reach
nobody. The alarm of the first bounds how long the second is watched, so a
slow machine stretches both alike.
"""

from __future__ import annotations

import time

import zmq

from tests import vllm_peers as peers
from tests.conftest import CoordinatorFactory, CoordinatorHandle

Ctx = zmq.Context[zmq.Socket[bytes]]
STALL_S = 1.0
ARGS = ["--watchdog-stall-s", str(STALL_S), "--lease-ttl-s", "2"]


def running_group(coordinator: CoordinatorFactory, zmq_ctx: Ctx
                  ) -> tuple[CoordinatorHandle, list[peers.RawEngine], peers.RawFrontend]:
    handle = coordinator(2, extra_args=ARGS)
    front = peers.RawFrontend(zmq_ctx, handle.addresses)
    engines = peers.handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    engines[0].report(peers.engine_outputs(0, start_wave=0))
    peers.wait_until(lambda: front.state()["running"], timeout=30.0, what="wave 0 running")
    return handle, engines, front


def test_a_group_whose_every_rank_died_raises_no_hang_alarm_and_wakes_nobody(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    hung, hung_engines, hung_front = running_group(coordinator, zmq_ctx)
    gone, gone_engines, gone_front = running_group(coordinator, zmq_ctx)
    silent_since = time.monotonic()
    for engine in gone_engines:
        engine.close()
    peers.wait_until(
        lambda: [e[1] for e in gone_front.state()["engines"]] == ["dead", "dead"],
        timeout=60.0, what="both ranks of the emptied group dead")

    # The control: the same silence with live engines is a hang, and is alarmed.
    peers.wait_until(lambda: hung_front.counters().get("watchdog.no_progress", 0) >= 1,
                     timeout=60.0, what="the hung group's alarm")
    alarmed_at = time.monotonic()
    assert hung_front.counters().get("watchdog.rewakes", 0) >= 1
    # Watch the emptied group for as long again as the alarm took to come (at least
    # three stall times): a machine slow enough to delay one delays the other alike.
    window = max(alarmed_at - silent_since, 3 * STALL_S)
    peers.wait_until(lambda: time.monotonic() - alarmed_at > window, timeout=window + 60.0,
                     what="the watch window")
    counters = gone_front.counters()
    assert counters.get("watchdog.no_progress", 0) == 0, counters
    assert counters.get("watchdog.rewakes", 0) == 0, counters
    assert "WATCHDOG" not in gone.stderr_text()
    assert "WATCHDOG" in hung.stderr_text()
    for engine in hung_engines:
        engine.close()
    hung_front.close()
    gone_front.close()
