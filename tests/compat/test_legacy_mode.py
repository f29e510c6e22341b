"""Front-ends from before vLLM 0.33: their wake, and `--vllm-compat legacy`'s rows.

Those front-ends (spec section 7) send msgpack `[engine, wave]` up their XSUB on
front_publish when they route a request while the group is paused, expecting
the coordinator to wake the other engines; 0.29-0.32 name the engine by its
identity bytes, and their engines send no `start_wave` for a request stamped
with their own wave, so in MoE the wake is the only thing that brings the
other ranks in. The coordinator honours it by default (once per wave, waking
everyone, as its own first-request rule does), with the 3-wide rows every
front-end from 0.29 to 0.33 unpacks. `--vllm-compat legacy` adds two-element
rows for front-ends older still; `--frontend-wake ignore` drops and counts the
wake, as vLLM 0.33 does. Waves stay within the u32 that vLLM's Rust front-end
decodes.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from tests.conftest import CoordinatorFactory
from tests.vllm_peers import (
    RawFrontend,
    engine_outputs,
    is_wave_publish,
    open_gate,
    pack,
    start_dp_wave_frames,
    stats_report,
    unpack,
    wait_until,
    wave_publish,
)

Ctx = zmq.Context[zmq.Socket[bytes]]

U32_MAX = 2**32 - 1
LEGACY = ["--vllm-compat", "legacy", "--heartbeat-s", "0.5"]


class LegacyGroup:
    """Engines through the gate and a legacy front-end subscribed to publishes."""

    def __init__(self, coordinator: CoordinatorFactory, ctx: Ctx, engines: int,
                 extra_args: list[str]) -> None:
        self.handle = coordinator(engines, extra_args=extra_args)
        self.engines = open_gate(ctx, self.handle.addresses, engines)
        self.front = RawFrontend(ctx, self.handle.addresses)
        self.front.subscribe_publishes()
        self.first_publish = self.front.next_full_publish()

    def legacy_wake(self, engine_index: Any, wave: int) -> None:
        self.front.send_upstream(pack([engine_index, wave]))

    def all_broadcasts(self, duration: float) -> list[list[list[bytes]]]:
        """What each engine receives on back_publish during the same `duration` seconds."""
        got: list[list[list[bytes]]] = [[] for _ in self.engines]
        poller = zmq.Poller()
        for engine in self.engines:
            poller.register(engine.sub, zmq.POLLIN)
        deadline = time.monotonic() + duration
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            for rank, engine in enumerate(self.engines):
                if engine.sub in ready:
                    assert engine.sub is not None
                    got[rank].append(engine.sub.recv_multipart())
        return got

    def counter(self, name: str, value: int) -> dict[str, int]:
        counters: dict[str, int] = wait_until(
            lambda: (c := self.front.counters()).get(name) == value and c,
            timeout=3.0, what=f"{name} == {value}",
        )
        assert not any(key.startswith("internal_error") for key in counters), counters
        return counters

    def next_wave_publish(self, timeout: float = 3.0) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            buf = self.front.recv_publish(max(0.0, deadline - time.monotonic()))
            assert buf is not None, "no wave publish"
            if is_wave_publish(buf):
                return buf

    def wave_publishes(self, duration: float) -> list[bytes]:
        return [b for _, b in self.front.drain_publishes(duration) if is_wave_publish(b)]


def two_wide(rows: list[tuple[int, int]], wave: int, running: bool) -> bytes:
    """A pre-kv_cache_usage publish: `[[[waiting, running], ...], wave, running]`."""
    return pack([[list(row) for row in rows], wave, running])


def test_a_legacy_wake_while_paused_wakes_everyone_once(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    group = LegacyGroup(coordinator, zmq_ctx, 3, LEGACY)
    # Three front-ends route their first requests of wave 0 at about the same time.
    group.legacy_wake(1, 0)
    group.legacy_wake(2, 0)
    group.legacy_wake(b"\x00\x00", 0)  # the identity-bytes variant some versions sent
    assert group.all_broadcasts(0.5) == [[start_dp_wave_frames(0, None)]] * 3
    group.counter("legacy.first_requests", 3)
    # Waking is not running: the flag flips only when an engine says it started.
    assert group.wave_publishes(0.2) == []
    group.engines[1].report(engine_outputs(1, start_wave=0))
    assert group.next_wave_publish() == wave_publish(0, True)
    group.all_broadcasts(0.3)  # an engine's start may be relayed once our wake is old
    # While the group runs, a legacy wake changes nothing.
    group.legacy_wake(0, 0)
    group.counter("legacy.first_requests", 4)
    assert group.all_broadcasts(0.3) == [[], [], []]
    assert group.handle.is_alive()


def test_a_stale_or_newer_stamp_wakes_the_right_wave(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    group = LegacyGroup(coordinator, zmq_ctx, 2, LEGACY)
    group.engines[1].report(engine_outputs(1, start_wave=0))
    assert group.next_wave_publish() == wave_publish(0, True)
    group.engines[0].report(engine_outputs(0, wave_complete=0))
    assert group.next_wave_publish() == wave_publish(1, False)
    assert group.all_broadcasts(0.2) == [[start_dp_wave_frames(0, 1)]] * 2

    # The front-end has not heard of wave 1 yet: its stamp 0 is stale; wave 1 is woken.
    group.legacy_wake(0, 0)
    assert group.all_broadcasts(0.3) == [[start_dp_wave_frames(1, None)]] * 2
    group.engines[0].report(engine_outputs(0, start_wave=1))
    assert group.next_wave_publish() == wave_publish(1, True)
    group.all_broadcasts(0.2)  # the start is relayed too if our wake is already old
    group.engines[0].report(engine_outputs(0, wave_complete=1))
    assert group.next_wave_publish() == wave_publish(2, False)

    # A stamp above ours (say, this process restarted) is adopted, then woken.
    group.legacy_wake(1, 7)
    assert group.next_wave_publish() == wave_publish(7, False)
    assert group.all_broadcasts(0.3) == [[start_dp_wave_frames(7, None)]] * 2


def test_full_publishes_have_two_element_rows(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    group = LegacyGroup(coordinator, zmq_ctx, 2, LEGACY)
    assert group.first_publish == two_wide([(0, 0), (0, 0)], 0, False)
    group.engines[1].report(stats_report(1, waiting=4, running=1, kv_cache_usage=0.75, step=1))
    want = two_wide([(0, 0), (4, 1)], 0, False)
    wait_until(lambda: group.front.next_full_publish() == want, timeout=3.0, what="row 1")
    assert want == bytes.fromhex("93 92 92 00 00 92 04 01 00 c2")
    # What a pre-0.33 front-end does with it: every row unpacks as exactly two values.
    counts, _, _ = unpack(want)
    assert [(waiting, running_reqs) for waiting, running_reqs in counts] == [(0, 0), (4, 1)]
    # Wave-only publishes keep their shape.
    group.engines[0].report(engine_outputs(0, start_wave=0))
    assert group.next_wave_publish() == wave_publish(0, True)


def test_a_paused_032_moe_group_is_woken_by_its_frontend_by_default(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Issue 19: 0.32 ranks, paused; the API server sends its ADD straight to rank 1
    and the old first-request wake here. Rank 1 stays silent (its request carries its
    own wave), so without our START_DP_WAVE ranks 0 and 2 would never join: a hang."""
    group = LegacyGroup(coordinator, zmq_ctx, 3, ["--heartbeat-s", "0.5"])
    assert unpack(group.first_publish)[0] == [[0, 0, 0.0]] * 3  # rows stay 3-wide
    group.engines[0].report(engine_outputs(0, start_wave=0))
    assert group.next_wave_publish() == wave_publish(0, True)
    group.engines[0].report(engine_outputs(0, wave_complete=0))
    assert group.next_wave_publish() == wave_publish(1, False)
    group.all_broadcasts(0.3)  # the relay of rank 0's start
    # The ADD for rank 1 goes engine-direct (no coordinator traffic); then the wake.
    group.legacy_wake(b"\x01\x00", 1)
    assert group.all_broadcasts(0.5) == [[start_dp_wave_frames(1, None)]] * 3
    group.counter("legacy.first_requests", 1)
    # The woken ranks start: rank 0's mirror start_wave flips running, 3-wide rows follow.
    group.engines[0].report(engine_outputs(0, start_wave=1))
    assert group.next_wave_publish() == wave_publish(1, True)
    group.engines[1].report(stats_report(1, waiting=0, running=1, step=1, wave=1))
    want = [[0, 0, 0.0], [0, 1, 0.0], [0, 0, 0.0]]
    wait_until(lambda: unpack(group.front.next_full_publish())[0] == want, timeout=5.0,
               what="3-wide rows after the wake")
    assert group.handle.is_alive()


def test_frontend_wake_ignore_drops_and_counts_the_legacy_wake(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    group = LegacyGroup(coordinator, zmq_ctx, 2,
                        ["--heartbeat-s", "0.5", "--frontend-wake", "ignore"])
    assert unpack(group.first_publish)[0] == [[0, 0, 0.0], [0, 0, 0.0]]
    group.legacy_wake(1, 0)
    assert group.all_broadcasts(0.4) == [[], []]
    counters = group.counter("dropped.front_publish.legacy_first_request", 1)
    assert "legacy.first_requests" not in counters
    assert group.wave_publishes(0.2) == []


def test_waves_stay_within_u32(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    group = LegacyGroup(coordinator, zmq_ctx, 2, LEGACY)
    group.legacy_wake(0, U32_MAX + 1)
    group.legacy_wake(0, -1)
    group.counter("dropped.front_publish.bad_value", 2)
    assert group.all_broadcasts(0.3) == [[], []]

    group.legacy_wake(0, U32_MAX)
    assert group.next_wave_publish() == wave_publish(U32_MAX, False)
    assert group.all_broadcasts(0.3) == [[start_dp_wave_frames(U32_MAX, None)]] * 2
    # Publishes and broadcasts around it all decode as the Rust front-end's u32.
    group.engines[0].report(engine_outputs(0, start_wave=U32_MAX))
    assert group.next_wave_publish() == wave_publish(U32_MAX, True)
    # Completing the last u32 wave would make the next one 2**32: refused at the edge.
    group.engines[0].report(engine_outputs(0, wave_complete=U32_MAX))
    group.counter("dropped.back_output.bad_value", 1)
    group.legacy_wake(1, U32_MAX)
    for _, buf in group.front.drain_publishes(0.7):  # includes a heartbeat
        _, wave, running = unpack(buf)
        assert wave == U32_MAX and type(running) is bool
    for received in group.all_broadcasts(0.2):
        for frames in received:
            assert unpack(frames[1])[0] == U32_MAX
    assert group.handle.is_alive()


def test_a_legacy_wake_for_a_rank_outside_the_group_is_dropped(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    group = LegacyGroup(coordinator, zmq_ctx, 2, LEGACY)
    group.legacy_wake(2, 0)
    group.counter("dropped.front_publish.rank_out_of_range", 1)
    assert group.all_broadcasts(0.3) == [[], []]
