"""When quiet engines are probed, and what a probe's answer means."""

from __future__ import annotations

import pytest

from coordinator.core.liveness import (
    PROBE_FRAMES,
    PROBE_OUTCOMES,
    ProbeKind,
    check_interval_s,
    probe_due,
    quiet_after_s,
    ranks_to_probe,
)
from coordinator.core.membership import EngineLease, RankState
from coordinator.protocol import vllm


def lease(rank: int, *, state: RankState = RankState.READY, connected: bool = True,
          last_seen: float = 0.0) -> EngineLease:
    return EngineLease(rank=rank, engine_id=None, state=state, registered_at=0.0,
                       last_seen=last_seen, dispatch_connected=connected, incarnation=1)


def test_the_probe_is_an_empty_abort() -> None:
    assert PROBE_FRAMES[0] == vllm.ABORT
    assert vllm.decode_abort(PROBE_FRAMES[1]) == []


def test_every_kind_and_answer_has_an_outcome() -> None:
    assert set(PROBE_OUTCOMES) == {(kind, ok) for kind in ProbeKind for ok in (True, False)}


@pytest.mark.parametrize(("ttl", "interval"), [(0.1, 0.05), (1.0, 0.25), (10.0, 1.0)])
def test_the_lease_timer_runs_four_times_per_ttl_within_bounds(ttl: float, interval: float) -> None:
    assert check_interval_s(ttl) == interval
    assert quiet_after_s(ttl) == pytest.approx(ttl / 3)


def test_only_quiet_greeted_live_leases_are_probed() -> None:
    leases = [
        lease(0, last_seen=0.0),
        lease(1, last_seen=9.0),  # spoke recently
        lease(2, connected=False),  # cannot be probed on dispatch
        lease(3, state=RankState.DEAD),
        lease(4, state=RankState.CORDONED),
        lease(5, state=RankState.HANDSHAKING),
    ]
    assert ranks_to_probe(leases, now=10.0, quiet_after=3.0) == [0, 4, 5]
    assert probe_due(lease(0, last_seen=7.0), 10.0, 3.0)  # exactly quiet_after
    assert not probe_due(lease(0, last_seen=7.5), 10.0, 3.0)
