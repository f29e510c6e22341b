"""Load table, engine scoring and the balance policies."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.dispatch.balancer import (
    POLICIES,
    BalancePolicy,
    LeastLoaded,
    LoadTable,
    PowerOfTwoChoices,
    RankLoad,
    StatsOutcome,
    balance_ratio,
    is_stale_report,
    load_score,
    make_policy,
)
from coordinator.core.dispatch.prefix_rule import pick_least_loaded_sticky


def report(
    table: LoadTable,
    rank: int,
    *,
    step: int,
    running: int = 0,
    waiting: int = 0,
    kv: float = 0.0,
    wave: int = 0,
    lockstep: bool = True,
) -> StatsOutcome:
    return table.apply_stats(
        rank,
        waiting=waiting,
        running=running,
        kv_cache_usage=kv,
        wave=wave,
        step=step,
        lockstep=lockstep,
    )


def table_with(*loads: tuple[int, int, float]) -> LoadTable:
    table = LoadTable(len(loads))
    for rank, (waiting, running, kv) in enumerate(loads):
        report(table, rank, step=1, waiting=waiting, running=running, kv=kv, lockstep=False)
    return table


# --- staleness (PR 52936 semantics) -------------------------------------------------


@pytest.mark.parametrize(
    ("last", "wave", "step", "stale"),
    [
        (None, 1, 10, False),  # first report from this engine
        ((1, 10), 1, 11, False),  # next step
        ((1, 10), 1, 10, False),  # same step again
        ((1, 100), 2, 0, False),  # new wave restarts the step count
        ((1, 10), 1, 9, True),  # same wave, step went back
        ((2, 0), 1, 100, True),  # wave went back
    ],
)
def test_is_stale_report(last: tuple[int, int] | None, wave: int, step: int, stale: bool) -> None:
    assert is_stale_report(last, wave, step) is stale


def test_delayed_report_from_another_engine_is_not_stale() -> None:
    table = LoadTable(2)
    report(table, 0, wave=1, step=11)
    outcome = report(table, 1, wave=1, step=10)
    assert outcome == StatsOutcome(applied=True, stale=False, snapshot_taken=False)


def test_stale_report_is_flagged_but_applied_and_moves_the_engine_mark() -> None:
    table = LoadTable(1)
    report(table, 0, wave=3, step=50, running=9)
    outcome = report(table, 0, wave=3, step=2, running=1, waiting=4, kv=0.25)
    assert outcome.applied and outcome.stale
    assert table.rows() == [(4, 1, 0.25)]
    assert table.load(0).last_step == (3, 2)
    # The mark followed the restarted counter, so the next step is fresh again.
    assert not report(table, 0, wave=3, step=3).stale


# --- applying reports --------------------------------------------------------------


def test_apply_stats_sets_the_row_and_resets_dispatches() -> None:
    table = LoadTable(2)
    table.note_dispatched(1, 3)
    changed_before = table.changed
    outcome = report(table, 1, wave=2, step=7, waiting=5, running=6, kv=0.75)
    assert outcome == StatsOutcome(applied=True, stale=False, snapshot_taken=False)
    assert (changed_before, table.changed) == (False, True)
    assert table.rows() == [(0, 0, 0.0), (5, 6, 0.75)]
    assert table.load(1) == RankLoad(
        waiting=5,
        running=6,
        kv_cache_usage=0.75,
        dispatched_since_report=0,
        last_step=(2, 7),
        reports=1,
    )
    report(table, 1, wave=2, step=8)
    assert table.load(1).reports == 2


@pytest.mark.parametrize("rank", [-1, 2, 65535])
def test_reports_for_ranks_outside_the_table_change_nothing(rank: int) -> None:
    table = LoadTable(2)
    outcome = report(table, rank, step=1, waiting=8, running=8, kv=1.0)
    assert outcome == StatsOutcome(applied=False, stale=False, snapshot_taken=False)
    assert not table.changed
    assert table.rows() == [(0, 0, 0.0), (0, 0, 0.0)]
    assert table.step_mark is None


def test_note_dispatched_accumulates_and_ignores_unknown_ranks() -> None:
    table = LoadTable(2)
    table.note_dispatched(0)
    table.note_dispatched(0, 2)
    table.note_dispatched(-1)
    table.note_dispatched(2)
    assert [table.load(r).dispatched_since_report for r in (0, 1)] == [3, 0]
    assert not table.changed  # dispatches are not reported counts; nothing to publish


@pytest.mark.parametrize("rank", [-1, 2])
def test_load_outside_the_table_raises(rank: int) -> None:
    with pytest.raises(IndexError, match="outside the load table"):
        LoadTable(2).load(rank)


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        LoadTable(-1)
    with pytest.raises(ValueError):
        LoadTable(1).resize(-1)


def test_resize_grows_with_empty_rows_and_truncates() -> None:
    table = LoadTable(2)
    report(table, 1, step=1, waiting=1, running=2, kv=0.5)
    table.take_publish_rows()
    table.resize(2)
    changed_by_same_size = table.changed  # same size: nothing new to tell front-ends
    table.resize(4)
    assert (changed_by_same_size, table.changed) == (False, True)
    assert table.size == 4
    assert table.rows() == [(0, 0, 0.0), (1, 2, 0.5), (0, 0, 0.0), (0, 0, 0.0)]
    assert table.take_publish_rows() == table.rows()
    table.resize(1)
    assert table.rows() == [(0, 0, 0.0)]
    assert table.changed
    assert not report(table, 1, step=2).applied


def test_resize_drops_a_snapshot_of_the_old_size() -> None:
    table = LoadTable(2)
    report(table, 0, step=1, running=1)
    assert report(table, 0, step=2, running=2).snapshot_taken
    table.resize(3)
    assert not table.snapshot_pending
    assert table.take_publish_rows() == [(0, 2, 0.0), (0, 0, 0.0), (0, 0, 0.0)]


# --- lockstep step snapshots -------------------------------------------------------


def test_previous_step_is_published_first_then_current_rows() -> None:
    # Rank 0 reports step 1, rank 1 reports step 1, then rank 0 runs ahead to
    # step 2 and keeps reporting it while rank 1 has not reported step 2 yet.
    table = LoadTable(2)
    assert not report(table, 0, step=1, running=1).snapshot_taken  # nothing unpublished yet
    assert not report(table, 1, step=1, running=2).snapshot_taken  # same step
    assert report(table, 0, step=2, running=10).snapshot_taken
    for _ in range(5):
        assert not report(table, 0, step=2, running=10).snapshot_taken
    assert table.step_mark == (0, 2)

    assert table.take_publish_rows() == [(0, 1, 0.0), (0, 2, 0.0)]
    assert table.changed  # current rows still owed
    assert table.take_publish_rows() == [(0, 10, 0.0), (0, 2, 0.0)]
    assert not table.changed


def test_snapshot_is_kept_while_a_slower_rank_has_not_reported_the_next_step() -> None:
    table = LoadTable(2)
    report(table, 0, step=1, running=1)
    report(table, 1, step=1, running=2)
    report(table, 0, step=2, running=10)
    # The slower rank catches up with step 2: still the same step, no new snapshot.
    assert not report(table, 1, step=2, running=20).snapshot_taken
    assert table.take_publish_rows() == [(0, 1, 0.0), (0, 2, 0.0)]
    # Step 3 from rank 0 freezes the complete step-2 view.
    assert report(table, 0, step=3, running=30).snapshot_taken
    assert table.take_publish_rows() == [(0, 10, 0.0), (0, 20, 0.0)]
    assert table.take_publish_rows() == [(0, 30, 0.0), (0, 20, 0.0)]
    assert not table.changed


def test_a_newer_step_replaces_an_unpublished_snapshot() -> None:
    table = LoadTable(1)
    report(table, 0, step=1, running=1)
    report(table, 0, step=2, running=2)
    report(table, 0, step=3, running=3)
    assert table.take_publish_rows() == [(0, 2, 0.0)]
    assert table.take_publish_rows() == [(0, 3, 0.0)]


def test_no_snapshot_when_everything_was_published() -> None:
    table = LoadTable(1)
    report(table, 0, step=1, running=1)
    table.take_publish_rows()
    assert not report(table, 0, step=2, running=2).snapshot_taken
    assert not table.snapshot_pending


def test_new_wave_counts_as_a_newer_step_and_older_marks_do_not_move_it() -> None:
    table = LoadTable(2)
    report(table, 0, wave=1, step=100, running=1)
    assert report(table, 1, wave=2, step=0, running=2).snapshot_taken
    assert table.step_mark == (2, 0)
    outcome = report(table, 0, wave=1, step=101, running=3)  # behind the mark, own mark fresh
    assert outcome == StatsOutcome(applied=True, stale=False, snapshot_taken=False)
    assert table.step_mark == (2, 0)


def test_dense_mode_takes_no_snapshots() -> None:
    table = LoadTable(1)
    report(table, 0, step=1, running=1, lockstep=False)
    assert not report(table, 0, step=2, running=2, lockstep=False).snapshot_taken
    assert table.step_mark is None
    assert table.take_publish_rows() == [(0, 2, 0.0)]
    assert not table.changed


# --- scoring ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("load", "score"),
    [
        (RankLoad(), 0.0),
        (RankLoad(running=3), 3.0),
        # Waiting work with a KV cache at most half full: no penalty.
        (RankLoad(waiting=4, running=1, kv_cache_usage=0.5), 5.0),
        # Waiting work under KV pressure: waiting * 6 * (kv - 0.5) on top.
        (RankLoad(waiting=4, running=1, kv_cache_usage=0.75), 5.0 + 4 * 6.0 * 0.25),
        # Nothing waiting: a full cache alone adds nothing.
        (RankLoad(running=2, kv_cache_usage=1.0), 2.0),
        # Dispatches since the report count as waiting, penalty included.
        (RankLoad(dispatched_since_report=2, kv_cache_usage=1.0), 2.0 + 2 * 6.0 * 0.5),
        (RankLoad(waiting=1, dispatched_since_report=1, running=1), 3.0),
    ],
)
def test_load_score(load: RankLoad, score: float) -> None:
    assert load_score(load) == pytest.approx(score)


# --- picking ------------------------------------------------------------------------


def pick(table: LoadTable, candidates: list[int] | range) -> int | None:
    """A fresh least-loaded policy's pick: the lowest score, ties to the lowest rank id."""
    return LeastLoaded().pick(table, candidates)


def test_least_loaded_takes_the_lowest_score() -> None:
    table = table_with((0, 5, 0.0), (0, 2, 0.0), (3, 0, 0.9), (0, 3, 0.0))
    assert [table.score(rank) for rank in range(4)] == [
        load_score(table.load(rank)) for rank in range(4)]
    assert pick(table, [0, 1, 2, 3]) == 1
    assert pick(table, [0, 2, 3]) == 3
    assert pick(table, [3, 2, 0]) == 3
    assert pick(table, []) is None


def test_candidates_without_a_row_are_skipped() -> None:
    table = table_with((0, 4, 0.0), (0, 1, 0.0))
    assert pick(table, [7, 0, -1]) == 0
    assert pick(table, [7, 8]) is None
    assert LeastLoaded().pick(table, [9]) is None
    assert PowerOfTwoChoices(random.Random(0)).pick(table, [9]) is None


def test_ties_go_to_the_rank_that_got_the_fewest_recent_picks_then_the_lowest_id() -> None:
    table = LoadTable(4)
    policy = LeastLoaded()
    # An idle group that never reports: every score stays 0, so only the tie rule decides.
    assert [policy.pick(table, [3, 1, 2]) for _ in range(6)] == [1, 2, 3, 1, 2, 3]
    assert policy.recent.counts([1, 2, 3]) == [2, 2, 2]
    # Rank 0 got nothing recently, so it wins the next tie wherever it stands.
    assert policy.pick(table, [3, 2, 1, 0]) == 0


def test_ties_prefer_the_sessions_last_rank_over_spreading() -> None:
    table = LoadTable(3)
    policy = LeastLoaded()
    assert [policy.pick(table, [0, 1, 2], session_rank=2) for _ in range(4)] == [2, 2, 2, 2]
    # A session rank that is not among the lowest scores does not win.
    table.note_dispatched(2)
    assert policy.pick(table, [0, 1, 2], session_rank=2) == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3), st.none() | st.integers(0, 7)),
                max_size=40),
       st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_least_loaded_picks_what_the_sticky_rule_says(
        steps: list[tuple[int, int, int | None]], waiting: list[int]) -> None:
    """The policy's fast tie path decides as routing.pick_least_loaded_sticky does."""
    table = LoadTable(8)
    for rank, count in enumerate(waiting):
        table.note_dispatched(rank, count)
    policy = LeastLoaded()
    for first, span, session in steps:
        candidates = list(range(first, min(8, first + span + 1)))[::-1]
        scores = [table.score(rank) for rank in candidates]
        want = pick_least_loaded_sticky(scores, candidates, session_rank=session,
                                        recent=policy.recent.counts(candidates))
        assert want is not None
        assert policy.pick(table, candidates, session_rank=session) == want[0]


@pytest.mark.parametrize("engines", [1, 2, 3, 8])
def test_the_tie_rule_shares_an_idle_group_evenly(engines: int) -> None:
    table = LoadTable(engines)
    policy = LeastLoaded()
    rounds = 7
    picks = Counter(policy.pick(table, range(engines)) for _ in range(engines * rounds))
    assert picks == {rank: rounds for rank in range(engines)}


def test_the_pick_does_not_depend_on_the_candidates_order() -> None:
    orders = [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]]
    picks = []
    for order in orders:
        table = LoadTable(4)
        policy = LeastLoaded()
        picks.append([policy.pick(table, order) for _ in range(8)])
    assert picks[0] == picks[1] == picks[2] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_dispatches_since_report_steer_consecutive_picks() -> None:
    table = table_with((0, 0, 0.0), (0, 2, 0.0), (0, 0, 0.0))
    policy = LeastLoaded()
    picks = []
    for _ in range(6):
        chosen = policy.pick(table, [0, 1, 2])
        assert chosen is not None
        table.note_dispatched(chosen)
        picks.append(chosen)
    assert picks == [0, 2, 0, 2, 1, 0]
    # Without counting dispatches, a fresh policy would send every one to rank 0.
    untouched = table_with((0, 0, 0.0), (0, 2, 0.0), (0, 0, 0.0))
    assert {pick(untouched, [0, 1, 2]) for _ in range(6)} == {0}


def test_a_report_replaces_the_dispatch_estimate() -> None:
    table = table_with((0, 0, 0.0), (0, 1, 0.0))
    table.note_dispatched(0, 5)
    assert pick(table, [0, 1]) == 1
    report(table, 0, step=2, running=0, lockstep=False)  # engine 0 finished them all
    assert pick(table, [0, 1]) == 0


def test_p2c_with_two_candidates_always_takes_the_lower() -> None:
    table = table_with((0, 3, 0.0), (0, 1, 0.0))
    policy = PowerOfTwoChoices(random.Random(1))
    assert {policy.pick(table, [0, 1]) for _ in range(50)} == {1}
    assert policy.pick(table, []) is None
    assert policy.pick(table, [0]) == 0


def test_p2c_breaks_ties_by_the_same_rule() -> None:
    table = LoadTable(2)
    policy = PowerOfTwoChoices(random.Random(7))
    assert [policy.pick(table, [0, 1]) for _ in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [policy.pick(table, [0, 1], session_rank=1) for _ in range(3)] == [1, 1, 1]


def test_p2c_never_picks_the_worst_and_favours_the_best() -> None:
    table = table_with((0, 1, 0.0), (0, 2, 0.0), (0, 3, 0.0), (0, 4, 0.0))
    policy = PowerOfTwoChoices(random.Random(3))
    picks = Counter(policy.pick(table, [0, 1, 2, 3]) for _ in range(1200))
    assert 3 not in picks
    # Rank r wins exactly the pairs with a worse rank: 3, 2 and 1 of the 6 pairs.
    assert picks[0] > picks[1] > picks[2] > 0
    assert picks[0] == pytest.approx(600, rel=0.15)


def test_p2c_is_reproducible_and_uses_only_the_injected_rng() -> None:
    table = table_with(*[(0, r % 3, 0.0) for r in range(10)])
    random.seed(1234)
    global_state = random.getstate()
    first = [PowerOfTwoChoices(random.Random(5)).pick(table, range(10)) for _ in range(20)]
    policy_a, policy_b = PowerOfTwoChoices(random.Random(5)), PowerOfTwoChoices(random.Random(5))
    run_a = [policy_a.pick(table, range(10)) for _ in range(100)]
    run_b = [policy_b.pick(table, range(10)) for _ in range(100)]
    assert run_a == run_b
    assert len(set(first)) == 1  # a fresh policy with the same seed makes the same first pick
    assert random.getstate() == global_state


def test_p2c_falls_back_to_a_scan_when_a_sample_has_no_row() -> None:
    table = table_with((0, 4, 0.0), (0, 1, 0.0))
    policy = PowerOfTwoChoices(random.Random(0))
    assert {policy.pick(table, [0, 9]) for _ in range(20)} == {0}
    assert {policy.pick(table, [8, 9, 1]) for _ in range(20)} == {1}
    assert policy.pick(table, [8, 9]) is None


def test_policy_registry() -> None:
    assert set(POLICIES) == {"least-loaded", "p2c"}
    rng = random.Random(0)
    for name in POLICIES:
        policy: BalancePolicy = make_policy(name, rng)
        assert policy.name == name
        assert POLICIES[name](rng).name == name
        assert policy.pick(LoadTable(3), [0, 1, 2]) in {0, 1, 2}
    with pytest.raises(ValueError, match="least-loaded, p2c"):
        make_policy("random", rng)


# --- properties ---------------------------------------------------------------------

rank_loads = st.tuples(
    st.integers(0, 50),
    st.integers(0, 50),
    st.floats(0.0, 1.0),
    st.integers(0, 20),
)


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(rank_loads, min_size=1, max_size=12),
    data=st.data(),
    history=st.lists(st.integers(0, 11), max_size=30),
    session=st.none() | st.integers(0, 11),
)
def test_least_loaded_returns_a_minimal_candidate_by_the_tie_rule(
    loads: list[tuple[int, int, float, int]], data: st.DataObject, history: list[int],
    session: int | None,
) -> None:
    table = LoadTable(len(loads))
    for rank, (waiting, running, kv, dispatched) in enumerate(loads):
        report(table, rank, step=1, waiting=waiting, running=running, kv=kv, lockstep=False)
        table.note_dispatched(rank, dispatched)
    candidates = data.draw(st.lists(st.integers(0, len(loads) - 1), unique=True))
    policy = LeastLoaded()
    for rank in history:
        policy.recent.note(rank)
    recent = Counter(history)
    chosen = policy.pick(table, candidates, session_rank=session)
    if not candidates:
        assert chosen is None
        return
    assert chosen in candidates
    scores = {rank: load_score(table.load(rank)) for rank in candidates}
    best = min(scores.values())
    assert scores[chosen] == best
    tied = [rank for rank in candidates if scores[rank] == best]
    if session in tied:
        assert chosen == session
    else:
        assert chosen == min(tied, key=lambda rank: (recent[rank], rank))


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(rank_loads, min_size=2, max_size=10),
    seed=st.integers(0, 2**32 - 1),
)
def test_p2c_pick_is_never_the_strict_worst(
    loads: list[tuple[int, int, float, int]], seed: int
) -> None:
    table = LoadTable(len(loads))
    for rank, (waiting, running, kv, dispatched) in enumerate(loads):
        report(table, rank, step=1, waiting=waiting, running=running, kv=kv, lockstep=False)
        table.note_dispatched(rank, dispatched)
    policy = PowerOfTwoChoices(random.Random(seed))
    candidates = list(range(len(loads)))
    scores = [load_score(table.load(rank)) for rank in candidates]
    for _ in range(5):
        chosen = policy.pick(table, candidates)
        assert chosen is not None
        # Its partner sample scored at least as much, so some other candidate does.
        assert any(scores[r] >= scores[chosen] for r in candidates if r != chosen)


@pytest.mark.parametrize(("loads", "expected"), [
    ([], 1.0), ([0, 0, 0], 1.0), ([5, 5], 1.0), ([4, 0], 0.5), ([10, 0, 0, 0], 0.25),
    ([3, 6, 9], 2 / 3),
])
def test_balance_ratio(loads: list[int], expected: float) -> None:
    assert balance_ratio(loads) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("loads", "ratio"),
    [([], 1.0), ([0, 0], 1.0), ([4, 4, 4], 1.0), ([4, 0, 0, 0], 0.25), ([2, 4], 0.75)],
)
def test_balance_ratio_is_mean_over_max(loads: list[int], ratio: float) -> None:
    assert balance_ratio(loads) == pytest.approx(ratio)


# --- copy-on-write snapshots and candidate scores ------------------------------------


class CopyingTable:
    """The snapshot rule as first written: copy every row when a new step starts."""

    def __init__(self, size: int) -> None:
        self.rows: list[tuple[int, int, float]] = [(0, 0, 0.0)] * size
        self.changed = False
        self.mark: tuple[int, int] | None = None
        self.snapshot: list[tuple[int, int, float]] | None = None

    def apply(self, rank: int, waiting: int, running: int, kv: float, wave: int, step: int,
              lockstep: bool) -> None:
        if not 0 <= rank < len(self.rows):
            return
        if lockstep and (self.mark is None or (wave, step) > self.mark):
            if self.changed:
                self.snapshot = list(self.rows)
            self.mark = (wave, step)
        self.rows[rank] = (waiting, running, float(kv))
        self.changed = True

    def take(self) -> list[tuple[int, int, float]]:
        if self.snapshot is not None:
            rows, self.snapshot = self.snapshot, None
            return rows
        self.changed = False
        return list(self.rows)

    def resize(self, size: int) -> None:
        if size == len(self.rows):
            return
        self.rows = (self.rows + [(0, 0, 0.0)] * size)[:size]
        self.snapshot = None
        self.changed = True


table_ops = st.lists(st.one_of(
    st.tuples(st.just("stats"), st.integers(-1, 6), st.integers(0, 9), st.integers(0, 9),
              st.sampled_from([0, 0.25, 0.75, 1]), st.integers(0, 2), st.integers(0, 4),
              st.booleans()),
    st.tuples(st.just("dispatch"), st.integers(-1, 6)),
    st.tuples(st.just("take")),
    st.tuples(st.just("resize"), st.integers(0, 7)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 6), table_ops)
def test_copy_on_write_snapshots_publish_what_copying_ones_did(
        size: int, ops: list[tuple[Any, ...]]) -> None:
    table, model = LoadTable(size), CopyingTable(size)
    for op in ops:
        if op[0] == "stats":
            _, rank, waiting, running, kv, wave, step, lockstep = op
            table.apply_stats(rank, waiting=waiting, running=running, kv_cache_usage=kv,
                              wave=wave, step=step, lockstep=lockstep)
            model.apply(rank, waiting, running, kv, wave, step, lockstep)
        elif op[0] == "dispatch":
            table.note_dispatched(op[1])
        elif op[0] == "take":
            assert table.take_publish_rows() == model.take()
        else:
            table.resize(op[1])
            model.resize(op[1])
        assert table.rows() == model.rows
        assert table.changed == model.changed
        assert table.snapshot_pending == (model.snapshot is not None)
        for row in table.rows():
            assert type(row[2]) is float


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), st.lists(st.integers(-2, 10), max_size=12),
       st.lists(st.integers(0, 9), min_size=8, max_size=8))
def test_candidate_scores_match_a_row_by_row_reading(size: int, candidates: list[int],
                                                     waiting: list[int]) -> None:
    table = LoadTable(size)
    for rank in range(size):
        report(table, rank, step=1, waiting=waiting[rank], running=rank % 3, lockstep=False)
    want = [table.score(r) if 0 <= r < size else math.inf for r in candidates]
    assert list(table.scores_of(candidates)) == want
    assert list(table.scores_of(candidates)) == want  # the cached reader too
    table.note_dispatched(candidates[0] if candidates else 0, 3)
    want = [table.score(r) if 0 <= r < size else math.inf for r in candidates]
    assert list(table.scores_of(candidates)) == want  # scores are read, not copied


def test_candidate_scores_follow_a_resize() -> None:
    table = table_with((1, 0, 0.0), (2, 0, 0.0))
    candidates = [0, 1, 2]
    assert list(table.scores_of(candidates)) == [1.0, 2.0, math.inf]
    table.resize(3)
    assert list(table.scores_of(candidates)) == [1.0, 2.0, 0.0]
    table.resize(1)
    assert list(table.scores_of(candidates)) == [1.0, math.inf, math.inf]
