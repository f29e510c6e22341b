"""The routing rule, decision by decision, and its properties."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.dispatch.balancer import LoadTable
from coordinator.core.dispatch.prefix_rule import (
    PREFERENCES,
    RecentDispatches,
    RouteDecision,
    RouteReason,
    RoutingConfig,
    SessionAffinity,
    Situation,
    TokenLoad,
    choose_rank,
    pick_least_loaded_sticky,
)

LOCKSTEP = RoutingConfig(lockstep=True, decode_weight=100.0, slack_tokens=200.0)
DENSE = RoutingConfig(lockstep=False, decode_weight=100.0, slack_tokens=200.0)


def decide(
    loads: list[float],
    cached: list[int] | None,
    prompt: int,
    config: RoutingConfig = LOCKSTEP,
    **options: Any,
) -> RouteDecision:
    decision = choose_rank(list(range(len(loads))), loads, cached, prompt, config, **options)
    assert decision is not None
    return decision


# --- the cached rank, the busiest rank, ties ------------------------------------------


def test_the_rank_holding_the_prefix_is_chosen_in_an_idle_group() -> None:
    decision = decide([0, 0, 0, 0], [0, 0, 960, 0], 1000)
    assert decision.rank == 2
    assert decision.reason is RouteReason.COST  # nobody else came within the slack
    assert decision.situation is Situation.RAISES_MAX
    assert decision.cached_tokens == 960
    assert decision.cost == 40 + 100
    assert decision.load_after == decision.group_max_after == 140


def test_the_rank_holding_the_prefix_is_chosen_under_load_too() -> None:
    # Everyone is busy; the cached rank is a little busier but the hit saves more.
    decision = decide([3000, 2800, 2900, 2850], [1800, 0, 0, 0], 2000)
    assert decision.rank == 0
    assert decision.load_after == 3000 + 200 + 100


def test_the_busiest_rank_is_not_chosen_however_much_it_caches() -> None:
    # Rank 0 holds the whole prompt, but it sets the group's step time; every other
    # rank can take the whole prompt without raising the maximum.
    decision = decide([5000, 100, 200, 300], [3999, 0, 0, 0], 4000)
    assert decision.rank == 1
    assert decision.situation is Situation.FITS_UNDER_MAX
    assert decision.group_max_after == 5000
    for slack in (0.0, 1e6):
        config = RoutingConfig(lockstep=True, decode_weight=100.0, slack_tokens=slack)
        assert decide([5000, 100, 200, 300], [3999, 0, 0, 0], 4000, config).rank != 0


def test_a_rank_that_fits_under_the_maximum_keeps_its_cache_advantage() -> None:
    # Ranks 1 and 2 both fit under rank 0's load; rank 2 has the prefix.
    decision = decide([5000, 0, 0], [0, 0, 900], 1000)
    assert decision.rank == 2
    assert decision.situation is Situation.FITS_UNDER_MAX


def test_a_long_queue_outweighs_a_cache_hit_when_it_costs_more_than_the_slack() -> None:
    # Rank 1 fits under the maximum with its hit, but its queue makes the request wait
    # far longer than recomputing the prompt on idle rank 2.
    decision = decide([9000, 8500, 0], [0, 1000, 0], 1100)
    assert decision.rank == 2
    assert decision.reason is RouteReason.COST


def test_ties_go_to_the_longest_prefix() -> None:
    decision = decide([0, 0, 0, 0], [0, 64, 128, 64], 1000)
    assert decision.rank == 2
    assert decision.reason is RouteReason.PREFIX


def test_equal_prefixes_go_to_the_sessions_last_rank() -> None:
    decision = decide([0, 0, 0, 0], [0, 128, 128, 0], 1000, session_rank=1)
    assert (decision.rank, decision.reason) == (1, RouteReason.SESSION)
    decision = decide([0, 0, 0, 0], [0, 128, 128, 0], 1000, session_rank=2)
    assert (decision.rank, decision.reason) == (2, RouteReason.SESSION)


def test_a_longer_prefix_beats_the_session() -> None:
    decision = decide([0, 0, 0, 0], [0, 128, 192, 0], 1000, session_rank=1)
    assert (decision.rank, decision.reason) == (2, RouteReason.PREFIX)


def test_without_cache_the_session_stays_where_it_was() -> None:
    for _ in range(5):
        decision = decide([10, 10, 10, 10], None, 500, session_rank=3)
        assert (decision.rank, decision.reason) == (3, RouteReason.SESSION)


def test_the_session_stays_on_a_near_equal_but_busier_rank() -> None:
    decision = decide([0, 150, 0], None, 500, session_rank=1)
    assert (decision.rank, decision.reason) == (1, RouteReason.SESSION)
    # Beyond the slack it moves.
    decision = decide([0, 250, 0], None, 500, session_rank=1)
    assert decision.rank != 1


def test_then_the_lighter_rank_then_the_least_recent_then_the_lowest_id() -> None:
    assert decide([0, 50, 20], None, 500).rank == 0
    assert decide([50, 0, 20], None, 500).reason is RouteReason.LOAD
    decision = decide([0, 0, 0], None, 500, recent=[3, 1, 2])
    assert (decision.rank, decision.reason) == (1, RouteReason.SPREAD)
    decision = decide([0, 0, 0], None, 500, recent=[1, 1, 1])
    assert (decision.rank, decision.reason) == (0, RouteReason.RANK)


def test_new_sessions_spread_without_rotation() -> None:
    recent = RecentDispatches(window=64)
    chosen = []
    for _ in range(8):
        ranks = [0, 1, 2, 3]
        decision = choose_rank(ranks, [0.0] * 4, None, 500, LOCKSTEP, recent=recent.counts(ranks))
        assert decision is not None
        recent.note(decision.rank)
        chosen.append(decision.rank)
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3]


def test_ranks_that_may_not_be_chosen_still_count_for_the_maximum() -> None:
    # A draining rank at 4000 makes the maximum 4000: rank 0 fits under it with the hit.
    decision = decide([1000, 0], [900, 0], 1000, others_max=4000)
    assert decision.situation is Situation.FITS_UNDER_MAX
    assert decision.group_max_after == 4000
    assert decision.rank == 0


def test_no_candidates_no_decision() -> None:
    assert choose_rank([], [], None, 100, LOCKSTEP) is None


def test_candidates_are_ranks_not_positions() -> None:
    decision = choose_rank([7, 3, 5], [0, 0, 0], [0, 100, 100], 1000, LOCKSTEP, session_rank=5)
    assert decision is not None
    assert (decision.rank, decision.reason) == (5, RouteReason.SESSION)


def test_misaligned_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        choose_rank([0, 1], [0.0], None, 10, LOCKSTEP)
    with pytest.raises(ValueError):
        choose_rank([0, 1], [0.0, 0.0], [0], 10, LOCKSTEP)
    with pytest.raises(ValueError):
        choose_rank([0, 1], [0.0, 0.0], None, 10, LOCKSTEP, recent=[1])


@pytest.mark.parametrize(
    "field", ["decode_weight", "slack_tokens", "queued_request_tokens"]
)
@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_bad_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})


# --- dense mode -----------------------------------------------------------------------


def test_dense_mode_minimises_load_plus_uncached_tokens() -> None:
    # Rank 0 holds the whole prompt but its queue is longer than recomputing it.
    decision = decide([3000, 0], [999, 0], 1000, DENSE)
    assert decision.situation is Situation.DENSE
    assert decision.rank == 1
    # With a shorter queue the hit wins.
    assert decide([600, 0], [999, 0], 1000, DENSE).rank == 0


def test_dense_mode_has_no_maximum_to_protect() -> None:
    # Rank 1 can take the prompt without raising rank 0's load, the group's maximum;
    # rank 0 holds the prefix and would raise it by 101. Lockstep protects the
    # maximum, dense mode takes the near-equal rank with the prefix.
    loads, cached = [1000.0, 0.0], [899, 0]
    lockstep = decide(loads, cached, 900, LOCKSTEP)
    assert (lockstep.rank, lockstep.situation) == (1, Situation.FITS_UNDER_MAX)
    dense = decide(loads, cached, 900, DENSE)
    assert (dense.rank, dense.reason) == (0, RouteReason.PREFIX)


def test_equal_raises_go_to_the_prefix() -> None:
    # Every choice raises the maximum by the same amount: the hit saves compute.
    decision = decide([1000, 0], [1000, 0], 1001)
    assert (decision.situation, decision.rank) == (Situation.RAISES_MAX, 0)
    assert decision.reason is RouteReason.PREFIX


# --- the plain least-loaded tie rule ---------------------------------------------------


def test_least_loaded_ties_stick_to_the_session_then_spread() -> None:
    assert pick_least_loaded_sticky([2.0, 1.0, 3.0], [0, 1, 2]) == (1, RouteReason.COST)
    assert pick_least_loaded_sticky([1.0, 1.0, 1.0], [4, 5, 6], session_rank=6) == (
        6,
        RouteReason.SESSION,
    )
    # The session's rank must be among the lowest to count.
    assert pick_least_loaded_sticky([1.0, 2.0], [0, 1], session_rank=1) == (0, RouteReason.COST)
    assert pick_least_loaded_sticky([1.0, 1.0, 1.0], [4, 5, 6], recent=[2, 0, 1]) == (
        5,
        RouteReason.SPREAD,
    )
    assert pick_least_loaded_sticky([1.0, 1.0], [9, 4]) == (4, RouteReason.RANK)
    assert pick_least_loaded_sticky([], []) is None
    with pytest.raises(ValueError):
        pick_least_loaded_sticky([1.0], [0, 1])


def test_least_loaded_ties_do_not_rotate() -> None:
    picks = {pick_least_loaded_sticky([0.0] * 4, [0, 1, 2, 3], session_rank=2) for _ in range(10)}
    assert picks == {(2, RouteReason.SESSION)}


# --- load bookkeeping ------------------------------------------------------------------


def test_token_load_counts_reports_and_what_was_sent_since() -> None:
    config = RoutingConfig(decode_weight=100.0, queued_request_tokens=500.0)
    load = TokenLoad(3, config)
    assert load.load(1, waiting=2, running=3) == 2 * 500 + 3 * 100
    load.note_dispatched(1, 1100.0)
    assert load.pending(1) == 1100
    # The estimate for a waiting request follows what is dispatched.
    assert load.queued_request_tokens == pytest.approx(500 + (1100 - 500) / 16)
    assert load.load(1, 0, 0) == 1100
    load.on_report(1)
    assert load.pending(1) == 0
    load.note_dispatched(2, 300.0)
    load.forget(2, 300.0)  # its send failed: taken back
    load.forget(2, 1.0)
    assert load.pending(2) == 0
    load.note_dispatched(9, 50.0)  # outside the table: only the estimate moves
    load.forget(9, 50.0)
    load.on_report(9)
    assert load.pending(9) == 0
    load.resize(1)
    assert load.size == 1 and load.pending(1) == 0
    load.resize(4)
    assert load.size == 4
    with pytest.raises(ValueError):
        TokenLoad(-1, config)
    with pytest.raises(ValueError):
        load.resize(-1)


def test_token_load_reads_counts_from_the_load_table() -> None:
    table = LoadTable(2)
    table.apply_stats(1, waiting=1, running=2, kv_cache_usage=0.1, wave=0, step=1, lockstep=True)
    load = TokenLoad(2, RoutingConfig(decode_weight=10.0, queued_request_tokens=100.0))
    load.note_dispatched(0, 7.0)
    waiting_estimate = load.queued_request_tokens
    assert load.loads(table, [0, 1]) == [7.0, waiting_estimate * 1 + 10 * 2]


def test_recent_dispatches_count_a_sliding_window() -> None:
    recent = RecentDispatches(window=3)
    for rank in (0, 1, 1, 2):
        recent.note(rank)
    assert recent.counts([0, 1, 2, 3]) == [0, 2, 1, 0]
    recent.note(2)
    recent.note(2)
    assert recent.counts([0, 1, 2]) == [0, 0, 3]
    assert recent.count(2) == 3
    with pytest.raises(ValueError):
        RecentDispatches(window=0)


def test_session_affinity_keeps_the_most_recent_sessions() -> None:
    sessions = SessionAffinity(max_sessions=2)
    sessions.note("a", 1)
    sessions.note("b", 2)
    sessions.note("a", 3)  # a is now the most recent
    sessions.note("c", 0)  # b is forgotten
    assert len(sessions) == 2
    assert sessions.rank_for("a") == 3
    assert sessions.rank_for("b") is None
    assert sessions.rank_for("c") == 0
    assert sessions.rank_for(None) is None
    with pytest.raises(ValueError):
        SessionAffinity(max_sessions=0)


# --- properties --------------------------------------------------------------------------

SIZES = st.integers(1, 12)


@st.composite
def situations(draw: Any) -> dict[str, Any]:
    count = draw(SIZES)
    ranks = draw(st.lists(st.integers(0, 300), min_size=count, max_size=count, unique=True))
    prompt = draw(st.integers(0, 8000))
    loads = draw(
        st.lists(st.integers(0, 20_000).map(float), min_size=count, max_size=count)
    )
    cached = draw(
        st.none()
        | st.lists(st.integers(0, max(prompt - 1, 0)), min_size=count, max_size=count)
    )
    recent = draw(st.none() | st.lists(st.integers(0, 5), min_size=count, max_size=count))
    session = draw(st.none() | st.sampled_from(ranks))
    others_max = draw(st.sampled_from([0.0, 0.0, 10_000.0]))
    config = RoutingConfig(
        lockstep=draw(st.booleans()),
        decode_weight=draw(st.sampled_from([0.0, 64.0, 128.0])),
        slack_tokens=draw(st.sampled_from([0.0, 256.0, 2000.0])),
    )
    return {
        "candidates": ranks,
        "loads": loads,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "config": config,
        "session_rank": session,
        "recent": recent,
        "others_max": others_max,
    }


def call(case: dict[str, Any]) -> RouteDecision:
    decision = choose_rank(
        case["candidates"],
        case["loads"],
        case["cached_tokens"],
        case["prompt_tokens"],
        case["config"],
        session_rank=case["session_rank"],
        recent=case["recent"],
        others_max=case["others_max"],
    )
    assert decision is not None
    return decision


def outcomes(case: dict[str, Any]) -> tuple[list[float], list[float], float]:
    """Per candidate: its load after the request, the group's maximum after it; and M."""
    config: RoutingConfig = case["config"]
    cached = case["cached_tokens"] or [0] * len(case["candidates"])
    current_max = max(max(case["loads"]), case["others_max"])
    after = [
        load + max(case["prompt_tokens"] - hit, 0) + config.decode_weight
        for load, hit in zip(case["loads"], cached, strict=True)
    ]
    group_max = [max(current_max, value) for value in after]
    return after, group_max, current_max


@settings(max_examples=300, deadline=None)
@given(situations())
def test_the_load_rule_holds_within_the_slack(case: dict[str, Any]) -> None:
    config: RoutingConfig = case["config"]
    decision = call(case)
    index = case["candidates"].index(decision.rank)
    after, group_max, current_max = outcomes(case)
    assert decision.load_after == after[index]
    assert decision.group_max_after == group_max[index]
    if config.lockstep:
        assert group_max[index] <= min(group_max) + config.slack_tokens
        if min(after) <= current_max:
            # Some rank fits under the maximum: the maximum does not move, so the
            # strictly busiest rank (which would raise it) is never chosen.
            assert group_max[index] == current_max
            assert after[index] <= current_max
    else:
        assert after[index] <= min(after) + config.slack_tokens


@settings(max_examples=300, deadline=None)
@given(situations(), st.randoms(use_true_random=False))
def test_the_decision_depends_on_the_inputs_only(case: dict[str, Any], rng: Any) -> None:
    first = call(case)
    assert call(case) == first
    # Shuffling the candidates (with their data) changes nothing.
    order = list(range(len(case["candidates"])))
    rng.shuffle(order)
    shuffled = dict(case)
    for key in ("candidates", "loads", "cached_tokens", "recent"):
        if case[key] is not None:
            shuffled[key] = [case[key][i] for i in order]
    assert call(shuffled) == first


@settings(max_examples=300, deadline=None)
@given(situations())
def test_no_near_equal_rank_is_preferred_over_the_choice(case: dict[str, Any]) -> None:
    """The chosen rank beats every other allowed rank on the preference order."""
    config: RoutingConfig = case["config"]
    decision = call(case)
    after, _, current_max = outcomes(case)
    count = len(case["candidates"])
    cached = case["cached_tokens"] or [0] * count
    pool = list(range(count))
    if config.lockstep and min(after) <= current_max:
        pool = [i for i in pool if after[i] <= current_max]
    low = min(after[i] for i in pool)
    near = [i for i in pool if after[i] <= low + config.slack_tokens]
    recent = case["recent"] or [0] * count

    def preference(i: int) -> tuple[float, ...]:
        return (
            -cached[i],
            0 if case["candidates"][i] == case["session_rank"] else 1,
            after[i],
            recent[i],
            case["candidates"][i],
        )

    best = min(near, key=preference)
    assert decision.rank == case["candidates"][best]
    assert decision.cached_tokens == cached[best]
    if len(near) == 1:
        assert decision.reason is RouteReason.COST
    else:
        assert decision.reason in PREFERENCES
