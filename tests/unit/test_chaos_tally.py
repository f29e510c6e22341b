"""The chaos run's accounting: every request lands in exactly one class."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from coordinator.sim.traffic import RequestRecord
from tools.chaos import ChaosConfig, ChaosReport, classify_requests

CLASSES = ("completed_once", "completed_more_than_once", "failed_notice",
           "failed_notice_then_completed", "refused", "timed_out_then_completed",
           "timed_out_never_completed", "covered_by_engine_dead", "lost")


def tally(records: list[tuple[RequestRecord, int]]) -> Counter[str]:
    load: Any = SimpleNamespace(
        records={r.request_id: r for r, _ in records},
        finish_counts=Counter({r.request_id: n for r, n in records if n}),
        engine_dead_at={})
    report = ChaosReport(ChaosConfig())
    classify_requests(load, report)
    return report.tallies


def record(name: str, **fields: Any) -> RequestRecord:
    return RequestRecord(name, client_index=0, decode_steps=1, submitted_at=1.0, **fields)


def test_a_submit_that_timed_out_and_then_finished_is_in_one_class_only() -> None:
    t = tally([(record("late", submit_timed_out=True), 1)])
    assert t["timed_out_then_completed"] == 1 and t["completed_once"] == 0


def test_a_failure_notice_then_a_finish_is_in_one_class_only() -> None:
    t = tally([(record("f", failed="rank_lost"), 1)])
    assert t["failed_notice_then_completed"] == 1 and t["completed_once"] == 0


def test_every_kind_of_request_is_in_exactly_one_class() -> None:
    records = [
        (record("ok"), 1), (record("twice"), 2), (record("twice-late", submit_timed_out=True), 2),
        (record("failed", failed="rank_lost"), 0), (record("refused", refused="busy"), 0),
        (record("refused-ran", refused="busy"), 1), (record("late", submit_timed_out=True), 1),
        (record("never", submit_timed_out=True), 0), (record("lost"), 0),
        (record("failed-ran", failed="rank_lost"), 1),
    ]
    t = tally(records)
    assert sum(t[c] for c in CLASSES) == t["submitted"] == len(records)
    assert t["completed_more_than_once"] == 2 and t["refused_then_completed"] == 1
