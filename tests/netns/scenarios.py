"""Partition scenarios: one recorded run each, judged afterwards by several tests.

A run starts a cluster (`cluster.Cluster`), puts it under steady load until the
group is mid-wave with requests in flight on the ranks about to be cut off,
partitions one host, keeps the partition until the coordinator has declared
those ranks dead (or a deadline passed), heals it, waits for the ranks to be
ready again (or a deadline), then sends a batch of probe requests and waits for
every request to end. Everything observed is kept in a `PartitionRun`; nothing
is judged here, so one run serves every test that reads it.

Times are `time.monotonic()`, the same clock in every namespace.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.netns.cluster import Cluster, Layout
from tests.netns.sandbox import Sandbox

LEASE_TTL_S = 3.0
# The lease timer runs every min(1 s, TTL/4); a death is noticed at its next tick.
LEASE_TICK_S = min(1.0, LEASE_TTL_S / 4)
LOAD_RATE = 20.0
LOAD_STEPS = 100  # about a second per request at 10 ms per step
LOAD_MAX = 1500
WARMUP_S = 2.0
PROBES = 16
PROBE_STEPS = 20
HOLD_AFTER_DEAD_S = 1.0
SETTLE_S = 30.0


def engine_layout() -> Layout:
    """Two engine hosts with two ranks each: one lockstep group over the network."""
    return Layout("coord", {"hosta": [0, 1], "hostb": [2, 3]}, lease_ttl_s=LEASE_TTL_S)


@dataclass
class PartitionRun:
    target: str
    cut_ranks: list[int]
    layout: Layout
    workdir: Path
    rto_capped: bool
    partitioned_at: float = 0.0
    healed_at: float = 0.0
    state_before: dict[str, Any] = field(default_factory=dict)
    """GroupState (frontend socket) right before the partition."""
    dead_at: dict[int, float] = field(default_factory=dict)
    """When the frontend first saw each cut rank reported dead."""
    ready_again_at: dict[int, float] = field(default_factory=dict)
    """When the frontend first saw each cut rank ready again after the heal."""
    after_heal: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    """(time, HTTP /state) sampled while waiting for the ranks to come back."""
    rejoin_deadline_s: float = 0.0
    probes_sent_at: float = 0.0
    probe_ids: list[str] = field(default_factory=list)
    open_after_settle: list[str] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)
    metrics: str = ""
    status: dict[str, Any] = field(default_factory=dict)
    """`dp-coordinator status --json` at the end."""
    coordinator_pid: int = 0
    engine_pids: dict[int, int] = field(default_factory=dict)
    engines_alive_at_end: dict[int, bool] = field(default_factory=dict)
    exits: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Set when the run itself broke (a harness failure, not a finding)."""

    def save(self, path: Path) -> None:
        """Everything recorded, as JSON beside the process logs."""
        data = {k: v for k, v in asdict(self).items() if k not in ("layout", "workdir")}
        data["layout"] = {"coordinator_host": self.layout.coordinator_host,
                          "ranks": {h: list(r) for h, r in self.layout.ranks.items()},
                          "lease_ttl_s": self.layout.lease_ttl_s}
        path.write_text(json.dumps(data, indent=1, default=str))

    # ---- reading the ledger ---------------------------------------------------

    @property
    def records(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = self.ledger.get("records", [])
        return records

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {r["request_id"]: r for r in self.records}

    def tally(self) -> Counter[str]:
        """Every request in exactly one outcome class, plus the notable extras."""
        counts: Counter[str] = Counter()
        for record in self.records:
            counts[outcome(record)] += 1
            if record["failed"] and record["finished"]:
                first_finish, first_failure = record["finished"][0][0], record["failed"][0][0]
                counts["extra.finished_after_failure_notice" if first_failure < first_finish
                       else "extra.failure_notice_after_finish"] += 1
            if len(record["finished"]) > 1:
                counts["extra.finished_more_than_once"] += 1
        return counts

    def describe(self) -> str:
        """A few lines for assertion messages: what happened when."""
        p = self.partitioned_at
        dead = {r: round(t - p, 2) for r, t in self.dead_at.items()}
        ready = {r: round(t - self.healed_at, 2) for r, t in self.ready_again_at.items()}
        return (f"partitioned {self.target} (ranks {self.cut_ranks}); dead after partition "
                f"(s): {dead}; healed after {self.healed_at - p:.2f} s; ready again after heal "
                f"(s): {ready}; tally {dict(self.tally())}; logs in {self.workdir}"
                + (f"; run error: {self.error}" if self.error else ""))


def outcome(record: dict[str, Any]) -> str:
    """refused, submit_timeout, completed, failed (whichever came first), or open."""
    if record["refused"] is not None:
        return "refused"
    if record["submit_timed_out"]:
        return "submit_timeout"
    finished, failed = record["finished"], record["failed"]
    if finished and (not failed or finished[0][0] <= failed[0][0]):
        return "completed"
    if failed:
        return "failed"
    return "open"


def _states(state: dict[str, Any]) -> dict[int, str]:
    return {int(e["rank"]): str(e["state"]) for e in state["engines"]}


def _wait_mid_wave(cluster: Cluster, ranks: Sequence[int], within: float) -> dict[str, Any]:
    """GroupState once the group runs a wave with requests in flight on every rank given."""
    deadline = time.monotonic() + within
    while True:
        state: dict[str, Any] = cluster.driver.call("state")["state"]
        in_flight = {int(e["rank"]): int(e["in_flight"]) for e in state["engines"]}
        if state["running"] and all(in_flight[r] > 0 for r in ranks):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"no wave with requests in flight on ranks {list(ranks)} "
                               f"within {within:g} s: {state}")
        time.sleep(0.1)


def _first_seen(ledger: dict[str, Any], ranks: Sequence[int], state: str,
                since: float) -> dict[int, float]:
    seen: dict[int, float] = {}
    for at, rank, new in ledger["transitions"]:
        if rank in ranks and new == state and at >= since and rank not in seen:
            seen[rank] = at
    return seen


def _wait_states(cluster: Cluster, ranks: Sequence[int], state: str, since: float,
                 within: float, run: PartitionRun | None = None) -> dict[int, float]:
    """Wait until every rank was reported `state` after `since`; when each was."""
    deadline = time.monotonic() + within
    next_sample = 0.0
    while True:
        seen = _first_seen(cluster.driver.call("transitions"), ranks, state, since)
        if len(seen) == len(ranks) or time.monotonic() > deadline:
            return seen
        if run is not None and time.monotonic() >= next_sample:
            run.after_heal.append((time.monotonic(), cluster.http_state()))
            next_sample = time.monotonic() + 0.5
        time.sleep(0.1)


def run_partition(sandbox: Sandbox, workdir: Path, target: str,
                  layout: Layout | None = None) -> PartitionRun:
    """Partition `target` mid-wave, heal it, probe; see the module docstring."""
    layout = layout if layout is not None else engine_layout()
    if target == layout.coordinator_host:
        cut = sorted(r for ranks in layout.ranks.values() for r in ranks)
    else:
        cut = sorted(layout.ranks[target])
    run = PartitionRun(target, cut, layout, workdir, sandbox.rto_capped)
    cluster = Cluster.start(sandbox, workdir, layout)
    run.coordinator_pid = cluster.coordinator_pid
    run.engine_pids = {rank: p.pid for rank, p in cluster.engines.items()}
    ttl = layout.lease_ttl_s
    try:
        cluster.driver.call("load", rate=LOAD_RATE, steps=LOAD_STEPS, prefix="load",
                            max=LOAD_MAX)
        time.sleep(WARMUP_S)  # the first requests finish; about a second's worth run
        run.state_before = _wait_mid_wave(cluster, cut, within=15.0)
        run.partitioned_at = sandbox.partition(target)
        # Long enough for any bound worth having (twice the TTL and then some).
        run.dead_at = _wait_states(cluster, cut, "dead", run.partitioned_at,
                                   within=2 * ttl + 4.0)
        time.sleep(HOLD_AFTER_DEAD_S)  # submits meet the dead ranks for a while
        run.healed_at = sandbox.heal(target)
        # TCP resumes within the capped back-off; without the cap it may wait about
        # as long as the partition lasted.
        resume = (sandbox.heal_delay_bound_s if sandbox.rto_capped
                  else run.healed_at - run.partitioned_at + 1.0)
        run.rejoin_deadline_s = resume + 2 * ttl + 3.0
        run.ready_again_at = _wait_states(cluster, cut, "ready", run.healed_at,
                                          within=run.rejoin_deadline_s, run=run)
        run.after_heal.append((time.monotonic(), cluster.http_state()))
        cluster.driver.call("stop_load")
        # Probe an idle group, so that least-loaded dispatch spreads the probes over
        # every rank that takes requests.
        cluster.driver.call("settle", within=SETTLE_S, timeout=SETTLE_S + 5.0)
        run.probes_sent_at = time.monotonic()
        probes = cluster.driver.call("submit", count=PROBES, steps=PROBE_STEPS,
                                     prefix="probe", timeout=15.0)
        run.probe_ids = [r["request_id"] for r in probes["records"]]
        settled = cluster.driver.call("settle", within=SETTLE_S, timeout=SETTLE_S + 5.0)
        run.open_after_settle = list(settled["open"])
        run.ledger = cluster.ledger()
        run.metrics = cluster.driver.call("http", path="/metrics")["text"]
        run.status = cluster.status_cli()
        run.engines_alive_at_end = cluster.engines_alive()
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
        for host in list(sandbox.partitioned):
            sandbox.heal(host)
        if not run.ledger:
            try:
                run.ledger = cluster.ledger()
            except Exception as ledger_exc:
                run.error += f" (and the ledger could not be read: {ledger_exc})"
    finally:
        run.exits = cluster.stop()
        run.save(workdir / "run.json")
    return run
