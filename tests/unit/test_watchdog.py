"""HangWatchdog driven one observation at a time, plus its pure rules and episode table."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.waves.watchdog import (
    ALERT_KINDS,
    EPISODE,
    NO_PROGRESS,
    WAVE_SPLIT,
    EpisodeStep,
    FreshWaves,
    HangWatchdog,
    RankReport,
    WatchdogAlert,
    describe_waves,
    fresh_waves,
    split_waves,
    stalled_since,
)

T = 10.0  # stall_after_s in these tests
RANKS = [0, 1, 2, 3]


def running_group(now: float = 0.0, wave: int = 0) -> HangWatchdog:
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_group(running=True, wave=wave, ranks=RANKS, now=now)
    return dog


def report_all(dog: HangWatchdog, *, wave: int, step: int, now: float,
               ranks: list[int] = RANKS) -> None:
    for rank in ranks:
        dog.observe_stats(rank, wave=wave, step=step, now=now)


# --- pure rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("running", "last", "now", "expected"), [
    (False, 0.0, 100.0, None),
    (True, None, 100.0, None),
    (True, 5.0, 14.9, None),
    (True, 5.0, 15.0, 5.0),
    (True, 5.0, 99.0, 5.0),
])
def test_stalled_since(running: bool, last: float | None, now: float,
                       expected: float | None) -> None:
    assert stalled_since(running=running, last_progress=last, now=now,
                         stall_after_s=T) == expected


def test_fresh_waves_keeps_recent_reports_of_watched_ranks() -> None:
    reports = {0: RankReport(3, 1, 95.0), 1: RankReport(4, 1, 90.0), 2: RankReport(5, 1, 99.0)}
    assert fresh_waves(reports, [0, 1, 2, 7], now=100.0, window_s=T) == {0: 3, 2: 5}
    assert fresh_waves(reports, [2], now=100.0, window_s=T) == {2: 5}


@pytest.mark.parametrize(("waves", "expected"), [
    ({}, None),
    ({0: 4}, None),
    ({0: 4, 1: 4, 2: 4}, None),
    ({0: 5, 1: 4, 2: 5, 3: 3}, (1, 3)),
])
def test_split_waves(waves: dict[int, int], expected: tuple[int, ...] | None) -> None:
    assert split_waves(waves) == expected


def test_describe_waves() -> None:
    assert describe_waves({3: 6, 0: 5, 1: 5}) == "wave 5: ranks 0,1; wave 6: ranks 3"


def test_episode_table_is_complete() -> None:
    assert set(EPISODE) == {(a, f) for a in (False, True) for f in (False, True)}
    assert EPISODE[(False, True)] is EpisodeStep.ALERT
    assert EPISODE[(True, True)] is EpisodeStep.ONGOING
    assert EPISODE[(True, False)] is EpisodeStep.CLEAR
    assert EPISODE[(False, False)] is EpisodeStep.QUIET


def test_stall_time_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        HangWatchdog(stall_after_s=0)


# --- no_progress ---------------------------------------------------------------------------------


def test_paused_group_never_alerts() -> None:
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_group(running=False, wave=0, ranks=RANKS, now=0.0)
    report_all(dog, wave=0, step=0, now=1.0)
    assert dog.check(1000.0) == []
    assert dog.active == []


def test_no_progress_fires_once_then_clears_on_a_step_and_fires_again() -> None:
    dog = running_group(now=0.0)
    report_all(dog, wave=0, step=1, now=1.0)
    assert dog.check(10.9) == []
    assert dog.last_progress_age(10.9) == pytest.approx(9.9)
    [alert] = dog.check(11.0)
    assert alert.kind == NO_PROGRESS
    assert alert.since == 1.0
    assert alert.ranks == (0, 1, 2, 3)
    assert "wave 0 is believed running but no rank has reported progress for 10.0 s" in (
        alert.message
    )
    assert "rank 2 at wave 0 step 1" in alert.message
    assert dog.active == [alert]
    assert dog.check(30.0) == []  # same episode: no repeat
    assert dog.active == [alert]
    dog.observe_stats(2, wave=0, step=1, now=31.0)  # same step again is not progress
    assert dog.active == [alert]
    dog.observe_stats(2, wave=0, step=2, now=32.0)  # a step clears at once
    assert dog.active == []
    assert dog.check(41.0) == []
    [again] = dog.check(42.0)
    assert again.since == 32.0
    assert dog.alerts_raised == {NO_PROGRESS: 2, WAVE_SPLIT: 0}


def test_running_starts_the_stall_clock_even_without_reports() -> None:
    dog = HangWatchdog(stall_after_s=T)
    assert dog.last_progress_age(5.0) is None
    dog.observe_group(running=False, wave=0, ranks=[0, 1], now=0.0)
    dog.observe_group(running=True, wave=0, ranks=[0, 1], now=50.0)
    assert dog.check(59.0) == []
    [alert] = dog.check(60.0)
    assert alert.since == 50.0
    assert "Last reports: none; never reported: ranks 0,1" in alert.message


def test_pausing_clears_no_progress() -> None:
    dog = running_group(now=0.0)
    assert [a.kind for a in dog.check(20.0)] == [NO_PROGRESS]
    dog.observe_group(running=False, wave=1, ranks=RANKS, now=21.0)
    assert dog.active == []
    assert dog.check(100.0) == []


def test_a_new_wave_counts_as_progress() -> None:
    dog = running_group(now=0.0, wave=4)
    dog.observe_group(running=True, wave=4, ranks=RANKS, now=9.0)  # same state: no progress
    dog.observe_group(running=True, wave=5, ranks=RANKS, now=9.5)
    assert dog.check(19.0) == []
    assert [a.since for a in dog.check(19.5)] == [9.5]


def test_reports_from_ranks_outside_the_group_are_not_progress() -> None:
    dog = running_group(now=0.0)
    dog.observe_stats(9, wave=0, step=1, now=5.0)
    dog.observe_stats(9, wave=0, step=2, now=9.0)
    assert [a.since for a in dog.check(10.0)] == [0.0]


def test_report_age_counts_every_report_even_without_progress() -> None:
    dog = HangWatchdog(stall_after_s=T)
    assert dog.report_age(0, 5.0) is None
    dog.observe_stats(0, wave=0, step=1, now=1.0)
    dog.observe_stats(0, wave=0, step=1, now=3.0)
    assert dog.report_age(0, 5.0) == 2.0
    assert dog.last_progress_age(5.0) == 4.0


def test_without_group_membership_every_reporting_rank_is_watched() -> None:
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_stats(7, wave=2, step=1, now=0.0)
    dog.observe_stats(8, wave=2, step=1, now=0.0)
    assert dog.check(50.0) == []  # never told the group runs
    assert dog.last_progress_age(50.0) == 50.0


# --- wave_split ----------------------------------------------------------------------------------


def test_wave_split_fires_after_the_stall_time_and_names_the_laggards() -> None:
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_group(running=False, wave=5, ranks=RANKS, now=0.0)
    for now in (0.0, 5.0, 9.0, 12.0, 16.0):
        report_all(dog, wave=6, step=int(now), now=now, ranks=[0, 1, 2])
        dog.observe_stats(3, wave=5, step=int(now), now=now)
    assert dog.check(9.9) == []
    [alert] = dog.check(16.0)
    assert alert == WatchdogAlert(
        WAVE_SPLIT, 0.0,
        "ranks have reported different waves for 16.0 s (limit 10 s): wave 5: ranks 3; "
        "wave 6: ranks 0,1,2; ranks 3 may have missed a START_DP_WAVE",
        (3,),
    )
    assert alert.as_dict(17.0) == {"kind": WAVE_SPLIT, "since": 0.0, "message": alert.message,
                                   "ranks": [3], "for_s": 17.0}
    assert "for_s" not in alert.as_dict()
    assert dog.check(17.0) == []
    dog.observe_stats(3, wave=6, step=17, now=18.0)  # the laggard catches up
    assert dog.active == []
    assert dog.check(40.0) == []


def test_a_brief_split_at_a_wave_boundary_is_normal() -> None:
    dog = running_group(now=0.0, wave=5)
    report_all(dog, wave=5, step=3, now=1.0)
    dog.observe_stats(0, wave=6, step=0, now=2.0)
    dog.observe_stats(1, wave=6, step=0, now=2.001)
    report_all(dog, wave=6, step=0, now=2.002, ranks=[2, 3])
    dog.observe_group(running=True, wave=6, ranks=RANKS, now=2.003)
    assert dog.check(11.9) == []


def test_a_rank_that_went_quiet_does_not_keep_a_split_alive() -> None:
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_group(running=False, wave=6, ranks=[0, 1], now=0.0)
    dog.observe_stats(1, wave=5, step=9, now=0.0)  # then idle: it sends nothing more
    dog.observe_stats(0, wave=6, step=0, now=1.0)
    for now in (4.0, 8.0, 12.0):
        dog.observe_stats(0, wave=6, step=int(now), now=now)
    assert dog.check(12.0) == []  # rank 1's report left the window at t=10


def test_wave_split_clears_when_the_laggard_goes_quiet() -> None:
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_group(running=False, wave=6, ranks=[0, 1], now=0.0)
    dog.observe_stats(1, wave=5, step=1, now=0.0)
    dog.observe_stats(0, wave=6, step=1, now=0.0)
    dog.observe_stats(1, wave=5, step=2, now=9.0)
    dog.observe_stats(0, wave=6, step=2, now=9.0)
    assert [a.kind for a in dog.check(10.0)] == [WAVE_SPLIT]
    dog.observe_stats(0, wave=6, step=3, now=19.5)  # rank 1 has been quiet since 9.0
    assert dog.active == []
    dog.observe_stats(1, wave=5, step=3, now=20.0)  # back, still behind: a new episode
    dog.observe_stats(1, wave=5, step=4, now=25.0)
    dog.observe_stats(0, wave=6, step=4, now=29.0)
    assert dog.check(29.9) == []
    assert [a.since for a in dog.check(30.0)] == [20.0]


def test_wave_split_clears_at_check_when_reports_age_out() -> None:
    dog = HangWatchdog(stall_after_s=T)
    report_all(dog, wave=1, step=1, now=0.0, ranks=[0])
    report_all(dog, wave=2, step=1, now=0.0, ranks=[1])
    assert [a.ranks for a in dog.check(10.0)] == []  # both reports just left the window
    dog.observe_stats(0, wave=1, step=2, now=10.0)
    dog.observe_stats(1, wave=2, step=2, now=10.0)
    dog.observe_stats(0, wave=1, step=3, now=19.0)
    dog.observe_stats(1, wave=2, step=3, now=19.0)
    assert [a.ranks for a in dog.check(20.0)] == [(0,)]
    assert dog.check(29.5) == []
    assert dog.active == []


def test_membership_change_can_end_a_split() -> None:
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_group(running=False, wave=3, ranks=[0, 1], now=0.0)
    for now in (0.0, 5.0, 9.0):
        dog.observe_stats(0, wave=3, step=int(now), now=now)
        dog.observe_stats(1, wave=2, step=int(now), now=now)
    assert [a.kind for a in dog.check(10.0)] == [WAVE_SPLIT]
    dog.observe_group(running=False, wave=3, ranks=[0], now=10.5)  # rank 1 cordoned away
    assert dog.active == []


def test_both_conditions_at_once_in_kind_order() -> None:
    dog = running_group(now=0.0, wave=2)
    report_all(dog, wave=2, step=1, now=0.0, ranks=[0, 1])
    report_all(dog, wave=1, step=1, now=0.0, ranks=[2, 3])
    for rank in RANKS:  # keep reporting, but never step
        dog.observe_stats(rank, wave=2 if rank < 2 else 1, step=1, now=9.0)
    alerts = dog.check(10.0)
    assert [a.kind for a in alerts] == list(ALERT_KINDS)
    assert [a.kind for a in dog.active] == [NO_PROGRESS, WAVE_SPLIT]


# --- properties ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(gaps=st.lists(st.tuples(st.floats(min_value=0.1, max_value=25.0), st.booleans()),
                     min_size=1, max_size=40))
def test_no_progress_alerts_once_per_stall_episode(gaps: list[tuple[float, bool]]) -> None:
    """Steps arrive after random gaps; each gap >= T is exactly one episode and one alert."""
    dog = running_group(now=0.0)
    now = 0.0
    alerts = 0
    expected = 0
    for step, (gap, checked_twice) in enumerate(gaps, start=1):
        probes = [now + gap / 2, now + gap] if checked_twice else [now + gap]
        for probe in probes:
            alerts += len(dog.check(probe))
            stalled = probe - now >= T
            assert [a.kind for a in dog.active] == ([NO_PROGRESS] if stalled else [])
        expected += (now + gap) - now >= T
        now += gap
        dog.observe_stats(0, wave=0, step=step, now=now)
        assert dog.active == []
    assert alerts == expected
    assert dog.alerts_raised[NO_PROGRESS] == expected


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["split", "heal", "wait"]),
                                 st.floats(min_value=0.5, max_value=15.0)),
                       min_size=1, max_size=30))
def test_wave_split_alerts_once_per_split_episode(events: list[tuple[str, float]]) -> None:
    """Two ranks report every second; rank 1 is on another wave while 'split'."""
    dog = HangWatchdog(stall_after_s=T)
    dog.observe_group(running=False, wave=0, ranks=[0, 1], now=0.0)
    now = 0.0
    split = False
    split_since: float | None = None
    alerted = False
    episodes = 0
    alerts = 0
    for kind, duration in events:
        if kind != "wait":
            split = kind == "split"
        end = now + duration
        while now < end:
            now = min(end, now + 1.0)
            dog.observe_stats(0, wave=0, step=int(now * 10), now=now)
            dog.observe_stats(1, wave=1 if split else 0, step=int(now * 10), now=now)
            if not split:
                split_since, alerted = None, False
            elif split_since is None:
                split_since = now
            alerts += len(dog.check(now))
            firing = split_since is not None and now - split_since >= T
            if firing and not alerted:
                episodes += 1
                alerted = True
            assert [a.kind for a in dog.active] == ([WAVE_SPLIT] if firing else [])
    assert alerts == episodes
    assert dog.alerts_raised[WAVE_SPLIT] == episodes


@settings(max_examples=500, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("report"), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("report"), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("wait"), st.floats(min_value=0.0, max_value=2.0)),
    st.tuples(st.just("wait"), st.floats(min_value=0.0, max_value=2.0)),
    st.tuples(st.just("back"), st.floats(min_value=0.0, max_value=3.0)),
    st.tuples(st.just("members"), st.sets(st.integers(0, 3))),
), max_size=80))
def test_the_incremental_split_is_the_pass_over_every_rank(ops: list[tuple[Any, ...]]) -> None:
    """FreshWaves (per report, O(1)) against split_waves(fresh_waves(...)) (every rank).

    Time mostly moves on, now and then jumps back, which makes it start over.
    """
    window = 3.0
    reports: dict[int, RankReport] = {}
    members: set[int] | None = None
    fresh = FreshWaves(window)
    now = 0.0

    def rebuilt() -> FreshWaves:
        watched = members if members is not None else reports
        return FreshWaves.build(reports, watched, now=now, window_s=window)

    for op in ops:
        if op[0] == "members":
            members = set(op[1])
            fresh = rebuilt()
        elif op[0] == "report":
            _, rank, wave = op
            reports[rank] = RankReport(wave, 0, now)
            watched = members is None or rank in members
            if not fresh.report(rank, wave, now=now, watched=watched):
                fresh = rebuilt()
        elif op[0] == "wait":
            now += op[1]
        else:
            now = max(0.0, now - op[1])
        if not fresh.expire(now):
            fresh = rebuilt()
        watched_ranks = sorted(members) if members is not None else sorted(reports)
        want = split_waves(fresh_waves(reports, watched_ranks, now=now, window_s=window))
        assert fresh.split == (want is not None)


def test_a_rank_that_reports_again_stays_in_the_window_longer() -> None:
    fresh = FreshWaves(3.0)
    fresh.report(0, 0, now=0.0, watched=True)
    fresh.report(1, 1, now=1.0, watched=True)
    fresh.report(0, 0, now=2.5, watched=True)  # the same wave again, later
    assert fresh.expire(2.9) and fresh.split
    assert fresh.expire(4.0) and not fresh.split  # rank 1 left the window, rank 0 did not
    assert not fresh.report(2, 1, now=3.5, watched=True)  # time went back: start over


def test_a_wave_change_across_many_ranks_costs_each_report_little() -> None:
    """1,024 ranks moving to the next wave: the split is told per report, not per rank."""
    dog = HangWatchdog(stall_after_s=T)
    ranks = list(range(1024))
    dog.observe_group(running=False, wave=0, ranks=ranks, now=0.0)
    report_all(dog, wave=0, step=1, now=1.0, ranks=ranks)
    for rank in ranks[:-1]:
        dog.observe_stats(rank, wave=1, step=0, now=2.0)
    for now in (6.0, 10.0):  # the laggard keeps reporting the old wave
        dog.observe_stats(1023, wave=0, step=1, now=now)
        dog.observe_stats(0, wave=1, step=int(now), now=now)
    assert dog.check(2.0) == [] and dog.check(11.9) == []
    [alert] = dog.check(12.0)
    assert alert.kind == WAVE_SPLIT and alert.ranks == (1023,)
    dog.observe_stats(1023, wave=1, step=0, now=12.5)
    assert dog.active == []
