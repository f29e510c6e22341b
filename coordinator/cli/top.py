"""`dp-coordinator top`: a live terminal view of a running coordinator.

Reads the coordinator's state either from its HTTP `/state` endpoint (`--url`,
which also carries waves started, per-rank dispatch totals and the hang
watchdog) or over its frontend socket with a `QueryState` (`--addr-file`, which
needs no HTTP port; with neither, the coordinator vLLM's plugin started on this
host, found as `status` finds it). Each refresh shows the group's wave, every
rank's state and load, and rates computed from the previous refresh: dispatches
per second and waves per second. `--once` prints one frame and exits.

"dispatched" means the same whatever the source: requests the coordinator sent
since it started, in total (its `submit.dispatched` counter) and per rank (only
`/state` carries per-rank totals; over the frontend socket that column shows
"-"). A draining rank with nothing in flight shows as `drained`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from coordinator.cli.common import (
    STATE_STYLES,
    StateQuery,
    StatusError,
    add_curve_client_arguments,
    discover_addr_file,
    read_frontend_address,
    shown_state,
)
from coordinator.core.dispatch.balancer import balance_ratio
from coordinator.protocol import frontend as fp

EXIT_OK = 0
EXIT_ERROR = 1
DISPATCH_COUNTER = "submit.dispatched"


class TopError(Exception):
    """The state could not be read; the message says what to check."""


@dataclass(frozen=True)
class TopRank:
    rank: int
    state: str
    waiting: int
    running: int
    kv_cache_usage: float
    in_flight: int
    dispatched: int | None
    """Dispatched to the rank since the coordinator started (HTTP source only)."""
    dispatched_since_report: int | None
    """Dispatched since the rank's last stats report (frontend source only; not shown)."""
    report_age_s: float | None
    cached_blocks: int | None = None
    """Blocks the prefix index holds for the rank (HTTP source, KV events followed)."""


@dataclass(frozen=True)
class TopFrame:
    """One reading of the coordinator, whatever the source."""

    taken_at: float
    source: str
    wave: int
    running: bool
    lockstep: bool
    ranks: list[TopRank]
    counters: dict[str, int] = field(default_factory=dict)
    waves_total: int | None = None
    watchdog: list[dict[str, Any]] | None = None
    """Active alerts; None when the source cannot say (frontend socket)."""
    frontends: int | None = None
    shutting_down: bool = False
    prefix: dict[str, Any] | None = None
    """The KV event plane (HTTP source), as /state's ``prefix``."""

    @property
    def dispatched_total(self) -> int | None:
        if DISPATCH_COUNTER in self.counters:
            return self.counters[DISPATCH_COUNTER]
        totals = [r.dispatched for r in self.ranks]
        if totals and all(t is not None for t in totals):
            return sum(t for t in totals if t is not None)
        return None


@dataclass(frozen=True)
class Rates:
    dispatches_per_s: float | None = None
    waves_per_s: float | None = None


def _rate(before: int | None, after: int | None, seconds: float) -> float | None:
    if before is None or after is None or after < before:
        return None  # unknown, or the coordinator restarted in between
    return (after - before) / seconds


def compute_rates(previous: TopFrame | None, current: TopFrame) -> Rates:
    """Rates between two readings; None where unknown (first reading, restarts)."""
    if previous is None:
        return Rates()
    seconds = current.taken_at - previous.taken_at
    if seconds <= 0:
        return Rates()
    if previous.waves_total is not None and current.waves_total is not None:
        waves = _rate(previous.waves_total, current.waves_total, seconds)
    else:
        # Without a count of waves started, the wave number still moves once per wave.
        waves = _rate(previous.wave, current.wave, seconds)
    return Rates(_rate(previous.dispatched_total, current.dispatched_total, seconds), waves)


# ---- reading the coordinator -----------------------------------------------------------------


def _int(value: object, default: int = 0) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else default


def _opt_float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def frame_from_state_json(data: Mapping[str, Any], *, taken_at: float, source: str) -> TopFrame:
    """A frame from the HTTP `/state` document."""
    rows = data.get("ranks")
    if not isinstance(rows, list):
        raise TopError(f"{source} returned no 'ranks' list: is it a dp-coordinator /state?")
    ranks = []
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        dispatched = row.get("dispatched")
        since = row.get("dispatched_since_report")
        ranks.append(TopRank(
            rank=_int(row.get("rank")),
            state=str(row.get("state", "?")),
            waiting=_int(row.get("waiting")),
            running=_int(row.get("running")),
            kv_cache_usage=_opt_float(row.get("kv_cache_usage")) or 0.0,
            in_flight=_int(row.get("in_flight")),
            dispatched=_int(dispatched) if dispatched is not None else None,
            dispatched_since_report=_int(since) if since is not None else None,
            report_age_s=_opt_float(row.get("report_age_s")),
        ))
    prefix = data.get("prefix")
    if isinstance(prefix, Mapping):
        cached = {_int(row.get("rank")): _int(row.get("blocks"))
                  for row in prefix.get("ranks", []) if isinstance(row, Mapping)}
        ranks = [dataclasses.replace(r, cached_blocks=cached.get(r.rank)) for r in ranks]
    counters = data.get("counters")
    watchdog = data.get("watchdog")
    waves_total = data.get("waves_total")
    frontends = data.get("frontends")
    return TopFrame(
        taken_at=taken_at,
        source=source,
        wave=_int(data.get("wave")),
        running=bool(data.get("running")),
        lockstep=bool(data.get("lockstep", True)),
        ranks=ranks,
        # The coordinator's counters start absent: one it reports without the
        # dispatch counter has dispatched nothing yet.
        counters={DISPATCH_COUNTER: 0, **{str(k): _int(v) for k, v in counters.items()}}
        if isinstance(counters, Mapping) else {},
        waves_total=_int(waves_total) if waves_total is not None else None,
        watchdog=[a for a in watchdog if isinstance(a, dict)]
        if isinstance(watchdog, list) else None,
        frontends=_int(frontends) if frontends is not None else None,
        shutting_down=bool(data.get("shutting_down", False)),
        prefix=dict(prefix) if isinstance(prefix, Mapping) else None,
    )


def frame_from_group_state(state: fp.GroupState, *, taken_at: float, source: str) -> TopFrame:
    """A frame from a `QueryState` reply on the frontend socket."""
    return TopFrame(
        taken_at=taken_at,
        source=source,
        wave=state.wave,
        running=state.running,
        lockstep=state.lockstep,
        ranks=[
            TopRank(
                rank=e.rank, state=e.state, waiting=e.waiting, running=e.running,
                kv_cache_usage=e.kv_cache_usage, in_flight=e.in_flight, dispatched=None,
                dispatched_since_report=e.dispatched_since_report,
                report_age_s=e.last_seen_age_s,
            )
            for e in state.engines
        ],
        counters={DISPATCH_COUNTER: 0, **state.counters},
        frontends=state.frontends,
        shutting_down=state.shutting_down,
    )


class StateSource(Protocol):
    def fetch(self) -> TopFrame: ...

    def close(self) -> None: ...


def state_url(url: str) -> str:
    """`--url` as given, with `/state` added when it names only the server."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/state")
    return urllib.parse.urlunsplit(parts)


class HttpSource:
    """Reads `/state` from the coordinator's HTTP endpoints."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = state_url(url)
        self.timeout_s = timeout_s

    def fetch(self) -> TopFrame:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                detail = exc.read().decode("utf-8", "replace").strip()
            raise TopError(f"{self.url} answered {exc.code}: {detail or exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TopError(f"cannot reach {self.url}: {reason} (is the coordinator running "
                           "with --metrics-port?)") from None
        try:
            data = json.loads(body)
        except ValueError:
            raise TopError(f"{self.url} did not return JSON") from None
        if not isinstance(data, dict):
            raise TopError(f"{self.url} did not return a JSON object")
        return frame_from_state_json(data, taken_at=time.monotonic(), source=self.url)

    def close(self) -> None:
        pass


class FrontendSource:
    """Asks the coordinator's frontend socket (`QueryState`)."""

    def __init__(
        self,
        addr_file: str | None,
        timeout_s: float,
        *,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
    ) -> None:
        try:
            address = read_frontend_address(addr_file or discover_addr_file())
            self._query = StateQuery(address, curve_secret_key=curve_secret_key,
                                     curve_server_key=curve_server_key)
        except (StatusError, ValueError) as exc:
            raise TopError(str(exc)) from None
        self.address = address
        self.timeout_s = timeout_s

    def fetch(self) -> TopFrame:
        try:
            state = self._query.query(self.timeout_s)
        except StatusError as exc:
            raise TopError(str(exc)) from None
        return frame_from_group_state(state, taken_at=time.monotonic(), source=self.address)

    def close(self) -> None:
        self._query.close()


# ---- rendering -------------------------------------------------------------------------------


def _fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def render(frame: TopFrame, rates: Rates, *, error: str | None = None) -> RenderableType:
    """One screen: group line, rates line, rank table, watchdog line."""
    flag = Text("running", style="bold green") if frame.running else Text("paused",
                                                                           style="yellow")
    header = Text.assemble(
        ("dp-coordinator ", "bold"), (frame.source, "dim"), "\n",
        ("wave ", "bold"), (str(frame.wave), "cyan"), " ", flag,
        f"   {'lockstep' if frame.lockstep else 'dense'}   ranks {len(frame.ranks)}",
    )
    if frame.frontends is not None:
        header.append(f"   frontends {frame.frontends}")
    if frame.waves_total is not None:
        header.append(f"   waves started {frame.waves_total}")
    if frame.shutting_down:
        header.append("   SHUTTING DOWN", style="bold red")
    ready = [r.waiting + r.running for r in frame.ranks if r.state == "ready"]
    rate_line = Text.assemble(
        ("dispatches/s ", "bold"), _fmt_rate(rates.dispatches_per_s),
        ("   waves/s ", "bold"), _fmt_rate(rates.waves_per_s),
        ("   balance ", "bold"), f"{balance_ratio(ready):.2f}" if ready else "-",
        ("   dispatched in total ", "bold"),
        "-" if frame.dispatched_total is None else str(frame.dispatched_total),
    )
    table = Table(box=None, pad_edge=False, header_style="bold")
    cached_column = any(r.cached_blocks is not None for r in frame.ranks)
    for name in ("rank", "state", "waiting", "running", "kv", "dispatched", "in flight",
                 "report age", *(("cached",) if cached_column else ())):
        table.add_column(name, justify="left" if name == "state" else "right",
                         no_wrap=name == "state", overflow="fold")
    for r in frame.ranks:
        shown = shown_state(r.state, r.in_flight)
        table.add_row(
            str(r.rank), Text(shown, style=STATE_STYLES.get(shown, "bold red")),
            str(r.waiting), str(r.running), f"{r.kv_cache_usage:.0%}",
            "-" if r.dispatched is None else str(r.dispatched),
            str(r.in_flight), "-" if r.report_age_s is None else f"{r.report_age_s:.1f}s",
            *((str(r.cached_blocks) if r.cached_blocks is not None else "-",)
              if cached_column else ()),
        )
    totals_only = any(r.dispatched is None for r in frame.ranks)
    parts: list[RenderableType] = [header, rate_line]
    prefix_line = _prefix_line(frame)
    if prefix_line is not None:
        parts.append(prefix_line)
    parts += [table, Text(
        "dispatched: requests sent since the coordinator started"
        + (" (per rank only over --url)" if totals_only else "")
        + "; drained: draining with nothing in flight"
        + ("; cached: blocks in the rank's prefix cache" if cached_column else ""),
        style="dim")]
    parts.append(_watchdog_line(frame.watchdog))
    if error is not None:
        parts.append(Text(f"{error}; showing the last reading", style="bold red"))
    return Group(*parts)


def _prefix_line(frame: TopFrame) -> Text | None:
    """Prefix-cache routing: estimated hit rate, decisions by reason, index size."""
    counters = frame.counters
    decisions = {key.removeprefix("route.decisions."): value for key, value in counters.items()
                 if key.startswith("route.decisions.")}
    if frame.prefix is None and not decisions:
        return None
    prompt = counters.get("route.prompt_tokens", 0)
    cached = counters.get("route.cached_tokens", 0)
    line = Text.assemble(("prefix hits ", "bold"), f"{cached / prompt:.0%}" if prompt else "-")
    if decisions:
        line.append("   decided by ", style="bold")
        line.append(", ".join(f"{reason} {count}" for reason, count in
                              sorted(decisions.items(), key=lambda item: -item[1])))
    if frame.prefix is not None:
        memory = frame.prefix.get("memory_bytes")
        line.append("   index ", style="bold")
        line.append(f"{_int(frame.prefix.get('total_blocks'))} blocks")
        if isinstance(memory, (int, float)):
            line.append(f", {memory / (1 << 20):.1f} MiB")
        gaps = counters.get("kv.gaps", 0)
        resets = sum(v for k, v in counters.items() if k.startswith("kv.resets."))
        line.append(f"   gaps {gaps}  resets {resets}")
    return line


def _watchdog_line(alerts: Sequence[Mapping[str, Any]] | None) -> Text:
    if alerts is None:
        return Text("watchdog: not available over the frontend socket (use --url)", style="dim")
    if not alerts:
        return Text("watchdog: ok", style="green")
    line = Text("watchdog: ", style="bold red")
    for alert in alerts:
        line.append(f"\n  {alert.get('kind', '?')}: {alert.get('message', '')}", style="red")
    return line


# ---- command -------------------------------------------------------------------------------


def add_top_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top",
        help="live view of a running coordinator: ranks, loads, wave, rates, watchdog",
        description="Show a running coordinator's ranks (state, load, dispatches, report "
        "age), wave and running flag, dispatch and wave rates, and the hang watchdog, "
        "refreshed live until Ctrl-C.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", metavar="URL",
                       help="the coordinator's HTTP endpoint (serve --metrics-port), e.g. "
                       "http://127.0.0.1:9100/state; shows the watchdog and wave counts too")
    where.add_argument("--addr-file", metavar="F",
                       help="the coordinator's address file: ask over its frontend socket "
                       "(default: find the coordinator vLLM's plugin started on this host)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="refresh period in seconds (default 1)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="seconds to wait for each answer (default 5)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    add_curve_client_arguments(p)
    p.add_argument("--frames", type=int, default=None, metavar="N",
                   help="stop after N refreshes (default: until Ctrl-C)")


def _open_source(args: argparse.Namespace) -> StateSource:
    if args.url:
        return HttpSource(args.url, args.timeout)
    return FrontendSource(args.addr_file, args.timeout,
                          curve_secret_key=getattr(args, "curve_secret_key", None),
                          curve_server_key=getattr(args, "curve_server_key", None))


def run_top(args: argparse.Namespace, *, console: Console | None = None) -> int:
    console = console or Console()
    try:
        source = _open_source(args)
    except TopError as exc:
        print(f"dp-coordinator top: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    try:
        frame = source.fetch()
        if args.once:
            console.print(render(frame, Rates()))
            return EXIT_OK
        return _live(source, frame, args, console)
    except TopError as exc:
        print(f"dp-coordinator top: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        source.close()


def _live(source: StateSource, frame: TopFrame, args: argparse.Namespace,
          console: Console) -> int:
    interval = max(0.05, float(args.interval))
    remaining = args.frames
    rates = Rates()
    with Live(render(frame, rates), console=console, refresh_per_second=4) as live:
        while remaining is None or remaining > 1:
            time.sleep(interval)
            if remaining is not None:
                remaining -= 1
            try:
                current = source.fetch()
            except TopError as exc:
                live.update(render(frame, rates, error=str(exc)))
                continue
            rates = compute_rates(frame, current)
            frame = current
            live.update(render(frame, rates))
    return EXIT_OK
