"""When engines are probed, what a probe's answer means, and what a pause of our own means."""

from __future__ import annotations

import pytest

from coordinator.core.ranks.liveness import (
    HOLDER_PROBE_OUTCOMES,
    PAUSE_CREDIT_S,
    PROBE_FRAMES,
    PROBE_OUTCOMES,
    LeaseCondition,
    ProbeAnswer,
    ProbeEffect,
    answer_of,
    check_interval_s,
    condition,
    heard_within_s,
    heartbeat_ivl_s,
    heartbeat_timeout_s,
    pause_of,
    probe_due,
    quiet_after_s,
    ranks_to_probe,
    silent_after_s,
)
from coordinator.core.ranks.membership import EngineLease, RankState
from coordinator.protocol import vllm


def lease(rank: int, *, state: RankState = RankState.READY, connected: bool = True,
          last_seen: float = 0.0, **facts: object) -> EngineLease:
    return EngineLease(rank=rank, engine_id=None, state=state, registered_at=0.0,
                       last_seen=last_seen, dispatch_connected=connected, incarnation=1,
                       **facts)  # type: ignore[arg-type]


def test_the_probe_is_an_empty_abort() -> None:
    assert PROBE_FRAMES[0] == vllm.ABORT
    assert vllm.decode_abort(PROBE_FRAMES[1]) == []


def test_every_condition_and_answer_has_an_outcome() -> None:
    assert set(PROBE_OUTCOMES) == {(c, a) for c in LeaseCondition for a in ProbeAnswer}
    assert set(HOLDER_PROBE_OUTCOMES) == set(ProbeAnswer)


def test_what_each_answer_does() -> None:
    C, A, E = LeaseCondition, ProbeAnswer, ProbeEffect
    # A missed probe kills only a lease nothing else vouches for.
    assert PROBE_OUTCOMES[C.QUIET, A.MISSED] is E.DISCONNECT
    assert PROBE_OUTCOMES[C.HEARD, A.MISSED] is E.UNREACHABLE
    # An open connection that carried nothing lately is no evidence of life.
    assert PROBE_OUTCOMES[C.QUIET, A.SILENT] is E.STALE
    assert PROBE_OUTCOMES[C.HEARD, A.SILENT] is E.STALE
    assert PROBE_OUTCOMES[C.QUIET, A.HEARD] is E.RENEW
    # Only an engine really heard revives a dead rank.
    assert PROBE_OUTCOMES[C.REVIVABLE, A.HEARD] is E.REVIVE
    assert PROBE_OUTCOMES[C.REVIVABLE, A.SILENT] is E.NOTHING
    assert PROBE_OUTCOMES[C.REVIVABLE, A.MISSED] is E.NOTHING
    assert {PROBE_OUTCOMES[C.FINAL, a] for a in A} == {E.NOTHING}
    # A HELLO takes over from a holder that is not heard.
    assert HOLDER_PROBE_OUTCOMES[A.HEARD] is E.REFUSE_HELLO
    assert HOLDER_PROBE_OUTCOMES[A.SILENT] is HOLDER_PROBE_OUTCOMES[A.MISSED] is E.TAKE_OVER


def test_what_a_probe_found() -> None:
    assert answer_of(False, None, 1.5) is ProbeAnswer.MISSED
    assert answer_of(True, None, 1.5) is ProbeAnswer.HEARD  # not measurable: heartbeats
    assert answer_of(True, 1.5, 1.5) is ProbeAnswer.HEARD
    assert answer_of(True, 1.51, 1.5) is ProbeAnswer.SILENT


def test_a_leases_condition_when_its_probe_answers() -> None:
    assert condition(lease(0, last_seen=6.0), 10.0, 4.0) is LeaseCondition.QUIET
    assert condition(lease(0, last_seen=6.5), 10.0, 4.0) is LeaseCondition.HEARD
    dead = lease(0, state=RankState.DEAD, died_from=RankState.READY)
    assert condition(dead, 10.0, 4.0) is LeaseCondition.REVIVABLE
    assert condition(lease(0, state=RankState.DEAD), 10.0, 4.0) is LeaseCondition.FINAL


@pytest.mark.parametrize("ttl", [0.3, 0.6, 3.0, 10.0, 60.0])
def test_an_open_connection_vouches_for_well_under_a_ttl(ttl: float) -> None:
    # A probe renews a lease to `now - heard_within`: that must stay well inside the
    # TTL, or idle engines (which only answer heartbeats) would expire.
    assert heartbeat_ivl_s(ttl) < heartbeat_timeout_s(ttl)
    assert heard_within_s(ttl) == heartbeat_ivl_s(ttl) + heartbeat_timeout_s(ttl)
    assert heard_within_s(ttl) + check_interval_s(ttl) < ttl
    # Silent (two pings unanswered) well before a probe is even due.
    assert silent_after_s(ttl) <= quiet_after_s(ttl)


def test_only_a_tick_a_second_late_or_more_is_a_pause() -> None:
    assert pause_of(due=10.0, now=10.9) == 0.0
    assert pause_of(due=10.0, now=10.0 + PAUSE_CREDIT_S) == PAUSE_CREDIT_S
    assert pause_of(due=10.0, now=30.0) == 20.0


@pytest.mark.parametrize(("ttl", "interval"), [(0.1, 0.05), (1.0, 0.25), (10.0, 1.0)])
def test_the_lease_timer_runs_four_times_per_ttl_within_bounds(ttl: float, interval: float) -> None:
    assert check_interval_s(ttl) == interval
    assert quiet_after_s(ttl) == pytest.approx(ttl / 3)


def test_quiet_lost_and_revivable_greeted_leases_are_probed() -> None:
    leases = [
        lease(0, last_seen=0.0),
        lease(1, last_seen=9.0),  # spoke recently
        lease(2, connected=False),  # cannot be probed on dispatch
        lease(3, state=RankState.DEAD),  # died for good
        lease(4, state=RankState.CORDONED),
        lease(5, state=RankState.HANDSHAKING),
        lease(6, last_seen=9.0, dispatch_lost=True),  # its connection dropped
        lease(7, state=RankState.DEAD, died_from=RankState.READY),  # may come back
        lease(8, last_seen=0.0, dispatch_claimed_by=12),  # a probe would ask someone else
    ]
    assert ranks_to_probe(leases, now=10.0, quiet_after=3.0) == [0, 4, 5, 6, 7]
    assert probe_due(lease(0, last_seen=7.0), 10.0, 3.0)  # exactly quiet_after
    assert not probe_due(lease(0, last_seen=7.5), 10.0, 3.0)
