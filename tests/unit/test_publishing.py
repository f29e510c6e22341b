"""Full-publish schedule: first publish, 100 ms while changed, 5 s heartbeat."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.dispatch.balancer import LoadTable
from coordinator.core.observe.publishing import PublishSchedule

EPS = 1e-9


def test_nothing_is_due_before_start() -> None:
    schedule = PublishSchedule()
    assert not schedule.started
    assert schedule.next_due(changed=True) == math.inf
    assert not schedule.due(1e9, changed=True)
    assert schedule.last_publish is None


def test_first_publish_comes_shortly_after_start_whether_or_not_changed() -> None:
    schedule = PublishSchedule()
    schedule.start(10.0)
    assert schedule.started
    for changed in (False, True):
        assert schedule.next_due(changed=changed) == pytest.approx(10.05)
        assert not schedule.due(10.04, changed=changed)
        assert schedule.due(10.05, changed=changed)


def test_changed_tables_publish_every_interval_else_heartbeat() -> None:
    schedule = PublishSchedule()
    schedule.start(0.0)
    schedule.published(0.05)
    assert schedule.last_publish == 0.05
    assert schedule.next_due(changed=True) == pytest.approx(0.15)
    assert schedule.next_due(changed=False) == pytest.approx(5.05)
    assert not schedule.due(0.149, changed=True)
    assert schedule.due(0.151, changed=True)
    assert not schedule.due(5.049, changed=False)
    assert schedule.due(5.051, changed=False)


def test_custom_intervals() -> None:
    schedule = PublishSchedule(min_interval_s=0.02, heartbeat_s=1.0, first_publish_delay_s=0.0)
    schedule.start(3.0)
    assert schedule.due(3.0, changed=False)
    schedule.published(3.0)
    assert schedule.next_due(changed=True) == pytest.approx(3.02)
    assert schedule.next_due(changed=False) == pytest.approx(4.0)


def test_a_publish_before_start_still_spaces_the_first_one() -> None:
    schedule = PublishSchedule()
    schedule.published(1.0)
    assert schedule.next_due(changed=True) == math.inf
    schedule.start(1.0)
    assert schedule.next_due(changed=True) == pytest.approx(1.1)  # not 1.05
    schedule.start(2.0)
    assert schedule.next_due(changed=True) == pytest.approx(2.05)


def test_restarting_awaits_a_new_first_publish() -> None:
    schedule = PublishSchedule()
    schedule.start(0.0)
    schedule.published(0.05)
    schedule.start(10.0)
    assert schedule.next_due(changed=False) == pytest.approx(10.05)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_interval_s": 0.0},
        {"min_interval_s": -1.0},
        {"min_interval_s": math.nan},
        {"heartbeat_s": 0.05},
        {"heartbeat_s": math.nan},
        {"heartbeat_s": math.inf},
        {"first_publish_delay_s": -0.01},
        {"first_publish_delay_s": math.nan},
        {"first_publish_delay_s": math.inf},
    ],
)
def test_bad_intervals_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PublishSchedule(**kwargs)


def test_busy_input_does_not_starve_publishing() -> None:
    # An engine message every 10 ms for 400 ms, always changing the table:
    # publishes still go out every 100-120 ms.
    schedule = PublishSchedule()
    table = LoadTable(2)
    schedule.start(0.0)
    published: list[tuple[float, list[tuple[int, int, float]]]] = []
    for tick in range(1, 41):
        now = tick * 0.010
        rank = tick % 2
        table.apply_stats(
            rank,
            waiting=0,
            running=5 + 2 * rank,
            kv_cache_usage=0.0,
            wave=0,
            step=0,
            lockstep=False,
        )
        if schedule.due(now, changed=table.changed):
            published.append((now, table.take_publish_rows()))
            schedule.published(now)
    times = [t for t, _ in published]
    assert times[0] == pytest.approx(0.05)
    assert len(times) >= 3
    for earlier, later in itertools.pairwise(times):
        assert 0.100 - EPS <= later - earlier <= 0.120
    assert published[-1][1] == [(0, 5, 0.0), (0, 7, 0.0)]


def test_previous_step_snapshot_goes_out_on_time_under_busy_input() -> None:
    # Lockstep: rank 0 and 1 report step 1, then rank 0 keeps reporting step 2
    # every 10 ms. The first publish carries the complete step-1 view.
    schedule = PublishSchedule()
    table = LoadTable(2)
    schedule.start(0.0)
    packets = [(0, 1, 1), (1, 1, 2)] + [(0, 2, 10)] * 38
    published: list[tuple[float, list[tuple[int, int, float]]]] = []
    for tick, (rank, step, running) in enumerate(packets, start=1):
        now = tick * 0.010
        table.apply_stats(
            rank,
            waiting=0,
            running=running,
            kv_cache_usage=0.0,
            wave=0,
            step=step,
            lockstep=True,
        )
        if schedule.due(now, changed=table.changed):
            published.append((now, table.take_publish_rows()))
            schedule.published(now)
    assert published[0][0] <= 0.120
    assert published[0][1] == [(0, 1, 0.0), (0, 2, 0.0)]
    assert published[1][1] == [(0, 10, 0.0), (0, 2, 0.0)]
    assert 0.100 - EPS <= published[1][0] - published[0][0] <= 0.120


def test_heartbeat_when_idle() -> None:
    schedule = PublishSchedule()
    schedule.start(0.0)
    times = []
    now = 0.0
    while now < 20.0:
        now = round(now + 0.25, 6)
        if schedule.due(now, changed=False):
            schedule.published(now)
            times.append(now)
    assert times == [0.25, 5.25, 10.25, 15.25]


# --- properties ---------------------------------------------------------------------

events = st.lists(
    st.tuples(st.floats(0.0, 0.4, allow_nan=False), st.booleans()),
    min_size=1,
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(events=events)
def test_publish_gaps_stay_within_bounds(events: list[tuple[float, bool]]) -> None:
    schedule = PublishSchedule(min_interval_s=0.1, heartbeat_s=1.0, first_publish_delay_s=0.05)
    start = 100.0
    schedule.start(start)
    now = start
    max_step = max(dt for dt, _ in events)
    times: list[float] = []
    for dt, changed in events:
        now += dt
        if schedule.due(now, changed=changed):
            schedule.published(now)
            times.append(now)
    if times:
        assert times[0] - start >= 0.05 - EPS
        assert times[0] - start <= 0.05 + max_step + EPS
    elif now - start > 0.05 + EPS:
        pytest.fail("the first publish never came")
    for earlier, later in itertools.pairwise(times):
        assert later - earlier >= 0.1 - EPS
        assert later - earlier <= 1.0 + max_step + EPS
    if times:
        assert now - times[-1] <= 1.0 + max_step + EPS


@settings(max_examples=200, deadline=None)
@given(
    published_at=st.lists(st.floats(0.0, 50.0), max_size=5),
    started_at=st.none() | st.floats(0.0, 50.0),
    now=st.floats(0.0, 60.0),
    changed=st.booleans(),
)
def test_due_and_next_due_agree(
    published_at: list[float], started_at: float | None, now: float, changed: bool
) -> None:
    schedule = PublishSchedule()
    if started_at is not None:
        schedule.start(started_at)
    for t in sorted(published_at):
        schedule.published(t)
    deadline = schedule.next_due(changed=changed)
    assert schedule.due(now, changed=changed) is (now >= deadline)
    if started_at is None:
        assert deadline == math.inf
    else:
        assert schedule.due(deadline, changed=changed)
        assert not schedule.due(math.nextafter(deadline, -math.inf), changed=changed)
