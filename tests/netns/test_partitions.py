"""Multi-host: partition an engine host, or the coordinator's host, mid-wave; then heal.

Sandbox (`sandbox.Sandbox`): host `coord` runs the coordinator (tcp on its
sandbox address) and the frontend beside it; `hosta` runs ranks 0 and 1 and the
group's collective hub; `hostb` runs ranks 2 and 3. All four ranks are one
lockstep group, so while `hostb` is cut off the ranks on `hosta` block in their
collective, exactly as MoE ranks do. The coordinator runs with
`--lease-ttl-s 3`; engines send a heartbeat after 0.5 s of silence.

Two recorded runs (`scenarios.run_partition`), each shared by the tests that
judge it: `hostb` partitioned and healed, and `coord` partitioned and healed.
Each request the frontend submitted ends up in exactly one class: completed,
failed (a `RequestsFailed` notice came first), refused, submit timeout, or
open (lost).

A test that checks a liveness rule asserts everything it needs from the harness
(the run completed, the heal really let traffic through, nothing was restarted)
with plain asserts first, so a broken harness fails it for what it is; only the
rule itself raises `MissingLivenessRule`, whose message says which rule.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.netns.conftest import make_sandbox, release_sandbox
from tests.netns.scenarios import (
    LEASE_TICK_S,
    LEASE_TTL_S,
    PartitionRun,
    outcome,
    run_partition,
)

pytestmark = [pytest.mark.netns, pytest.mark.timeout(150)]

HOSTS = ["coord", "hosta", "hostb"]
# The frontend polls the coordinator's state every 100 ms; add scheduling noise.
OBSERVE_SLACK_S = 0.5


class MissingLivenessRule(AssertionError):
    """The coordinator lacks a liveness rule (any other failure is a plain assert)."""


def _record_run(target: str, tmp_path_factory: pytest.TempPathFactory,
                pytestconfig: pytest.Config) -> Iterator[PartitionRun]:
    workdir = tmp_path_factory.mktemp(f"partition-{target}")
    built = make_sandbox(HOSTS)
    try:
        run = run_partition(built, workdir, target)
    finally:
        release_sandbox(built)
    # What happened is the point of the run: show it even when output is captured.
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    text = f"\n{target} partition: {run.describe()}"
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print(text, flush=True)
    yield run


@pytest.fixture(scope="module")
def engine_host_run(netns_ready: None, tmp_path_factory: pytest.TempPathFactory,
                    pytestconfig: pytest.Config) -> Iterator[PartitionRun]:
    yield from _record_run("hostb", tmp_path_factory, pytestconfig)


@pytest.fixture(scope="module")
def coordinator_host_run(netns_ready: None, tmp_path_factory: pytest.TempPathFactory,
                         pytestconfig: pytest.Config) -> Iterator[PartitionRun]:
    yield from _record_run("coord", tmp_path_factory, pytestconfig)


# ---- checks shared by both runs ---------------------------------------------------------


def _completed_run(run: PartitionRun) -> None:
    assert run.error is None, run.describe()


def _failure_notices(run: PartitionRun) -> dict[int, float]:
    """When the first RequestsFailed for each rank reached the frontend."""
    first: dict[int, float] = {}
    for notice in run.ledger["notices"]:
        if notice["kind"] == "requests_failed":
            first.setdefault(int(notice["rank"]), float(notice["at"]))
    return first


def _check_failed_on_death(run: PartitionRun) -> None:
    """Requests in flight on a rank when it was declared dead were reported failed."""
    notices = _failure_notices(run)
    for rank in run.dead_at:
        assert rank in notices, f"dp_rank={rank} died but no RequestsFailed named it; " \
                                f"{run.describe()}"
        told_at = notices[rank]
        in_flight = [r for r in run.records
                     if r["rank"] == rank and r["replied_at"] is not None
                     and r["replied_at"] < told_at
                     and not any(at < told_at for at, _ in r["finished"])]
        assert in_flight, f"nothing was in flight on dp_rank={rank} when it died"
        unreported = [r["request_id"] for r in in_flight
                      if not any(failed_rank == rank for _, failed_rank, _ in r["failed"])]
        assert not unreported, (f"{len(unreported)} of {len(in_flight)} requests in flight on "
                                f"dp_rank={rank} were never reported failed: "
                                f"{unreported[:10]}; {run.describe()}")


def _check_nothing_lost(run: PartitionRun) -> None:
    tally = run.tally()
    classes = {k: v for k, v in tally.items() if not k.startswith("extra.")}
    assert sum(classes.values()) == len(run.records)
    assert run.open_after_settle == [] and tally["open"] == 0, (
        f"lost (accepted, never finished nor reported failed): {run.open_after_settle[:20]}; "
        f"{run.describe()}")
    assert tally["submit_timeout"] == 0, (
        f"the coordinator beside the frontend left submits unanswered; {run.describe()}")
    assert tally["completed"] > 0
    # The coordinator's own count, on both of its interfaces, agrees with what reached
    # the frontend.
    told = sum(n["count"] for n in run.ledger["notices"] if n["kind"] == "requests_failed")
    assert run.status["counters"].get("requests.failed", 0) == told, run.status["counters"]
    assert _metric(run, 'dp_coordinator_events_total{event="requests.failed"}') == told


def _metric(run: PartitionRun, series: str) -> float:
    """One sample of the coordinator's /metrics text at the end of the run (0 if absent)."""
    for line in run.metrics.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return 0.0


def _check_nothing_restarted(run: PartitionRun) -> None:
    assert run.ledger["coordinator_pid"] == run.coordinator_pid
    assert run.ledger["coordinator_alive"], "the coordinator died"
    assert run.engines_alive_at_end == {rank: True for rank in run.engine_pids}, (
        f"engines died (exit codes {run.exits}); {run.describe()}")
    assert run.exits.get("coordinator_exit") == 0, run.exits
    for rank in run.engine_pids:
        # 0 after SIGTERM; 3 would mean a collective hang killed it.
        assert run.exits.get(f"engine{rank}_exit") == 0, run.exits


def _heard_after_heal(run: PartitionRun, rank: int) -> bool:
    """Whether anything from `rank` reached the coordinator or the frontend after the heal."""
    for at, state in run.after_heal:
        for row in state["ranks"]:
            age = row.get("report_age_s")
            if row["rank"] == rank and age is not None and at - age > run.healed_at:
                return True
    return any(engine == rank and at > run.healed_at
               for record in run.records for at, engine in record["finished"])


def _check_rejoined(run: PartitionRun) -> None:
    """The rule under test: every cut-off rank is ready again and takes requests."""
    missing: list[str] = []
    states = {e["rank"]: e["state"] for e in run.status["engines"]}
    stuck = [rank for rank in run.cut_ranks if rank not in run.ready_again_at]
    if stuck:
        missing.append(
            f"ranks {stuck} were not ready again within {run.rejoin_deadline_s:.1f} s of "
            f"the heal (at the end: {[states.get(r) for r in stuck]}), although their "
            "engines never stopped and their traffic reached the coordinator again (a dead "
            "rank is not revived by evidence of life)")
    probes = [run.by_id()[pid] for pid in run.probe_ids]
    served = {r["rank"] for r in probes if outcome(r) == "completed"}
    idle = [rank for rank in run.cut_ranks if rank not in served]
    if idle:
        missing.append(f"none of {len(probes)} requests sent to the idle group after the heal "
                       f"ran on ranks {idle} (ranks that served: {sorted(served)})")
    if missing:
        raise MissingLivenessRule("; ".join(missing) + f". {run.describe()}")


# ---- an engine host partitioned mid-wave --------------------------------------------------


def test_partitioned_engine_host_ranks_die_and_their_requests_fail_none_lost(
    engine_host_run: PartitionRun,
) -> None:
    run = engine_host_run
    _completed_run(run)
    running = {e["rank"]: e["in_flight"] for e in run.state_before["engines"]}
    assert run.state_before["running"] and all(running[r] > 0 for r in run.cut_ranks), \
        "the partition did not happen mid-wave"
    assert sorted(run.dead_at) == run.cut_ranks, (
        f"the ranks on the partitioned host were not all declared dead within "
        f"{2 * LEASE_TTL_S + 4:g} s; {run.describe()}")
    survivors_died = [(rank, state) for _, rank, state in run.ledger["transitions"]
                      if rank not in run.cut_ranks and state == "dead"]
    assert not survivors_died, f"ranks on the other host died too: {survivors_died}"
    _check_failed_on_death(run)
    # Dead ranks get nothing: no submit answered after the death went to them, until
    # they are back (both seen by polling, hence the slack at each end).
    for rank, dead_at in run.dead_at.items():
        back = run.ready_again_at.get(rank, float("inf"))
        sent = [r["request_id"] for r in run.records if r["rank"] == rank
                and r["replied_at"] is not None
                and dead_at + OBSERVE_SLACK_S < r["replied_at"] < back - OBSERVE_SLACK_S]
        assert not sent, f"requests dispatched to dead dp_rank={rank}: {sent[:10]}"
    _check_nothing_lost(run)
    assert run.status["counters"].get("lease.dead") == len(run.cut_ranks), run.status["counters"]
    assert _metric(run, "dp_coordinator_lease_expiries_total") == len(run.cut_ranks)


def test_partitioned_engine_host_is_declared_dead_within_the_lease_ttl(
    engine_host_run: PartitionRun,
) -> None:
    run = engine_host_run
    _completed_run(run)
    assert sorted(run.dead_at) == run.cut_ranks, run.describe()
    partitioned_at = run.partitioned_at
    missing: list[str] = []
    # Nothing arrives from a cut-off host, so its "last seen" must age from the cut.
    renewed: dict[int, tuple[float, float]] = {}
    for at, rows in run.ledger["samples"]:
        elapsed = at - partitioned_at
        if elapsed < 1.0 or at >= run.healed_at:
            continue
        for rank, state, age in rows:
            if rank in run.cut_ranks and state != "dead" and age is not None \
                    and age < elapsed - OBSERVE_SLACK_S:
                renewed.setdefault(rank, (round(elapsed, 2), age))
    if renewed:
        missing.append("the coordinator renewed the leases of unreachable ranks: "
                       + ", ".join(f"dp_rank={rank} 'last seen {age:.2f} s ago' "
                                   f"{elapsed:.2f} s into the partition"
                                   for rank, (elapsed, age) in sorted(renewed.items())))
    bound = LEASE_TTL_S + LEASE_TICK_S + OBSERVE_SLACK_S
    late = {rank: round(at - partitioned_at, 2) for rank, at in run.dead_at.items()
            if at - partitioned_at > bound}
    if late:
        missing.append(f"declared dead after {late} s, more than --lease-ttl-s "
                       f"{LEASE_TTL_S:g} s (+{bound - LEASE_TTL_S:g} s for the lease timer "
                       "and observation)")
    if missing:
        raise MissingLivenessRule("; ".join(missing))


def test_a_cut_off_rank_gets_no_new_requests_long_before_it_is_declared_dead(
    engine_host_run: PartitionRun,
) -> None:
    """Nothing arrives from a cut-off host, not even heartbeat answers: once its lease is
    quiet (a third of the TTL) its probe finds the connection silent, and it is taken out
    of dispatch then, not only when it is declared dead a TTL after the cut."""
    run = engine_host_run
    _completed_run(run)
    out_by = LEASE_TTL_S / 3 + LEASE_TICK_S + OBSERVE_SLACK_S
    late = [(r["request_id"], r["rank"], round(r["replied_at"] - run.partitioned_at, 2))
            for r in run.records
            if r["rank"] in run.cut_ranks and r["replied_at"] is not None
            and run.partitioned_at + out_by < r["replied_at"] < run.healed_at]
    assert not late, (f"requests dispatched to cut-off ranks more than {out_by:g} s after "
                      f"the cut: {late[:10]}; {run.describe()}")


def test_healed_engine_host_rejoins_without_restarts_and_takes_requests(
    engine_host_run: PartitionRun,
) -> None:
    run = engine_host_run
    _completed_run(run)
    _check_nothing_restarted(run)
    silent = [rank for rank in run.cut_ranks if not _heard_after_heal(run, rank)]
    assert not silent, f"no traffic from ranks {silent} after the heal: {run.describe()}"
    _check_rejoined(run)


# ---- the coordinator's host partitioned mid-wave ------------------------------------------


def test_coordinator_host_partition_loses_no_request(coordinator_host_run: PartitionRun) -> None:
    run = coordinator_host_run
    _completed_run(run)
    assert run.state_before["running"], "the partition did not happen mid-wave"
    before = [r for r in run.records if r["rank"] is not None
              and r["replied_at"] is not None and r["replied_at"] < run.partitioned_at]
    unfinished = [r["request_id"] for r in before if outcome(r) not in ("completed", "failed")]
    assert before and not unfinished, (
        f"requests dispatched before the partition neither completed nor reported failed: "
        f"{unfinished[:10]}; {run.describe()}")
    _check_failed_on_death(run)
    _check_nothing_lost(run)


def test_coordinator_host_partition_heals_with_no_rank_left_dead(
    coordinator_host_run: PartitionRun,
) -> None:
    run = coordinator_host_run
    _completed_run(run)
    _check_nothing_restarted(run)
    silent = [rank for rank in run.cut_ranks if not _heard_after_heal(run, rank)]
    assert not silent, f"no traffic from ranks {silent} after the heal: {run.describe()}"
    _check_rejoined(run)
