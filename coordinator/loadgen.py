"""Load generator: K frontends submitting simulated requests with Poisson arrivals.

    gen = LoadGenerator(addresses, LoadConfig(frontends=2, rate=200, duration_s=20))
    await gen.start()               # K FrontendClients, registered concurrently
    summary = await gen.run()       # load, then wait for the stragglers
    await gen.close()

Arrivals: each frontend runs its own Poisson process at `rate / frontends`; the
superposition is a Poisson process at `rate`. Arrival is open-loop: a submit does
not wait for the previous one's reply (as with real API traffic), up to
`max_outstanding_submits` unanswered submits, beyond which arrivals are counted
as `skipped` rather than queued without bound. Load stops at `duration_s` or after
`max_requests` arrivals, whichever comes first.

With `burst_on_s`/`burst_off_s` the same process runs only during bursts,
separated by quiet gaps (the mean rate over the whole run is still `rate`): in
lockstep mode the group pauses in each gap, so every burst starts with a wake.

Request lengths: `decode_steps` is log-normal (median `steps_median`, shape
`steps_sigma`), clipped to `[steps_min, steps_max]`, so most requests are short and
a few are long, like chat traffic.

What is measured, per request: submit time, the rank the coordinator chose, the
reply time, whether that submit woke the paused group (`Submitted.woke`) and, for
those, when a publish first said that wave is running; the time its finish
arrived on the frontend's output socket, and failures (`RequestsFailed` notices,
refusals, timeouts). After the load stops, the generator waits up to
`drain_timeout_s` for every accepted request to finish or be reported failed;
whatever is left is *lost*, which must be 0 in a healthy run. While requests are
outstanding, `stall_s` seconds without a single completion is recorded as a stall
(the symptom of a lockstep hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq.asyncio

from coordinator.frontend import (
    CoordinatorTimeout,
    EngineDead,
    FinishedRequest,
    FrontendClient,
    FrontendError,
    Notice,
    SubmitError,
)
from coordinator.protocol import frontend as fp
from coordinator.sim.request import SimRequest, encode_sim_request

__all__ = [
    "LoadConfig",
    "LoadGenerator",
    "LoadSummary",
    "RankWork",
    "RequestRecord",
    "percentile",
]


@dataclass
class LoadConfig:
    """What load to generate, and how long to wait for it to finish."""

    frontends: int = 2
    rate: float = 200.0
    """Mean arrivals per second over all frontends."""
    duration_s: float = 20.0
    max_requests: int | None = None
    """Stop after this many arrivals even if `duration_s` has not passed."""
    steps_median: float = 16.0
    steps_sigma: float = 0.8
    steps_min: int = 1
    steps_max: int = 512
    drain_timeout_s: float = 15.0
    stall_s: float = 5.0
    submit_timeout_s: float = 5.0
    max_outstanding_submits: int = 10_000
    burst_on_s: float | None = None
    """With `burst_off_s`: arrivals come in bursts this long separated by quiet gaps,
    so a lockstep group pauses and must be woken again; the mean rate stays `rate`."""
    burst_off_s: float = 0.0
    seed: int | None = None
    host: str | None = None
    """Bind frontend output sockets on tcp `host` instead of ipc."""

    def validate(self) -> None:
        if self.frontends < 1:
            raise ValueError(f"need at least one frontend, got {self.frontends}")
        if not self.rate > 0 or not math.isfinite(self.rate):
            raise ValueError(f"rate must be a positive number, got {self.rate}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")
        if self.burst_on_s is not None and not self.burst_on_s > 0:
            raise ValueError(f"burst_on_s must be positive, got {self.burst_on_s}")
        if self.burst_off_s < 0:
            raise ValueError(f"burst_off_s must be >= 0, got {self.burst_off_s}")
        if not 1 <= self.steps_min <= self.steps_max:
            raise ValueError("need 1 <= steps_min <= steps_max")


@dataclass
class RequestRecord:
    """Everything observed about one request (times are `time.monotonic()`)."""

    request_id: str
    client_index: int
    decode_steps: int
    submitted_at: float
    replied_at: float | None = None
    rank: int | None = None
    woke: bool = False
    wave: int = 0
    """The wave stamped on the submit (the newest this frontend had seen)."""
    finished_at: float | None = None
    finished_rank: int | None = None
    refused: str | None = None
    """The ErrorReply code when the coordinator refused the submit."""
    submit_timed_out: bool = False
    failed: str | None = None
    """The reason when the coordinator reported the request failed."""

    @property
    def accepted(self) -> bool:
        """The coordinator took it (or we never heard back and it may have)."""
        return self.refused is None and (self.rank is not None or self.submit_timed_out)

    @property
    def completed(self) -> bool:
        return self.finished_at is not None

    @property
    def lost(self) -> bool:
        return self.accepted and not self.completed and self.failed is None


@dataclass
class RankWork:
    """Work one rank did, as observed by the frontends."""

    dispatched: int = 0
    completed: int = 0
    decode_steps: int = 0
    """Decode steps of completed requests."""


@dataclass
class LoadSummary:
    """The result of one run; `to_dict()` is the JSON form."""

    frontends: int
    rate: float
    load_seconds: float
    drain_seconds: float
    arrivals: int
    submitted: int
    completed: int
    failed: int
    refused: int
    refused_by_code: dict[str, int]
    submit_timeouts: int
    skipped: int
    lost: int
    engine_dead_notices: int
    stalls: int
    first_wave: int
    last_wave: int
    waves_completed: int
    per_rank: dict[int, RankWork]
    balance_ratio: float | None
    """mean / max of completed decode steps per rank (1.0 = perfectly even)."""
    wakes: int
    wake_reply_ms_p50: float | None
    wake_reply_ms_p99: float | None
    wake_running_ms_p50: float | None
    """From a submit that woke the group to the publish saying that wave runs."""
    wake_running_ms_p99: float | None
    wake_finish_ms_p50: float | None
    wake_finish_ms_p99: float | None
    latency_ms_p50: float | None
    latency_ms_p99: float | None
    reply_ms_p50: float | None
    reply_ms_p99: float | None
    throughput_rps: float
    lost_ids: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.lost == 0 and self.stalls == 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["per_rank"] = {str(rank): asdict(work) for rank, work in self.per_rank.items()}
        data["healthy"] = self.healthy
        return data


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[index]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


class LoadGenerator:
    """Drives `config.frontends` FrontendClients against one coordinator."""

    def __init__(
        self,
        addresses: Mapping[str, str],
        config: LoadConfig,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        config.validate()
        self.addresses = dict(addresses)
        self.config = config
        self.rng = random.Random(config.seed)
        self.records: dict[str, RequestRecord] = {}
        self.clients: list[FrontendClient] = []
        self.work: dict[int, RankWork] = {}
        self.notices: list[Notice] = []
        self.counters: Counter[str] = Counter()
        self.stalls = 0
        self._context = context
        self._tag = uuid.uuid4().hex[:8]
        self._outstanding_submits = 0
        self._in_flight = 0
        self._last_progress = time.monotonic()
        self._first_wave = 0
        self._load_started: float | None = None
        self._load_ended: float | None = None
        self._drain_ended: float | None = None
        self._submit_tasks: set[asyncio.Task[None]] = set()
        self._all_done = asyncio.Event()
        # First time any frontend saw wave w published as running.
        self._running_seen_at: dict[int, float] = {}
        self.phase = "idle"

    # ------------------------------------------------------------ setup

    async def start(self, *, register_timeout_s: float = 30.0) -> None:
        """Create and register every frontend (concurrently: the coordinator may hold
        engine INITs until all of them registered)."""
        self.clients = [
            FrontendClient(
                self.addresses,
                client_index=index,
                host=self.config.host,
                call_timeout_s=self.config.submit_timeout_s,
                on_finished=self._on_finished,
                on_notice=self._on_notice,
                on_publish=self._on_publish,
                context=self._context,
            )
            for index in range(self.config.frontends)
        ]
        self.phase = "registering"
        registered = await asyncio.gather(
            *(client.register(timeout=register_timeout_s) for client in self.clients)
        )
        self._first_wave = max(r.wave for r in registered)
        self.phase = "registered"

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until a full publish arrived and the coordinator lists every rank ready."""
        deadline = time.monotonic() + timeout_s
        client = self.clients[0]
        self.phase = "waiting for engines"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorTimeout("engines becoming ready", timeout_s)
            state = await client.query_state(timeout=min(remaining, 5.0))
            if state.engines and all(e.state == "ready" for e in state.engines) \
                    and client.counts is not None:
                break
            await asyncio.sleep(0.05)
        self._first_wave = max(c.wave for c in self.clients)
        self.phase = "ready"

    async def close(self) -> None:
        for task in list(self._submit_tasks):
            task.cancel()
        await asyncio.gather(*self._submit_tasks, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self.clients),
                             return_exceptions=True)

    # ------------------------------------------------------------ live view

    @property
    def wave(self) -> int:
        return max((c.wave for c in self.clients), default=0)

    @property
    def running(self) -> bool:
        newest = max(self.clients, key=lambda c: c.stats["publishes"], default=None)
        return bool(newest and newest.running)

    def counts(self) -> list[tuple[int, int, float]] | None:
        """Per-rank (waiting, running, kv) from the client with the most publishes."""
        newest = max(self.clients, key=lambda c: c.stats["publishes"], default=None)
        return None if newest is None else newest.counts

    def totals(self) -> dict[str, int]:
        done = sum(1 for r in self.records.values() if r.completed)
        failed = sum(1 for r in self.records.values() if r.failed is not None)
        return {
            "arrivals": len(self.records),
            "in_flight": self._in_flight,
            "completed": done,
            "failed": failed,
            "refused": self.counters["refused"],
            "wakes": self.counters["wakes"],
            "stalls": self.stalls,
        }

    # ------------------------------------------------------------ the run

    def draw_steps(self) -> int:
        cfg = self.config
        value = self.rng.lognormvariate(math.log(cfg.steps_median), cfg.steps_sigma)
        return max(cfg.steps_min, min(cfg.steps_max, round(value)))

    async def run(self) -> LoadSummary:
        """Generate the load, wait for it to drain, and summarize."""
        cfg = self.config
        if not self.clients:
            await self.start()
        self._load_started = time.monotonic()
        self._last_progress = self._load_started
        deadline = self._load_started + cfg.duration_s
        budget = [cfg.max_requests if cfg.max_requests is not None else -1]
        self.phase = "load"
        watchdog = asyncio.ensure_future(self._watch_stalls())
        try:
            await asyncio.gather(*(self._arrivals(client, deadline, budget)
                                   for client in self.clients))
            self._load_ended = time.monotonic()
            self.phase = "draining"
            await self._drain(self._load_ended + cfg.drain_timeout_s)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        self._drain_ended = time.monotonic()
        self.phase = "done"
        return self.summary()

    def _wall_time(self, start: float, on_time: float) -> float:
        """Map a point on the "load on" clock to wall time, skipping quiet gaps."""
        on, off = self.config.burst_on_s, self.config.burst_off_s
        if on is None or off <= 0:
            return start + on_time
        bursts, into = divmod(on_time, on)
        return start + bursts * (on + off) + into

    async def _arrivals(self, client: FrontendClient, deadline: float,
                        budget: list[int]) -> None:
        cfg = self.config
        rate = cfg.rate / cfg.frontends
        if cfg.burst_on_s is not None and cfg.burst_off_s > 0:
            # Same mean rate overall: the bursts carry the quiet gaps' share.
            rate *= (cfg.burst_on_s + cfg.burst_off_s) / cfg.burst_on_s
        start = self._load_started if self._load_started is not None else time.monotonic()
        seq = 0
        on_time = self.rng.expovariate(rate)
        next_at = self._wall_time(start, on_time)
        while next_at < deadline and budget[0] != 0:
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if budget[0] == 0:
                break
            if budget[0] > 0:
                budget[0] -= 1
            if self._outstanding_submits >= cfg.max_outstanding_submits:
                self.counters["skipped"] += 1
            else:
                request_id = f"lg-{self._tag}-{client.client_index}-{seq}"
                seq += 1
                task = asyncio.ensure_future(self._submit_one(client, request_id))
                self._submit_tasks.add(task)
                task.add_done_callback(self._submit_tasks.discard)
            on_time += self.rng.expovariate(rate)
            next_at = self._wall_time(start, on_time)

    async def _submit_one(self, client: FrontendClient, request_id: str) -> None:
        steps = self.draw_steps()
        now = time.monotonic()
        record = RequestRecord(request_id, client.client_index, steps, now, wave=client.wave)
        self.records[request_id] = record
        payload = encode_sim_request(SimRequest(
            request_id, client.client_index, record.wave, steps, time.monotonic_ns()))
        self._outstanding_submits += 1
        if self._in_flight == 0:
            self._last_progress = now
        self._in_flight += 1
        try:
            submitted = await client.submit(request_id, [payload], wave=record.wave)
        except SubmitError as exc:
            record.refused = exc.code
            self.counters["refused"] += 1
            self.counters[f"refused.{exc.code}"] += 1
            self._settle(record)
            return
        except CoordinatorTimeout:
            record.submit_timed_out = True
            self.counters["submit_timeouts"] += 1
            return
        except FrontendError as exc:
            record.refused = type(exc).__name__
            self.counters["refused"] += 1
            self.counters[f"refused.{record.refused}"] += 1
            self._settle(record)
            return
        finally:
            self._outstanding_submits -= 1
        record.replied_at = time.monotonic()
        record.rank = submitted.rank
        record.woke = submitted.woke
        if submitted.woke:
            self.counters["wakes"] += 1
        self.work.setdefault(submitted.rank, RankWork()).dispatched += 1
        if record.completed:
            # The finish overtook the reply; credit the work now that the rank is known.
            self._credit(record)

    def _on_finished(self, item: FinishedRequest) -> None:
        record = self.records.get(item.request_id)
        if record is None or record.completed:
            self.counters["unexpected_finishes"] += 1
            return
        record.finished_at = item.at
        record.finished_rank = item.engine_index
        self._last_progress = item.at
        if record.failed is None:
            self._settle(record)
        if record.rank is not None:
            self._credit(record)

    def _credit(self, record: RequestRecord) -> None:
        rank = record.finished_rank if record.finished_rank is not None else record.rank
        if rank is None:
            return
        work = self.work.setdefault(rank, RankWork())
        work.completed += 1
        work.decode_steps += record.decode_steps

    def _on_publish(self, client: FrontendClient) -> None:
        if client.running and client.wave not in self._running_seen_at:
            self._running_seen_at[client.wave] = time.monotonic()

    def _on_notice(self, notice: Notice) -> None:
        self.notices.append(notice)
        if isinstance(notice, fp.RequestsFailed):
            for request_id in notice.request_ids:
                record = self.records.get(request_id)
                if record is not None and record.failed is None and not record.completed:
                    record.failed = notice.reason
                    self._settle(record)
            self.counters["failed_notices"] += 1
        elif isinstance(notice, EngineDead):
            self.counters["engine_dead"] += 1
        elif isinstance(notice, fp.RankDrained):
            self.counters["rank_drained"] += 1
        else:
            self.counters["error_notices"] += 1

    def _settle(self, record: RequestRecord) -> None:
        """One outstanding request reached an end state (finished, failed or refused)."""
        self._in_flight -= 1
        if self._in_flight <= 0 and self.phase == "draining":
            self._all_done.set()

    async def _drain(self, deadline: float) -> None:
        if self._submit_tasks:
            await asyncio.wait(list(self._submit_tasks),
                               timeout=max(0.0, deadline - time.monotonic()))
        if self._in_flight > 0:
            self._all_done.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_done.wait(),
                                       max(0.0, deadline - time.monotonic()))
        # In lockstep mode the group pauses once idle; wait for that publish so the
        # wave count includes the last wave.
        client = self.clients[0]
        if client.registered is not None and client.registered.lockstep:
            with contextlib.suppress(CoordinatorTimeout):
                await client.wait_for(lambda c: not c.running,
                                      timeout=max(0.1, min(3.0, deadline - time.monotonic())))

    async def _watch_stalls(self) -> None:
        stall_s = self.config.stall_s
        stalled = False
        while True:
            await asyncio.sleep(min(0.5, stall_s / 4))
            quiet = time.monotonic() - self._last_progress
            if self._in_flight > 0 and quiet >= stall_s:
                if not stalled:
                    self.stalls += 1
                    stalled = True
            else:
                stalled = False
                if self._in_flight == 0:
                    self._last_progress = time.monotonic()

    # ------------------------------------------------------------ the summary

    def summary(self) -> LoadSummary:
        records = list(self.records.values())
        started = self._load_started or time.monotonic()
        ended = self._load_ended or time.monotonic()
        drained = self._drain_ended or time.monotonic()
        completed = [r for r in records if r.completed]
        lost = [r for r in records if r.lost]
        woke = [r for r in records if r.woke]
        latencies = [r.finished_at - r.submitted_at for r in completed
                     if r.finished_at is not None]
        replies = [r.replied_at - r.submitted_at for r in records if r.replied_at is not None]
        wake_replies = [r.replied_at - r.submitted_at for r in woke if r.replied_at is not None]
        wake_finishes = [r.finished_at - r.submitted_at for r in woke
                         if r.finished_at is not None]
        wake_running = [self._running_seen_at[r.wave] - r.submitted_at for r in woke
                        if r.wave in self._running_seen_at
                        and self._running_seen_at[r.wave] >= r.submitted_at]
        refused_by_code = {key.split(".", 1)[1]: n for key, n in self.counters.items()
                           if key.startswith("refused.")}
        per_rank = dict(sorted(self.work.items()))
        steps = [w.decode_steps for w in per_rank.values()]
        rank_count = None
        if self.clients and self.clients[0].registered is not None:
            rank_count = self.clients[0].registered.rank_count
        if rank_count and len(steps) < rank_count:
            steps += [0] * (rank_count - len(steps))
        balance = (sum(steps) / len(steps)) / max(steps) if steps and max(steps) > 0 else None
        last_wave = self.wave
        elapsed = max(1e-9, drained - started)
        return LoadSummary(
            frontends=self.config.frontends,
            rate=self.config.rate,
            load_seconds=round(ended - started, 3),
            drain_seconds=round(drained - ended, 3),
            arrivals=len(records) + self.counters["skipped"],
            submitted=sum(1 for r in records if r.accepted),
            completed=len(completed),
            failed=sum(1 for r in records if r.failed is not None and not r.completed),
            refused=sum(1 for r in records if r.refused is not None),
            refused_by_code=refused_by_code,
            submit_timeouts=self.counters["submit_timeouts"],
            skipped=self.counters["skipped"],
            lost=len(lost),
            engine_dead_notices=self.counters["engine_dead"],
            stalls=self.stalls,
            first_wave=self._first_wave,
            last_wave=last_wave,
            waves_completed=max(0, last_wave - self._first_wave),
            per_rank=per_rank,
            balance_ratio=None if balance is None else round(balance, 4),
            wakes=len(woke),
            wake_reply_ms_p50=_ms(percentile(wake_replies, 50)),
            wake_reply_ms_p99=_ms(percentile(wake_replies, 99)),
            wake_running_ms_p50=_ms(percentile(wake_running, 50)),
            wake_running_ms_p99=_ms(percentile(wake_running, 99)),
            wake_finish_ms_p50=_ms(percentile(wake_finishes, 50)),
            wake_finish_ms_p99=_ms(percentile(wake_finishes, 99)),
            latency_ms_p50=_ms(percentile(latencies, 50)),
            latency_ms_p99=_ms(percentile(latencies, 99)),
            reply_ms_p50=_ms(percentile(replies, 50)),
            reply_ms_p99=_ms(percentile(replies, 99)),
            throughput_rps=round(len(completed) / elapsed, 2),
            lost_ids=[r.request_id for r in lost[:20]],
        )
