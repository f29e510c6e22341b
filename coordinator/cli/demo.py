"""`dp-coordinator demo`: a coordinator, simulated engines and load, all at once.

Three kinds of process, as in a real deployment:

1. the coordinator (`python -m coordinator serve`, via `coordinator.launch`);
2. one process running every simulated engine of the group
   (`python -m coordinator.sim group`), lockstep unless `--no-wave-coordination`;
3. this process: K frontends (`coordinator.loadgen`) submitting Poisson load in
   bursts (1.5 s of load, 1 s quiet, mean rate `--rate`), so that in lockstep
   mode the group pauses between bursts and every burst begins with a wake.

While the load runs, a live view shows every rank's published load, its state
from a state query, how many requests went to it and finished on it, and the
wave. At the end a summary says how many requests were submitted, completed,
failed and lost, how many waves ran, how evenly the work was spread and how long
the wake of a paused group took. In lockstep mode the demo then asks the
coordinator until the group is paused (every wave ended once the work was done)
and counts the waves up to that point. The exit code is 0 only when nothing was
lost and no hang was seen (no stall in completions, no collective hang reported
by an engine, no wave still running `DEMO_PAUSE_WAIT_S` after the last request
finished). Every child process is stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from coordinator._zmq import die_with_parent_preexec, run_loop
from coordinator.frontend import FrontendError
from coordinator.launch import CoordinatorHandle, LaunchError, launch, stop_process
from coordinator.loadgen import LoadConfig, LoadGenerator, LoadSummary
from coordinator.protocol import frontend as fp

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_SETUP = 2
EXIT_INTERRUPTED = 130

# Load comes in bursts with quiet gaps long enough for the group to go idle, so a
# lockstep run shows many waves, each started by a wake. The longest request
# (DEMO_STEPS_MAX steps of 5 ms) fits in a gap.
DEMO_BURST_ON_S = 1.5
DEMO_BURST_OFF_S = 1.0
DEMO_STEPS_MAX = 128

# `python -m coordinator.sim`'s exit status when an engine died of a collective hang.
SIM_EXIT_HANG = 3

# Once every request finished, a lockstep group ends its wave within a few steps;
# one still running after this long is stuck.
DEMO_PAUSE_WAIT_S = 10.0


@dataclass
class DemoResult:
    summary: LoadSummary | None = None
    engine_reports: list[dict[str, Any]] = field(default_factory=list)
    sim_exit: int | None = None
    coordinator_counters: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    group_paused: bool | None = None
    """Lockstep only: whether the coordinator said the group paused after the run."""

    @property
    def engine_hangs(self) -> int:
        return sum(len(r.get("hangs") or []) for r in self.engine_reports)

    @property
    def hang_detected(self) -> bool:
        stalls = self.summary.stalls if self.summary is not None else 0
        return (stalls > 0 or self.engine_hangs > 0 or self.sim_exit == SIM_EXIT_HANG
                or self.group_paused is False)

    @property
    def healthy(self) -> bool:
        return (
            self.error is None
            and self.summary is not None
            and self.summary.lost == 0
            and not self.hang_detected
        )


class SimProcess:
    """The simulated engine group, as a child process with its output in files."""

    def __init__(self, args: argparse.Namespace, addr_file: str, workdir: str) -> None:
        self.stdout_path = os.path.join(workdir, "sim.stdout")
        self.stderr_path = os.path.join(workdir, "sim.stderr")
        cmd = [
            sys.executable, "-m", "coordinator.sim", "group",
            "--engines", str(args.engines),
            "--addr-file", addr_file,
            "--log-level", "WARNING",
            "--on-hang", "wait",
        ]
        if args.no_wave_coordination:
            cmd.append("--dense")
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True, preexec_fn=die_with_parent_preexec(),
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> int | None:
        return stop_process(self.process, timeout)

    def reports(self) -> list[dict[str, Any]]:
        reports: list[dict[str, Any]] = []
        with contextlib.suppress(OSError), open(self.stdout_path) as handle:
            for line in handle:
                with contextlib.suppress(json.JSONDecodeError):
                    value = json.loads(line)
                    if isinstance(value, dict):
                        reports.append(value)
        return reports

    def stderr_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError), open(self.stderr_path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
        return ""


# ---------------------------------------------------------------- the live view


class LiveView:
    """Renders the group from publishes (loads, wave) and state queries (membership)."""

    def __init__(self, gen: LoadGenerator, duration_s: float) -> None:
        self.gen = gen
        self.duration_s = duration_s
        self.state: fp.GroupState | None = None
        self.state_error: str | None = None
        self.started = time.monotonic()

    async def poll_state(self) -> None:
        while True:
            try:
                self.state = await self.gen.clients[0].query_state(timeout=1.0)
                self.state_error = None
            except FrontendError as exc:
                self.state_error = str(exc)
            await asyncio.sleep(0.5)

    def render(self) -> Group:
        gen = self.gen
        totals = gen.totals()
        elapsed = time.monotonic() - self.started
        running = gen.running
        header = Text.assemble(
            ("dp-coordinator demo  ", "bold"),
            (f"wave {gen.wave} ", "cyan"),
            ("running" if running else "paused", "green" if running else "yellow"),
            f"   {gen.phase}  {elapsed:5.1f}/{self.duration_s:g} s   ",
            f"arrivals {totals['arrivals']}  in flight {totals['in_flight']}  "
            f"done {totals['completed']}  failed {totals['failed']}  "
            f"refused {totals['refused']}  wakes {totals['wakes']}",
        )
        table = Table(expand=False, title_justify="left")
        for name, justify in (("rank", "right"), ("state", "left"), ("waiting", "right"),
                              ("running", "right"), ("kv", "right"), ("in flight", "right"),
                              ("dispatched", "right"), ("done", "right"),
                              ("decode steps", "right")):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        counts = gen.counts() or []
        statuses = {e.rank: e for e in self.state.engines} if self.state else {}
        ranks = sorted(set(statuses) | set(range(len(counts))) | set(gen.work))
        for rank in ranks:
            waiting, run, kv = counts[rank] if rank < len(counts) else (0, 0, 0.0)
            status = statuses.get(rank)
            work = gen.work.get(rank)
            state = status.state if status else "?"
            style = "green" if state == "ready" else "red"
            table.add_row(
                str(rank), Text(state, style=style), str(waiting), str(run), f"{kv:.0%}",
                str(status.in_flight) if status else "-",
                str(work.dispatched if work else 0), str(work.completed if work else 0),
                str(work.decode_steps if work else 0),
            )
        parts: list[Any] = [header, table]
        if self.state_error:
            parts.append(Text(f"state query: {self.state_error}", style="red"))
        if totals["stalls"]:
            parts.append(Text(f"stalls: {totals['stalls']} (no completion for a while "
                              "with requests outstanding)", style="bold red"))
        return Group(*parts)


# ---------------------------------------------------------------- the summary


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def summary_tables(result: DemoResult) -> Group:
    s = result.summary
    parts: list[Any] = []
    table = Table(title="summary", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    if s is not None:
        rows: list[tuple[str, str]] = [
            ("frontends", str(s.frontends)),
            ("load (s) / drain (s)", f"{s.load_seconds:.1f} / {s.drain_seconds:.1f}"),
            ("arrivals (rate/s)", f"{s.arrivals} ({s.rate:g})"),
            ("submitted", str(s.submitted)),
            ("completed", str(s.completed)),
            ("failed", str(s.failed)),
            ("refused", f"{s.refused} {s.refused_by_code or ''}".strip()),
            ("submit timeouts", str(s.submit_timeouts)),
            ("lost", str(s.lost)),
            ("waves completed", f"{s.waves_completed} (wave {s.first_wave} -> {s.last_wave})"),
            ("group paused at the end", {None: "-", True: "yes",
                                         False: "no: a wave never ended"}[result.group_paused]),
            ("balance ratio (mean/max decode steps)", _fmt(s.balance_ratio)),
            ("submits that woke the group", str(s.wakes)),
            ("wake: submit -> reply p50 / p99",
             f"{_fmt(s.wake_reply_ms_p50, ' ms')} / {_fmt(s.wake_reply_ms_p99, ' ms')}"),
            ("wake: submit -> running published p50 / p99",
             f"{_fmt(s.wake_running_ms_p50, ' ms')} / {_fmt(s.wake_running_ms_p99, ' ms')}"),
            ("wake: submit -> finish p50 / p99",
             f"{_fmt(s.wake_finish_ms_p50, ' ms')} / {_fmt(s.wake_finish_ms_p99, ' ms')}"),
            ("all: submit -> reply p50 / p99",
             f"{_fmt(s.reply_ms_p50, ' ms')} / {_fmt(s.reply_ms_p99, ' ms')}"),
            ("all: submit -> finish p50 / p99",
             f"{_fmt(s.latency_ms_p50, ' ms')} / {_fmt(s.latency_ms_p99, ' ms')}"),
            ("throughput", f"{s.throughput_rps:.1f} req/s"),
            ("stalls", str(s.stalls)),
        ]
        for what, value in rows:
            table.add_row(what, value)
    table.add_row("engine collective hangs", str(result.engine_hangs))
    parts.append(table)
    if s is not None and s.per_rank:
        ranks = Table(title="per rank", title_justify="left")
        for name in ("rank", "dispatched", "completed", "decode steps", "steps", "dummy steps"):
            ranks.add_column(name, justify="right")
        engine = {int(r.get("rank", -1)): r for r in result.engine_reports}
        for rank, work in s.per_rank.items():
            report = engine.get(rank, {})
            ranks.add_row(str(rank), str(work.dispatched), str(work.completed),
                          str(work.decode_steps), str(report.get("steps", "-")),
                          str(report.get("dummy_steps", "-")))
        parts.append(ranks)
    return Group(*parts)


def verdict_line(result: DemoResult) -> str:
    s = result.summary
    lost = s.lost if s is not None else "?"
    verdict = "OK" if result.healthy else "FAILED"
    hang = "yes" if result.hang_detected else "no"
    line = f"result: {verdict}  lost = {lost}  hang = {hang}"
    if result.error:
        line += f"  error: {result.error}"
    return line


# ---------------------------------------------------------------- the run


async def _run(args: argparse.Namespace, console: Console, result: DemoResult,
               coordinator: CoordinatorHandle, sim: SimProcess) -> None:
    config = LoadConfig(
        frontends=args.frontends,
        rate=args.rate,
        duration_s=args.duration,
        seed=args.seed,
        host=args.host,
        burst_on_s=DEMO_BURST_ON_S,
        burst_off_s=DEMO_BURST_OFF_S,
        steps_max=DEMO_STEPS_MAX,
    )
    gen = LoadGenerator(coordinator.addresses, config)
    try:
        if not args.no_live:
            console.print(f"starting {args.engines} simulated engines and {args.frontends} "
                          "frontends ...")
        await gen.start()
        ready = asyncio.ensure_future(gen.wait_ready(timeout_s=60.0))
        while not ready.done():
            await asyncio.wait([ready], timeout=0.2)
            if not sim.alive() and not ready.done():
                ready.cancel()
                raise RuntimeError(f"the simulated engines exited with code "
                                   f"{sim.process.returncode}:\n{sim.stderr_tail()}")
            if not coordinator.is_alive() and not ready.done():
                ready.cancel()
                raise RuntimeError(f"the coordinator exited with code "
                                   f"{coordinator.returncode}")
        ready.result()
        if args.no_live:
            result.summary = await gen.run()
        else:
            view = LiveView(gen, args.duration)
            poller = asyncio.ensure_future(view.poll_state())
            try:
                with Live(view.render(), console=console, refresh_per_second=8,
                          transient=False) as live:
                    run = asyncio.ensure_future(gen.run())
                    while not run.done():
                        await asyncio.wait([run], timeout=0.125)
                        live.update(view.render())
                    result.summary = run.result()
                    with contextlib.suppress(FrontendError):
                        # The final frame shows the settled state, not the last poll.
                        view.state = await gen.clients[0].query_state(timeout=1.0)
                    live.update(view.render())
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
        with contextlib.suppress(FrontendError):
            state = await gen.clients[0].query_state(timeout=2.0)
            if not args.no_wave_coordination and result.summary is not None:
                state = await _wait_for_pause(gen, state)
                result.group_paused = not state.running
                # Count the waves up to the settled state, not up to the last publish.
                result.summary = dataclasses.replace(
                    result.summary, last_wave=state.wave,
                    waves_completed=max(0, state.wave - result.summary.first_wave))
            result.coordinator_counters = dict(state.counters)
    finally:
        if result.summary is None and gen.records:
            # Interrupted or failed mid-run: still say what happened so far.
            result.summary = gen.summary()
        await gen.close()


async def _wait_for_pause(gen: LoadGenerator, state: fp.GroupState) -> fp.GroupState:
    """The coordinator's state once the group paused, or after `DEMO_PAUSE_WAIT_S`."""
    deadline = time.monotonic() + DEMO_PAUSE_WAIT_S
    while state.running and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        state = await gen.clients[0].query_state(timeout=2.0)
    return state


async def _main(args: argparse.Namespace, console: Console, result: DemoResult,
                coordinator: CoordinatorHandle, sim: SimProcess) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(_run(args, console, result, coordinator, sim))
    interrupted: list[str] = []

    def interrupt(name: str) -> None:
        interrupted.append(name)
        task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupt, signal.Signals(signum).name)
    try:
        await task
    except asyncio.CancelledError:
        if not interrupted:
            raise
        result.error = f"interrupted ({interrupted[0]})"
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run a coordinator with simulated engines under load (what `make demo` runs)",
        description="Start a coordinator, N simulated lockstep engines and a load generator "
        "with several frontends; show a live view of every rank, then a summary: requests "
        "completed and lost, waves, balance ratio and first-request wake latency.",
    )
    p.add_argument("--engines", type=int, default=4, metavar="N", help="simulated DP ranks "
                   "(default 4)")
    p.add_argument("--frontends", type=int, default=2, metavar="K",
                   help="frontends generating load (default 2)")
    p.add_argument("--duration", type=float, default=20.0, metavar="S",
                   help="seconds of load (default 20)")
    p.add_argument("--rate", type=float, default=200.0, metavar="R",
                   help="mean request arrivals per second over all frontends, Poisson "
                   "(default 200)")
    p.add_argument("--host", default=None, metavar="H",
                   help="use tcp on H (e.g. 127.0.0.1) instead of ipc")
    p.add_argument("--no-wave-coordination", action="store_true", help="dense mode")
    p.add_argument("--seed", type=int, default=None, help="random seed for the load")
    p.add_argument("--no-live", action="store_true",
                   help="no live terminal view; print only the summary")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the summary as JSON to FILE")


def _validate(args: argparse.Namespace) -> str | None:
    if args.engines < 1:
        return "--engines must be at least 1"
    if args.frontends < 1:
        return "--frontends must be at least 1"
    if not args.duration > 0:
        return "--duration must be positive"
    if not args.rate > 0:
        return "--rate must be positive"
    return None


def run_demo(args: argparse.Namespace) -> int:
    console = Console()
    problem = _validate(args)
    if problem:
        console.print(f"[red]dp-coordinator demo: {problem}[/red]")
        return EXIT_SETUP
    result = DemoResult()
    workdir = tempfile.mkdtemp(prefix="dp-coordinator-demo-")
    coordinator: CoordinatorHandle | None = None
    sim: SimProcess | None = None
    try:
        try:
            coordinator = launch(
                engines=args.engines,
                frontends=args.frontends,
                host=args.host,
                lockstep=not args.no_wave_coordination,
                addr_file=os.path.join(workdir, "addresses.json"),
                log_level="warning",
            )
        except LaunchError as exc:
            console.print(f"[red]could not start the coordinator:[/red] {exc}")
            return EXIT_SETUP
        sim = SimProcess(args, coordinator.addr_file, workdir)
        try:
            run_loop(_main(args, console, result, coordinator, sim))
        except KeyboardInterrupt:
            result.error = "interrupted"
        except (FrontendError, RuntimeError, ValueError, OSError) as exc:
            result.error = str(exc) or type(exc).__name__
    finally:
        if sim is not None:
            result.sim_exit = sim.stop()
            result.engine_reports = sim.reports()
        if coordinator is not None:
            coordinator.shutdown(timeout=5.0)
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    console.print(summary_tables(result))
    if result.sim_exit not in (0, None) and sim is not None:
        console.print(f"[yellow]simulated engines exited with code {result.sim_exit}[/yellow]")
    if args.json:
        payload: dict[str, Any] = {
            "summary": result.summary.to_dict() if result.summary is not None else None,
            "engines": result.engine_reports,
            "coordinator_counters": result.coordinator_counters,
            "hang_detected": result.hang_detected,
            "group_paused": result.group_paused,
            "healthy": result.healthy,
            "error": result.error,
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
            handle.write("\n")
    console.print(verdict_line(result), highlight=False, markup=False)
    if result.error is not None and result.error.startswith("interrupted"):
        return EXIT_INTERRUPTED
    return EXIT_OK if result.healthy else EXIT_UNHEALTHY
