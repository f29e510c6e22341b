"""The in-process profiles (``python -m bench.profile core`` / ``ingest``) measure what
they say: every step runs against a live core, and the ingest batches are the flood
shape the tables describe (three reports in four superseded). No timing is checked."""

from __future__ import annotations

from bench import core_cost, ingest_cost


def test_the_core_profile_times_every_step_on_a_live_group() -> None:
    results = core_cost.measure(engines=8, number=100, repeats=1)
    names = [name for name, _ in results]
    assert names[0].startswith("submit through the core")
    assert names[-1].startswith("a wave's first request")
    assert len(names) == len(set(names)) == 14
    assert all(cost > 0 for _, cost in results)


def test_the_ingest_profile_feeds_batches_of_which_three_in_four_are_superseded() -> None:
    results = dict(ingest_cost.measure(batches=2, repeats=1))
    # Four reports per engine per batch; a step change now and then keeps one more.
    assert 0.7 <= results["(share of reports superseded)"] <= 0.75
    assert all(cost > 0 for cost in results.values())
