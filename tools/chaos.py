"""Chaos run: kill -9 engines and the coordinator under load, then account for every request.

    python -m tools.chaos --seconds 600 [--seed 7] [--engines 8] [--rate 100]

Processes, as in a deployment (all on this machine, ipc sockets only):

* the coordinator, `python -m coordinator serve`, with a fixed `--ipc-dir` (a
  restarted one binds the same addresses) and `--state-file` when the server
  offers it;
* per engine-group generation, a collective hub (`python -m coordinator.sim
  hub`) and one `python -m coordinator.sim engine` process per rank;
* this process: two frontends of `coordinator.loadgen` under Poisson load.

The run is a sequence of restart-free intervals of equal load, each followed by
one chaos event:

* ``engine``: kill -9 one or two random ranks. A lockstep peer cannot rejoin
  its group alone (its collective sequence restarts, like a broken torch DP
  group), so after waiting long enough for the survivors' collectives to time
  out (the sim then records the hang, naming the killed ranks as missing, and
  the engine dies as vLLM would), the rest of the group and its hub are
  stopped and a new generation (same ranks, new engine ids) is started. The
  coordinator must accept it without being restarted.
* ``coordinator``: kill -9 the coordinator and start a new one on the same
  addresses; engines and frontends keep their sockets (ZeroMQ reconnects).
* ``both``: kill -9 the coordinator, kill -9 an engine while it is down, then
  bring back the coordinator and a new engine generation.

At the end every request is put in exactly one class (completed once,
completed more than once, reported failed by a notice, refused at submit,
submit timed out, covered by an ENGINE_CORE_DEAD notice, or lost); collective
hangs from the engines' own reports are split into deliberate ones (every
missing rank was one we had killed) and unexplained ones; the coordinator's
resident memory is read from /proc/<pid>/status at the end of every interval.
`ChaosReport.findings()` lists what broke a requirement, each with the known
cause (`KNOWN_ISSUES`) when the harness recognises it. A live coordinator that
stops answering frontend calls is recorded as such and then sent one message
from a new connection, which wakes a reader that missed its signal; if that
does not bring the answers back, the schedule stops there (nothing after it
would mean anything).

Every child process is started here and killed here by its pid, in `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from coordinator._zmq import die_with_parent_preexec
from coordinator.frontend import EngineDead, FinishedRequest, FrontendClient, FrontendError, Notice
from coordinator.launch import CoordinatorHandle, launch
from coordinator.loadgen import LoadConfig, LoadGenerator, RequestRecord

EVENTS = ("engine", "coordinator", "both")
# The sim's exit status for "an engine died of a collective hang".
SIM_EXIT_HANG = 3
_MISSING = re.compile(r"missing ranks \[([0-9, ]*)\]")


class GroupStartFailed(RuntimeError):
    """A new engine generation did not become ready; the schedule stops there."""


# ---------------------------------------------------------------- configuration


@dataclass
class ChaosConfig:
    engines: int = 8
    frontends: int = 2
    rate: float = 100.0
    """Mean request arrivals per second over both frontends (Poisson)."""
    interval_s: float = 5.0
    """Length of each restart-free interval of load."""
    schedule: list[str] = field(default_factory=lambda: ["coordinator", "engine", "both",
                                                          "engine", "engine"])
    """One chaos event after each interval but the last."""
    step_ms: float = 5.0
    collective_timeout_s: float = 3.0
    lease_ttl_s: float = 3.0
    restart_gap_s: float = 0.5
    """How long a killed process stays down before its replacement starts."""
    steps_median: float = 16.0
    steps_max: int = 128
    burst_on_s: float | None = 2.0
    burst_off_s: float = 1.0
    """Load comes in bursts with quiet gaps, so the group also pauses and is woken
    again (waves end and start all through the run, and a kill may land in a pause)."""
    drain_timeout_s: float = 12.0
    seed: int = 1
    state_file: bool | None = None
    """Use --state-file (None: whenever `serve --help` offers it)."""
    workdir: str | None = None
    coordinator_args: list[str] = field(default_factory=list)
    """Extra `serve` flags (e.g. --watchdog-rewake), appended after the run's own."""
    log: Callable[[str], None] = print

    @classmethod
    def random_schedule(cls, seconds: float, *, seed: int, interval_s: float = 5.0,
                        **kwargs: Any) -> ChaosConfig:
        """Events drawn at random for a run of about `seconds` (for the long runs)."""
        rng = random.Random(seed)
        # An engine event costs about an interval more than its interval (hang window
        # plus start-up); a coordinator event about a second.
        count = max(1, int(seconds / (2.2 * interval_s)))
        schedule = [rng.choices(EVENTS, weights=(5, 3, 2))[0] for _ in range(count)]
        # End with engine events only, so the last coordinator process serves several
        # intervals of equal load and its memory growth can be read.
        schedule += ["engine", "engine"]
        return cls(schedule=schedule, seed=seed, interval_s=interval_s, **kwargs)


# ---------------------------------------------------------------- child processes


class Children:
    """Every process this run started, so that `kill_all` can end each one by pid."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: Sequence[str], *, stdout: str, stderr: str) -> subprocess.Popen[bytes]:
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            process = subprocess.Popen(
                list(args), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True, preexec_fn=die_with_parent_preexec(),
            )
        self.processes.append(process)
        return process

    def adopt(self, process: subprocess.Popen[bytes]) -> None:
        self.processes.append(process)

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)


def kill9(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)


async def wait_exit(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return process.poll()


async def terminate(process: subprocess.Popen[bytes], timeout: float = 5.0) -> tuple[int, bool]:
    """SIGTERM, then SIGKILL after `timeout`; (exit code, had to be killed)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
    code = await wait_exit(process, timeout)
    if code is None:
        kill9(process)
        code = await wait_exit(process, 5.0)
        return (code if code is not None else -9), True
    return code, False


def rss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def serve_supports(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "coordinator", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    return flag in out.stdout


# ---------------------------------------------------------------- records


@dataclass
class EngineRun:
    rank: int
    process: subprocess.Popen[bytes]
    stdout: str
    stderr: str
    killed: bool = False
    exit_code: int | None = None
    had_to_kill: bool = False


@dataclass
class Generation:
    """One start of the whole engine group (hub + every rank)."""

    index: int
    hub: subprocess.Popen[bytes]
    engines: dict[int, EngineRun]
    started_at: float
    ready_at: float | None = None
    stopped_at: float | None = None
    killed_ranks: set[int] = field(default_factory=set)
    killed_at: float | None = None
    summaries: list[dict[str, Any]] = field(default_factory=list)
    unexpected_exits: dict[int, int] = field(default_factory=dict)
    """Ranks that exited although nothing in this generation had been killed."""
    consequential_exits: dict[int, int] = field(default_factory=dict)
    """Ranks that exited after we killed a peer (their collective timed out)."""
    coordinator_at_start: tuple[int, bool] | None = None
    """(wave, running) the coordinator reported just before this generation started."""
    last_seen_states: list[str] | None = None

    @property
    def started_into_running_wave(self) -> bool:
        """The coordinator believed a wave was running when these fresh engines (all
        paused at wave 0) started: nothing will wake the ranks that get no request."""
        return self.coordinator_at_start is not None and self.coordinator_at_start[1]

    def hangs(self) -> list[tuple[int, str, tuple[int, ...]]]:
        found = []
        for summary in self.summaries:
            for text in summary.get("hangs") or []:
                match = _MISSING.search(text)
                missing = tuple(int(x) for x in match.group(1).split(",") if x.strip()) \
                    if match else ()
                found.append((int(summary.get("rank", -1)), str(text), missing))
        return found


@dataclass
class Interval:
    index: int
    started: float
    ended: float
    coordinator_pid: int
    rss_kb: int | None
    event_after: str | None = None


@dataclass
class EventRecord:
    kind: str
    at: float
    detail: str
    seconds: float = 0.0


class ChaosLoad(LoadGenerator):
    """The load generator, plus what the chaos accounting needs to see.

    Counts every finish per request id (the base class keeps one), remembers
    when each frontend got ENGINE_CORE_DEAD, and stops arriving when told to
    (the run's length depends on how long the restarts take).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finish_counts: Counter[str] = Counter()
        self.engine_dead_at: dict[int, list[float]] = {}
        self.stop_arrivals = asyncio.Event()

    async def start(self, *, register_timeout_s: float = 30.0) -> None:
        await super().start(register_timeout_s=register_timeout_s)
        for client in self.clients:
            client.on_notice = self._notice_from(client)

    def _notice_from(self, client: FrontendClient) -> Callable[[Notice], None]:
        def on_notice(notice: Notice) -> None:
            if isinstance(notice, EngineDead):
                self.engine_dead_at.setdefault(client.client_index, []).append(notice.at)
            self._on_notice(notice)

        return on_notice

    def _on_finished(self, item: FinishedRequest) -> None:
        self.finish_counts[item.request_id] += 1
        super()._on_finished(item)

    async def _arrivals(self, client: FrontendClient, deadline: float,
                        budget: list[int]) -> None:
        arrivals = asyncio.ensure_future(super()._arrivals(client, deadline, budget))
        stopper = asyncio.ensure_future(self.stop_arrivals.wait())
        try:
            await asyncio.wait([arrivals, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (arrivals, stopper):
                task.cancel()
            await asyncio.gather(arrivals, stopper, return_exceptions=True)


# ---------------------------------------------------------------- the report

# Requirements this run checks that the coordinator is known not to meet yet. A
# finding carries one of these codes when its cause is recognised; anything else
# is a new failure. See each text for the reproduction and the suggested fix.
KNOWN_ISSUES: dict[str, str] = {}


CATEGORIES = ("requests", "waves", "restarts", "frontend", "memory", "shutdown")


@dataclass(frozen=True)
class Finding:
    category: str
    """Which requirement it breaks: one of CATEGORIES."""
    code: str | None
    """A KNOWN_ISSUES key, or None for a failure with no known cause."""
    text: str


@dataclass
class ChaosReport:
    config: ChaosConfig
    origin: float = 0.0
    """time.monotonic() at the start; every time in the report counts from here."""
    wall_s: float = 0.0
    events: list[EventRecord] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    coordinator_pids: list[int] = field(default_factory=list)
    coordinator_kills: list[float] = field(default_factory=list)
    coordinator_exit: int | None = None
    tallies: Counter[str] = field(default_factory=Counter)
    refused_by_code: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    lost_after_coordinator_kill: int = 0
    final_state: dict[str, Any] = field(default_factory=dict)
    load_summary: dict[str, Any] = field(default_factory=dict)
    deaf_since: float | None = None
    """When state queries first went unanswered by a live, publishing coordinator."""
    deaf_episodes: int = 0
    nudges_that_helped: int = 0
    unanswered_queries: int = 0
    notes: list[Finding] = field(default_factory=list)
    """Findings made while running (start-ups, aborts, the final state)."""
    aborted: str | None = None

    # -- derived

    def hang_classes(self) -> dict[str, list[str]]:
        """Collective hangs as the engines reported them, by cause.

        deliberate: every missing rank was one we had killed (its peers wait for it).
        stale_running_wave: in a generation that started while the coordinator still
        believed the previous generation's wave was running (see
        `Generation.started_into_running_wave`). unexplained: anything else.
        """
        classes: dict[str, list[str]] = {"deliberate": [], "stale_running_wave": [],
                                         "unexplained": []}
        for gen in self.generations:
            for rank, text, missing in gen.hangs():
                line = f"generation {gen.index} rank {rank}: {text}"
                if missing and set(missing) <= gen.killed_ranks:
                    classes["deliberate"].append(line)
                elif gen.started_into_running_wave:
                    classes["stale_running_wave"].append(line)
                else:
                    classes["unexplained"].append(line)
        return classes

    def rss_growth(self) -> tuple[int, float, list[tuple[int, int | None]]] | None:
        """(pid, growth, samples) for the coordinator process that served most intervals.

        Growth is last/first - 1 over its restart-free intervals; the first sample is
        taken after a whole interval of load, so start-up allocation is not counted.
        """
        by_pid: dict[int, list[Interval]] = {}
        for interval in self.intervals:
            by_pid.setdefault(interval.coordinator_pid, []).append(interval)
        candidates = [(len(v), pid) for pid, v in by_pid.items() if len(v) >= 2]
        if not candidates:
            return None
        _, pid = max(candidates)
        samples = [(i.index, i.rss_kb) for i in by_pid[pid]]
        first, last = samples[0][1], samples[-1][1]
        if not first or not last:
            return None
        return pid, last / first - 1.0, samples

    def findings(self) -> list[Finding]:
        """Every broken requirement, with its known cause when there is one."""
        found = list(self.notes)
        t = self.tallies
        unattributed_lost = t["lost"] - self.lost_after_coordinator_kill
        if self.lost_after_coordinator_kill:
            # A restarted coordinator has no routing entry for these; when their rank
            # dies, its rank_lost notice lets the SDK fail them itself.
            found.append(Finding(
                "requests", None,
                f"{self.lost_after_coordinator_kill} requests submitted before a coordinator "
                "kill were neither completed nor reported failed"))
        if unattributed_lost:
            found.append(Finding("requests", None, f"{unattributed_lost} submitted requests "
                                 "were neither completed nor reported failed"))
        for key, what in (("completed_more_than_once", "requests completed more than once"),
                          ("refused_then_completed", "refused submits that ran anyway"),
                          ("failed_notice_then_completed",
                           "requests reported failed that then completed")):
            if t[key]:
                found.append(Finding("requests", None, f"{t[key]} {what}"))
        if self.deaf_since is not None:
            found.append(Finding(
                "frontend", "deaf_socket",
                f"{self.deaf_episodes} time(s), first at {self.deaf_since:.1f} s, the live "
                f"coordinator stopped answering frontend calls ({self.unanswered_queries} state "
                f"queries unanswered); a message from a new connection woke it "
                f"{self.nudges_that_helped} time(s)"))
        hangs = self.hang_classes()
        if hangs["stale_running_wave"]:
            found.append(Finding(
                "waves", "stale_running_wave",
                f"{len(hangs['stale_running_wave'])} collective hangs in generations "
                f"{self.exposed_generations()}, started while the coordinator said a wave "
                "was running: " + "; ".join(hangs["stale_running_wave"][:2])))
        if hangs["unexplained"]:
            found.append(Finding("waves", None, f"{len(hangs['unexplained'])} collective hangs "
                                 "not caused by a killed rank: "
                                 + "; ".join(hangs["unexplained"][:3])))
        for gen in self.generations:
            if gen.unexpected_exits:
                code = "stale_running_wave" if gen.started_into_running_wave and all(
                    c == SIM_EXIT_HANG for c in gen.unexpected_exits.values()) else None
                found.append(Finding("waves", code, f"generation {gen.index}: engines exited "
                                     f"without being killed (rank: code) "
                                     f"{gen.unexpected_exits}"))
        growth = self.rss_growth()
        if growth is not None and growth[1] >= 0.10:
            found.append(Finding("memory", None, f"coordinator pid {growth[0]} RSS grew "
                                 f"{growth[1]:.1%}, (interval, kB) {growth[2]}"))
        if self.coordinator_exit not in (0, None):
            found.append(Finding("shutdown", None, f"the last coordinator exited with "
                                 f"{self.coordinator_exit} on SIGTERM"))
        return found

    def unknown_findings(self) -> list[Finding]:
        return [f for f in self.findings() if f.code is None]

    def exposed_generations(self) -> list[int]:
        return [g.index for g in self.generations if g.started_into_running_wave]

    def lines(self) -> list[str]:
        cfg = self.config
        out = [f"chaos run: {cfg.engines} engines, {cfg.frontends} frontends, "
               f"{cfg.rate:g} req/s, {len(self.intervals)} intervals of {cfg.interval_s:g} s, "
               f"{self.wall_s:.1f} s wall"]
        kinds = Counter(e.kind for e in self.events)
        out.append(f"events: {dict(kinds)}; coordinator processes {len(self.coordinator_pids)}, "
                   f"engine generations {len(self.generations)}"
                   + (f"; schedule ABORTED: {self.aborted}" if self.aborted else ""))
        for event in self.events:
            out.append(f"  {event.at:7.2f} s {event.kind:<11} {event.seconds:5.2f} s  "
                       f"{event.detail}")
        t = self.tallies
        order = ["submitted", "completed_once", "completed_more_than_once",
                 "failed_notice", "failed_notice_then_completed", "refused",
                 "refused_then_completed", "timed_out_then_completed",
                 "timed_out_never_completed", "covered_by_engine_dead", "lost"]
        out.append("requests: " + ", ".join(f"{k}={t[k]}" for k in order))
        if self.refused_by_code:
            out.append(f"  refused by code: {dict(self.refused_by_code)}")
        if self.lost:
            out.append(f"  lost (first {len(self.lost)}): " + "; ".join(self.lost))
        hangs = self.hang_classes()
        out.append(f"collective hangs: deliberate {len(hangs['deliberate'])} (peers of a killed "
                   f"rank, which never arrives), in generations started into a stale running "
                   f"wave {len(hangs['stale_running_wave'])}, unexplained "
                   f"{len(hangs['unexplained'])}")
        out.append("generations (index, coordinator (wave, running) at start, s to ready, "
                   "killed ranks, exits by themselves):")
        for g in self.generations:
            ready = "never" if g.ready_at is None else f"{g.ready_at - g.started_at:.1f}"
            out.append(f"  {g.index}: {g.coordinator_at_start} ready {ready} killed "
                       f"{sorted(g.killed_ranks)} exits "
                       f"{g.unexpected_exits or g.consequential_exits or {}}")
        growth = self.rss_growth()
        if growth is not None:
            pid, ratio, samples = growth
            out.append(f"coordinator RSS (pid {pid}, kB at the end of intervals "
                       f"{[s[0] for s in samples]}): {[s[1] for s in samples]} -> "
                       f"{ratio:+.1%}")
        out.append("all RSS samples (interval, pid, kB): "
                   + ", ".join(f"({i.index}, {i.coordinator_pid}, {i.rss_kb})"
                               for i in self.intervals))
        if self.final_state:
            out.append(f"final state: wave {self.final_state.get('wave')}, running "
                       f"{self.final_state.get('running')}, ranks "
                       f"{self.final_state.get('rank_states')}, in flight "
                       f"{self.final_state.get('in_flight')}")
        if self.load_summary:
            s = self.load_summary
            out.append(f"loadgen: arrivals {s.get('arrivals')} completed {s.get('completed')} "
                       f"failed {s.get('failed')} refused {s.get('refused')} lost "
                       f"{s.get('lost')} stalls {s.get('stalls')} engine_dead notices "
                       f"{s.get('engine_dead_notices')} waves {s.get('waves_completed')}")
        for finding in self.findings():
            label = f"known: {finding.code}" if finding.code else "NEW"
            out.append(f"FINDING {finding.category} [{label}] {finding.text}")
        return out


def classify_requests(load: ChaosLoad, report: ChaosReport, *, max_lost: int = 20) -> None:
    """Put every request in exactly one class (see the module docstring)."""
    t = report.tallies
    events = sorted(report.events, key=lambda e: e.at)
    origin = report.origin
    for record in load.records.values():
        finishes = load.finish_counts.get(record.request_id, 0)
        t["submitted"] += 1
        # One class each: a refusal first (refused_then_completed is a mark beside
        # it), then a repeat, then what came before the one finish. A submit that
        # timed out (or was reported failed) and then finished is in that class only,
        # never in completed_once too: on a loaded machine submit timeouts are common,
        # and counting them twice broke "exactly one class".
        if record.refused is not None:
            t["refused"] += 1
            report.refused_by_code[record.refused] += 1
            if finishes:
                t["refused_then_completed"] += 1
            continue
        if finishes:
            if finishes > 1:
                t["completed_more_than_once"] += 1
            elif record.failed is not None:
                t["failed_notice_then_completed"] += 1
            elif record.submit_timed_out:
                t["timed_out_then_completed"] += 1
            else:
                t["completed_once"] += 1
            continue
        if record.failed is not None:
            t["failed_notice"] += 1
        elif record.submit_timed_out:
            t["timed_out_never_completed"] += 1
        elif any(at >= record.submitted_at
                 for at in load.engine_dead_at.get(record.client_index, [])):
            t["covered_by_engine_dead"] += 1
        else:
            t["lost"] += 1
            submitted = record.submitted_at - origin
            if any(kill >= submitted for kill in report.coordinator_kills):
                report.lost_after_coordinator_kill += 1
            if len(report.lost) < max_lost:
                report.lost.append(_describe_lost(record, events, origin))


def _describe_lost(record: RequestRecord, events: Sequence[EventRecord], origin: float) -> str:
    at = record.submitted_at - origin
    before = [e for e in events if e.at <= at]
    after = [e for e in events if e.at > at]
    prev = f"after {before[-1].kind}@{before[-1].at:.1f}s" if before else "before any event"
    nxt = f", before {after[0].kind}@{after[0].at:.1f}s" if after else ""
    return (f"{record.request_id} rank={record.rank} submitted@{at:.2f}s steps="
            f"{record.decode_steps} ({prev}{nxt})")


# ---------------------------------------------------------------- the run


class FrontendDeaf(RuntimeError):
    """The live coordinator stopped answering frontend calls; the schedule stops there."""


class ChaosRun:
    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.children = Children()
        self.owned_workdir = config.workdir is None
        self.workdir = config.workdir or tempfile.mkdtemp(prefix="dpc-chaos-")
        self.ipc_dir = os.path.join(self.workdir, "ipc")
        os.makedirs(self.ipc_dir, exist_ok=True)
        self.state_path = os.path.join(self.workdir, "state.json")
        self.coordinator: CoordinatorHandle | None = None
        self.coordinator_index = 0
        self.coordinator_up_since: float | None = None
        self.generation: Generation | None = None
        self.load: ChaosLoad | None = None
        self.origin = time.monotonic()
        self.report = ChaosReport(config, origin=self.origin)
        self.use_state_file = config.state_file
        self.last_query_error: str | None = None
        self.last_state: Any = None
        self.unanswered_in_a_row = 0

    def log(self, message: str) -> None:
        self.config.log(f"[chaos {time.monotonic() - self.origin:7.2f} s] {message}")

    def note(self, category: str, code: str | None, text: str) -> None:
        self.report.notes.append(Finding(category, code, text))
        self.log(f"finding: {text}")

    # -- coordinator

    def _coordinator_args(self) -> list[str]:
        cfg = self.config
        args = ["--ipc-dir", self.ipc_dir, "--lease-ttl-s", str(cfg.lease_ttl_s),
                "--log-level", "info"]
        if self.use_state_file:
            args += ["--state-file", self.state_path]
        return args + list(cfg.coordinator_args)

    async def start_coordinator(self) -> CoordinatorHandle:
        self.coordinator_index += 1
        addr_file = os.path.join(self.workdir, f"coordinator-{self.coordinator_index}.json")
        loop = asyncio.get_running_loop()
        handle = await loop.run_in_executor(None, lambda: launch(
            engines=self.config.engines, frontends=self.config.frontends,
            addr_file=addr_file, extra_args=self._coordinator_args(), timeout=30.0))
        self.children.adopt(handle.process)
        self.coordinator = handle
        self.coordinator_up_since = time.monotonic()
        self.last_state = None
        self.report.coordinator_pids.append(handle.pid)
        self.log(f"coordinator #{self.coordinator_index} up, pid {handle.pid}")
        return handle

    async def kill_coordinator(self) -> None:
        handle = self.coordinator
        if handle is None:
            return
        self.coordinator_up_since = None
        kill9(handle.process)
        await wait_exit(handle.process, 10.0)
        self.report.coordinator_kills.append(time.monotonic() - self.origin)
        self.log(f"coordinator pid {handle.pid} killed (-9)")

    @property
    def deaf(self) -> bool:
        """Calls went unanswered for long, even after a nudge (see `_nudge`)."""
        return self.unanswered_in_a_row >= 6

    # -- engines

    @staticmethod
    def engine_id(generation: int, rank: int) -> str:
        return f"chaos-g{generation}-r{rank}"

    def _engine_args(self, generation: int, rank: int, hub: str) -> list[str]:
        cfg = self.config
        return [
            sys.executable, "-m", "coordinator.sim", "engine",
            "--rank", str(rank), "--engines", str(cfg.engines),
            "--engine-id", self.engine_id(generation, rank),
            "--handshake", self.addresses["handshake"],
            "--collective", hub,
            "--step-ms", str(cfg.step_ms),
            "--collective-timeout", str(cfg.collective_timeout_s),
            "--on-hang", "fail",
            "--heartbeat", "1.0",
            "--ready-timeout", "60",
            "--log-level", "WARNING",
        ]

    @property
    def addresses(self) -> dict[str, str]:
        if self.coordinator is None:
            raise RuntimeError("no coordinator")
        return self.coordinator.addresses

    async def start_group(self, *, attempts: int = 3) -> Generation:
        for attempt in range(1, attempts + 1):
            state = await self.query_state(timeout=2.0)
            if state is None and self.last_state is not None:
                # Unanswered (see KNOWN_ISSUES["deaf_socket"]): the last answer from this
                # coordinator process is the best estimate of its wave state.
                state = self.last_state
            gen = self._spawn_group()
            if state is not None:
                gen.coordinator_at_start = (state.wave, state.running)
            if await self._wait_group_ready(gen, timeout=30.0):
                return gen
            self.note("restarts", "deaf_socket" if self.deaf else None,
                      f"engine generation {gen.index} did not become ready (attempt {attempt}): "
                      f"exits {gen.unexpected_exits}, last rank states seen "
                      f"{gen.last_seen_states}, last state query error {self.last_query_error}")
            await self.stop_group(gen)
            if self.deaf:
                raise FrontendDeaf("frontend calls go unanswered")
        raise GroupStartFailed(f"the engine group did not start in {attempts} attempts")

    def _spawn_group(self) -> Generation:
        index = len(self.report.generations) + 1
        hub_address = f"ipc://{self.ipc_dir}/hub-{index}"
        base = os.path.join(self.workdir, f"gen{index}")
        hub = self.children.spawn(
            [sys.executable, "-m", "coordinator.sim", "hub", "--bind", hub_address,
             "--engines", str(self.config.engines), "--log-level", "WARNING"],
            stdout=f"{base}-hub.out", stderr=f"{base}-hub.err")
        engines = {}
        for rank in range(self.config.engines):
            out, err = f"{base}-rank{rank}.out", f"{base}-rank{rank}.err"
            process = self.children.spawn(self._engine_args(index, rank, hub_address),
                                          stdout=out, stderr=err)
            engines[rank] = EngineRun(rank, process, out, err)
        gen = Generation(index, hub, engines, time.monotonic() - self.origin)
        self.report.generations.append(gen)
        self.generation = gen
        self.log(f"engine generation {index} starting (pids "
                 f"{[e.process.pid for e in engines.values()]})")
        return gen

    async def _wait_group_ready(self, gen: Generation, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.deaf:
            self.check_engines(gen)
            if gen.unexpected_exits:
                return False
            state = await self.query_state(timeout=1.0)
            gen.last_seen_states = None if state is None else [
                e.state if e.engine_id == self.engine_id(gen.index, e.rank) else
                f"{e.state} (old)" for e in state.engines]
            # Leases restored from a state file may still show the previous generation.
            if state is not None and all(
                e.state == "ready" and e.engine_id == self.engine_id(gen.index, e.rank)
                for e in state.engines
            ):
                gen.ready_at = time.monotonic() - self.origin
                self.log(f"engine generation {gen.index} ready after "
                         f"{gen.ready_at - gen.started_at:.2f} s")
                return True
            await asyncio.sleep(0.1)
        return False

    def check_engines(self, gen: Generation) -> None:
        """Record engines that exited by themselves (unexpected unless a peer was killed)."""
        if gen.stopped_at is not None:
            return
        for run in gen.engines.values():
            code = run.process.poll()
            if code is None or run.killed:
                continue
            if run.rank in gen.unexpected_exits or run.rank in gen.consequential_exits:
                continue
            if gen.killed_ranks:
                gen.consequential_exits[run.rank] = code
            else:
                gen.unexpected_exits[run.rank] = code
                self.log(f"generation {gen.index} rank {run.rank} exited by itself, code {code}")

    async def kill_ranks(self, gen: Generation, ranks: Sequence[int]) -> None:
        for rank in ranks:
            run = gen.engines[rank]
            run.killed = True
            kill9(run.process)
            gen.killed_ranks.add(rank)
        gen.killed_at = time.monotonic() - self.origin
        self.log(f"generation {gen.index}: killed (-9) ranks {sorted(ranks)}")

    async def stop_group(self, gen: Generation) -> None:
        """Stop every rank still running (SIGTERM: they print their reports) and the hub."""
        gen.stopped_at = time.monotonic() - self.origin
        results = await asyncio.gather(*(terminate(run.process)
                                         for run in gen.engines.values()))
        for run, (code, forced) in zip(gen.engines.values(), results, strict=True):
            run.exit_code = code
            run.had_to_kill = forced
        await terminate(gen.hub)
        for run in gen.engines.values():
            with contextlib.suppress(OSError), open(run.stdout) as handle:
                for line in handle:
                    with contextlib.suppress(json.JSONDecodeError):
                        value = json.loads(line)
                        if isinstance(value, dict):
                            gen.summaries.append(value)

    # -- frontends

    async def query_state(self, timeout: float = 1.0) -> Any:
        if self.load is None or not self.load.clients:
            return None
        try:
            state = await self.load.clients[0].query_state(timeout=timeout)
        except FrontendError as exc:
            self.last_query_error = f"{type(exc).__name__}: {exc}; {self.frontend_health()}"
            return None
        self.last_query_error = None
        self.last_state = state
        return state

    def frontend_health(self) -> str:
        """What the frontend SDK's own tasks say, for a report when calls stop working."""
        if self.load is None:
            return ""
        parts = []
        for client in self.load.clients:
            ended = []
            for task in getattr(client, "_tasks", []):
                if task.done():
                    exc = None if task.cancelled() else task.exception()
                    ended.append(f"{task.get_name()}: {exc!r}")
            parts.append(f"frontend {client.client_index}: ended tasks {ended or 'none'}, "
                         f"publishes {client.stats['publishes']}, "
                         f"timeouts {client.stats['timeouts']}")
        return "; ".join(parts)

    async def _watch_frontend(self) -> None:
        """Ask for the state every half second while the coordinator should be up.

        A live process that keeps publishing but answers nothing on `frontend` for
        three queries in a row is deaf there (see KNOWN_ISSUES["deaf_socket"]). That is
        recorded, and then a message on a new connection is sent: it makes libzmq
        signal the socket again, which wakes a reader that missed its signal, so the
        rest of the schedule still runs. If even that does not help, `deaf` turns
        true and the schedule stops.
        """
        while True:
            await asyncio.sleep(0.5)
            handle = self.coordinator
            up = self.coordinator_up_since
            if handle is None or up is None or time.monotonic() - up < 2.0:
                self.unanswered_in_a_row = 0
                continue
            state = await self.query_state(timeout=1.0)
            if state is not None:
                if self.unanswered_in_a_row >= 3:
                    self.report.nudges_that_helped += 1
                    self.log("frontend calls are answered again after the nudge")
                self.unanswered_in_a_row = 0
                continue
            if not handle.is_alive() or self.coordinator_up_since != up:
                continue
            self.report.unanswered_queries += 1
            self.unanswered_in_a_row += 1
            if self.unanswered_in_a_row == 3:
                self.report.deaf_episodes += 1
                if self.report.deaf_since is None:
                    self.report.deaf_since = time.monotonic() - self.origin - 1.5
                self.log(f"the live coordinator stopped answering frontend calls: "
                         f"{self.last_query_error}; nudging it from a new connection")
                self._nudge()

    def _nudge(self) -> None:
        """Send one state query on a brand-new DEALER connection (and drop it)."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.addresses["frontend"])
            sock.send(msgspec.msgpack.encode(["state", 1]))
            sock.poll(500)
        finally:
            sock.close(0)

    # -- events

    async def event_engine(self) -> str:
        gen = self.generation
        if gen is None:
            return "no group"
        victims = self.rng.sample(range(self.config.engines), self.rng.choice([1, 1, 2]))
        await self.kill_ranks(gen, victims)
        # Long enough for the survivors' collectives to time out (deliberate hangs).
        await asyncio.sleep(self.config.collective_timeout_s + 1.0)
        self.check_engines(gen)
        await self.stop_group(gen)
        await asyncio.sleep(self.config.restart_gap_s)
        await self.start_group()
        return f"killed ranks {sorted(victims)} of generation {gen.index}"

    async def event_coordinator(self) -> str:
        old = self.coordinator.pid if self.coordinator else None
        await self.kill_coordinator()
        await asyncio.sleep(self.config.restart_gap_s)
        await self.start_coordinator()
        if not await self._wait_ranks_ready(10.0):
            self.note("restarts", "deaf_socket" if self.deaf else None,
                      f"after coordinator restart #{self.coordinator_index} the ranks were not "
                      f"all ready within 10 s ({self.last_query_error})")
        return f"killed coordinator pid {old}"

    async def event_both(self) -> str:
        gen = self.generation
        old = self.coordinator.pid if self.coordinator else None
        await self.kill_coordinator()
        victims: list[int] = []
        if gen is not None:
            victims = [self.rng.randrange(self.config.engines)]
            await self.kill_ranks(gen, victims)
        await asyncio.sleep(self.config.collective_timeout_s + 1.0)
        await self.start_coordinator()
        if gen is not None:
            self.check_engines(gen)
            await self.stop_group(gen)
        await asyncio.sleep(self.config.restart_gap_s)
        await self.start_group()
        return f"killed coordinator pid {old} and, while it was down, ranks {victims}"

    async def _wait_ranks_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = await self.query_state(timeout=1.0)
            if state is not None and all(e.state == "ready" for e in state.engines):
                return True
            await asyncio.sleep(0.1)
        return False

    # -- the whole run

    async def run(self) -> ChaosReport:
        cfg = self.config
        started = time.monotonic()
        if self.use_state_file is None:
            self.use_state_file = serve_supports("--state-file")
        self.log(f"workdir {self.workdir}; state file: {self.use_state_file}; schedule "
                 f"{cfg.schedule}")
        try:
            await self._run()
        finally:
            self.report.wall_s = time.monotonic() - started
            self.children.kill_all()
            if self.load is not None:
                with contextlib.suppress(Exception):
                    await self.load.close()
            if self.owned_workdir and not self.report.findings():
                shutil.rmtree(self.workdir, ignore_errors=True)
        return self.report

    async def _run(self) -> None:
        cfg = self.config
        await self.start_coordinator()
        load_cfg = LoadConfig(
            frontends=cfg.frontends, rate=cfg.rate,
            duration_s=10 * cfg.interval_s * (len(cfg.schedule) + 1) + 600,
            steps_median=cfg.steps_median, steps_max=cfg.steps_max,
            burst_on_s=cfg.burst_on_s, burst_off_s=cfg.burst_off_s,
            drain_timeout_s=cfg.drain_timeout_s, stall_s=60.0, seed=cfg.seed,
        )
        self.load = ChaosLoad(self.addresses, load_cfg)
        await self.load.start()
        await self.start_group()
        await self.load.wait_ready(timeout_s=30.0)
        load_task = asyncio.ensure_future(self.load.run())
        watcher = asyncio.ensure_future(self._watch_frontend())
        try:
            try:
                for index in range(len(cfg.schedule) + 1):
                    event = cfg.schedule[index] if index < len(cfg.schedule) else None
                    await self._interval(index + 1, event)
                    if load_task.done():
                        break
                    if event is not None:
                        await self._event(event)
            except (GroupStartFailed, FrontendDeaf) as exc:
                self.report.aborted = str(exc)
                self.log(f"schedule aborted: {exc}")
            self.load.stop_arrivals.set()
            summary = await asyncio.wait_for(load_task, cfg.drain_timeout_s + 30.0)
            self.report.load_summary = summary.to_dict()
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
            if not load_task.done():
                load_task.cancel()
                with contextlib.suppress(BaseException):
                    await load_task
        classify_requests(self.load, self.report)
        await self._final_checks()

    async def _interval(self, index: int, event: str | None) -> None:
        start = time.monotonic()
        end = start + self.config.interval_s
        while time.monotonic() < end:
            await asyncio.sleep(min(0.2, max(0.0, end - time.monotonic())))
            if self.generation is not None:
                self.check_engines(self.generation)
            if self.deaf:
                raise FrontendDeaf("the live coordinator stopped answering frontend calls")
        handle = self.coordinator
        pid = handle.pid if handle else -1
        self.report.intervals.append(Interval(
            index, start - self.origin, time.monotonic() - self.origin, pid, rss_kb(pid), event))
        if self.generation is not None and self.generation.unexpected_exits:
            # Recover as a deployment would: restart the whole group.
            self.log("an engine died by itself; restarting the group")
            await self._event("recovery")

    async def _event(self, kind: str) -> None:
        at = time.monotonic()
        if kind == "engine":
            detail = await self.event_engine()
        elif kind == "coordinator":
            detail = await self.event_coordinator()
        elif kind == "both":
            detail = await self.event_both()
        elif kind == "recovery":
            gen = self.generation
            if gen is not None:
                await self.stop_group(gen)
            await asyncio.sleep(self.config.restart_gap_s)
            await self.start_group()
            detail = "restarted the group after an unexpected engine exit"
        else:
            raise ValueError(kind)
        record = EventRecord(kind, at - self.origin, detail, time.monotonic() - at)
        self.report.events.append(record)
        self.log(f"event {kind} done in {record.seconds:.2f} s: {detail}")

    async def _final_checks(self) -> None:
        report = self.report
        last = self.generation
        stale = "stale_running_wave" if last is not None and last.started_into_running_wave \
            else None
        state = await self.query_state(timeout=3.0)
        if state is None:
            self.note("frontend", "deaf_socket" if report.deaf_since is not None else None,
                      f"the coordinator did not answer the final state query "
                      f"({self.last_query_error})")
        else:
            report.final_state = {
                "wave": state.wave, "running": state.running, "in_flight": state.in_flight,
                "rank_states": [e.state for e in state.engines],
                "internal_errors": {k: v for k, v in state.counters.items()
                                    if k.startswith("internal_error")},
                "counters": dict(state.counters),
            }
            if state.running:
                self.note("waves", stale, f"the group is still running wave {state.wave} after the "
                                 "load drained (a wave that never ended)")
            if any(e.state != "ready" for e in state.engines):
                self.note("restarts", stale, f"ranks not ready at the end: "
                                 f"{[e.state for e in state.engines]}")
            if report.final_state["internal_errors"]:
                self.note("shutdown", None, f"coordinator handler errors: "
                                f"{report.final_state['internal_errors']}")
        if self.generation is not None:
            self.check_engines(self.generation)
            await self.stop_group(self.generation)
        if self.load is not None:
            await self.load.close()
            self.load = None
        if self.coordinator is not None:
            code, _ = await terminate(self.coordinator.process, 5.0)
            report.coordinator_exit = code


async def run_chaos(config: ChaosConfig) -> ChaosReport:
    return await ChaosRun(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.chaos",
        description="Kill -9 simulated engines and the coordinator under load from two "
        "frontends, then account for every request, every hang and the coordinator's memory.",
    )
    parser.add_argument("--seconds", type=float, default=300.0,
                        help="approximate length of the run (default 300)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="seconds of load between chaos events (default 5)")
    parser.add_argument("--schedule", default=None,
                        help="comma-separated events (engine, coordinator, both) instead of "
                        "a random schedule")
    parser.add_argument("--no-state-file", action="store_true",
                        help="restart the coordinator without --state-file")
    parser.add_argument("--workdir", default=None,
                        help="keep logs here (default: a temp dir, removed on success)")
    parser.add_argument("--coordinator-args", default="",
                        help="extra flags for every coordinator, e.g. "
                        "'--watchdog-rewake --watchdog-stall-s 1'")
    parser.add_argument("--json", default=None, help="also write the tallies as JSON here")
    args = parser.parse_args(argv)
    # A SIGTERM (e.g. from `timeout`) unwinds like an exception, so every child
    # process this run started is still killed in its `finally`.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.schedule:
        config = ChaosConfig(schedule=[s.strip() for s in args.schedule.split(",") if s.strip()],
                             seed=args.seed, interval_s=args.interval)
    else:
        config = ChaosConfig.random_schedule(args.seconds, seed=args.seed,
                                             interval_s=args.interval)
    config.engines = args.engines
    config.rate = args.rate
    config.workdir = args.workdir
    config.coordinator_args = args.coordinator_args.split()
    if args.no_state_file:
        config.state_file = False
    unknown = [e for e in config.schedule if e not in EVENTS]
    if unknown:
        parser.error(f"unknown events {unknown}; use {', '.join(EVENTS)}")
    report = asyncio.run(run_chaos(config))
    for line in report.lines():
        print(line)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tallies": dict(report.tallies),
                       "findings": [f.__dict__ for f in report.findings()],
                       "events": [e.__dict__ for e in report.events],
                       "load": report.load_summary, "final_state": report.final_state},
                      handle, indent=2, default=str)
    return 0 if not report.findings() else 1


if __name__ == "__main__":
    raise SystemExit(main())
