"""Load generator: K frontends submitting simulated requests, open-loop or in sessions.

    gen = LoadGenerator(addresses, LoadConfig(frontends=2, rate=200, duration_s=20))
    await gen.start()               # K FrontendClients, registered concurrently
    summary = await gen.run()       # load, then wait for the stragglers
    await gen.close()

    python -m coordinator.loadgen --addr-file /tmp/coord.json --workload chat

Workloads (`LoadConfig.workload`): "poisson" (below), or "chat" and "documents",
whose requests reuse prompt prefixes (`coordinator.sim.workload`): sessions
run `concurrency` at a time, each sending its turns one after another (the next
after the previous finished and the user's think time passed), as vLLM
`EngineCoreRequest` payloads, so a prefix-aware router reads real prompt tokens.
Poisson load sends `SimRequest` payloads, or vLLM payloads with fresh random
prompts (`payload="vllm"`).

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

A `ShuttingDown` notice from the coordinator ends the run at once: nothing more is
submitted, and what was outstanding is counted as ended by the shutdown, not lost.

Prefix reuse, for vLLM payloads, from what the engines report: each request's
time to first token (submit -> the output carrying its first token) and its
cached prompt tokens (vLLM's `PrefillStats`), and the engines' own
`prefix_cache_stats` (queries, hits), summed. `ideal_reusable_tokens` is the
most a prefix cache could have served for the requests sent, capacity permitting
(`coordinator.sim.workload.ideal_reuse`): the denominator of a routing benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

import zmq.asyncio

from coordinator._zmq import AddressFileTimeout, run_loop, wait_for_address_file
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
from coordinator.protocol.vllm import EngineCoreOutputs
from coordinator.sim.outputs import read_token_outputs
from coordinator.sim.request import SimRequest, encode_sim_request, encode_vllm_request
from coordinator.sim.traffic import (
    WORKLOADS,
    LoadConfig,
    LoadSummary,
    RankWork,
    RequestRecord,
    build_parser,
    config_from_args,
    milliseconds,
    percentile,
    ratio,
    summary_lines,
)
from coordinator.sim.workload import (
    Session,
    ideal_reuse,
    plan_chat,
    plan_documents,
)

__all__ = [
    "WORKLOADS",
    "LoadConfig",
    "LoadGenerator",
    "LoadSummary",
    "RankWork",
    "RequestRecord",
    "build_parser",
    "main",
    "percentile",
]

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
        self._submit_tasks: set[asyncio.Task[RequestRecord]] = set()
        self._all_done = asyncio.Event()
        # First time any frontend saw wave w published as running.
        self._running_seen_at: dict[int, float] = {}
        self.phase = "idle"
        #: The coordinator's ShuttingDown reason, once one arrived.
        self.shutdown_reason: str | None = None
        self._stop = asyncio.Event()
        # Request id -> set when it reached an end state (session turns wait on it).
        self._done: dict[str, asyncio.Event] = {}
        # Request id -> (prompt, max_tokens), for the ideal reuse.
        self._prompts: dict[str, tuple[list[int], int]] = {}
        self.cache_stats: Counter[str] = Counter()
        self.sessions_started = 0

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
                on_outputs=self._on_outputs,
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
            if cfg.workload == "poisson":
                await asyncio.gather(*(self._arrivals(client, deadline, budget)
                                       for client in self.clients))
            else:
                await self._run_sessions(deadline, budget)
            self._load_ended = time.monotonic()
            self.phase = "draining"
            if self._stop.is_set():
                await self._end_by_shutdown()
            else:
                await self._drain(self._load_ended + cfg.drain_timeout_s)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        self._drain_ended = time.monotonic()
        self.phase = "done"
        return self.summary()

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the coordinator says it is shutting down."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), max(0.0, seconds))

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
        while next_at < deadline and budget[0] != 0 and not self._stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                await self._pause(delay)
            if budget[0] == 0 or self._stop.is_set():
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

    async def _submit_one(self, client: FrontendClient, request_id: str, *,
                          prompt: list[int] | None = None, steps: int | None = None,
                          session: str | None = None) -> RequestRecord:
        cfg = self.config
        steps = self.draw_steps() if steps is None else steps
        if prompt is None and cfg.payload == "vllm":
            prompt = [self.rng.randrange(100, 1000) for _ in range(cfg.prompt_tokens)]
        now = time.monotonic()
        record = RequestRecord(request_id, client.client_index, steps, now, wave=client.wave,
                               prompt_tokens=0 if prompt is None else len(prompt),
                               session=session)
        self.records[request_id] = record
        if prompt is None:
            payload = encode_sim_request(SimRequest(
                request_id, client.client_index, record.wave, steps, time.monotonic_ns()))
        else:
            payload = encode_vllm_request(
                request_id, prompt, max_tokens=steps, client_index=client.client_index,
                current_wave=record.wave, arrival_time=time.time(), session_id=session)
            self._prompts[request_id] = (prompt, steps)
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
            return record
        except CoordinatorTimeout:
            record.submit_timed_out = True
            self.counters["submit_timeouts"] += 1
            return record
        except FrontendError as exc:
            record.refused = type(exc).__name__
            self.counters["refused"] += 1
            self.counters[f"refused.{record.refused}"] += 1
            self._settle(record)
            return record
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
        return record

    # ------------------------------------------------------------ sessions

    async def _run_sessions(self, deadline: float, budget: list[int]) -> None:
        cfg = self.config
        seed = cfg.seed if cfg.seed is not None else 0
        if cfg.workload == "chat":
            plan = plan_chat(cfg.chat, seed)
        else:
            plan = plan_documents(cfg.documents, seed)
        queue = deque(plan)
        workers = [asyncio.ensure_future(self._session_worker(
            self.clients[index % len(self.clients)], queue, deadline, budget))
            for index in range(cfg.concurrency)]
        stopped = asyncio.ensure_future(self._stop.wait())
        every: asyncio.Future[Any] = asyncio.gather(*workers)
        try:
            await asyncio.wait([every, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # At a shutdown notice, a turn waiting for its submit reply ends at once.
            for task in (*workers, stopped):
                task.cancel()
            await asyncio.gather(*workers, stopped, return_exceptions=True)
            every.cancel()

    async def _session_worker(self, client: FrontendClient, queue: deque[Session],
                              deadline: float, budget: list[int]) -> None:
        """Run sessions from the queue, each turn after the previous one ended."""
        give_up_at = deadline + self.config.drain_timeout_s
        while queue and not self._stop.is_set() and time.monotonic() < deadline:
            session = queue.popleft()
            self.sessions_started += 1
            for index, turn in enumerate(session.turns):
                if self._stop.is_set() or time.monotonic() >= deadline or budget[0] == 0:
                    return
                if budget[0] > 0:
                    budget[0] -= 1
                request_id = f"lg-{self._tag}-{session.session_id}-{index}"
                done = self._done[request_id] = asyncio.Event()
                record = await self._submit_one(client, request_id, prompt=session.prompt(index),
                                                steps=turn.max_tokens,
                                                session=session.session_id)
                if not record.accepted:
                    break  # refused: the user gives this conversation up
                await self._wait(done, give_up_at - time.monotonic())
                if not record.completed:
                    break
                if turn.think_s > 0:
                    await self._pause(turn.think_s)

    async def _wait(self, event: asyncio.Event, seconds: float) -> None:
        """Until `event` is set, the coordinator shuts down, or `seconds` pass."""
        waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stop.wait())]
        try:
            await asyncio.wait(waiters, timeout=max(0.0, seconds),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _on_outputs(self, message: EngineCoreOutputs, at: float) -> None:
        """First tokens and cached prompt tokens per request; the engines' cache stats."""
        for report in read_token_outputs(message.outputs):
            record = self.records.get(report.request_id)
            if record is None or record.first_token_at is not None or not report.num_new_tokens:
                continue
            record.first_token_at = at
            record.cached_tokens = report.cached_tokens
        stats = message.scheduler_stats
        if stats is None:
            return
        cache = stats.prefix_cache_stats
        counts = self.cache_stats
        counts["queries"] += cache.queries
        counts["hits"] += cache.hits
        counts["preempted_queries"] += cache.preempted_queries
        counts["preempted_hits"] += cache.preempted_hits
        counts["resets"] += int(cache.reset)
        if cache.queries or cache.hits:
            work = self.work.setdefault(message.engine_index, RankWork())
            work.queried_tokens += cache.queries
            work.hit_tokens += cache.hits

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
        elif isinstance(notice, fp.ShuttingDown):
            self.counters["shutdown_notices"] += 1
            if self.shutdown_reason is None:
                self.shutdown_reason = notice.reason
                self._stop.set()
        else:
            self.counters["error_notices"] += 1

    def _settle(self, record: RequestRecord) -> None:
        """One outstanding request reached an end state (finished, failed or refused)."""
        self._in_flight -= 1
        done = self._done.pop(record.request_id, None)
        if done is not None:
            done.set()
        if self._in_flight <= 0 and self.phase == "draining":
            self._all_done.set()

    async def _end_by_shutdown(self) -> None:
        """The coordinator is going: whatever is outstanding ends here, not lost."""
        for task in list(self._submit_tasks):
            task.cancel()
        await asyncio.gather(*self._submit_tasks, return_exceptions=True)
        for record in self.records.values():
            if (record.refused is None and not record.completed and record.failed is None
                    and not record.ended_by_shutdown):
                record.ended_by_shutdown = True
                self._settle(record)

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
        accepted = sorted((r for r in records if r.accepted), key=lambda r: r.submitted_at)
        prompt_tokens = sum(r.prompt_tokens for r in accepted)
        sent = [self._prompts[r.request_id] for r in accepted if r.request_id in self._prompts]
        capacity = None
        if self.config.kv_capacity_blocks is not None and rank_count:
            capacity = self.config.kv_capacity_blocks * rank_count
        ideal = ideal_reuse(sent, self.config.block_size, capacity) if sent else None
        cache = self.cache_stats
        hits, queried = cache["hits"], cache["queries"]
        prefill = queried - hits + cache["preempted_queries"] - cache["preempted_hits"]
        ttfts = [r.first_token_at - r.submitted_at for r in records
                 if r.first_token_at is not None]
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
            wake_reply_ms_p50=milliseconds(percentile(wake_replies, 50)),
            wake_reply_ms_p99=milliseconds(percentile(wake_replies, 99)),
            wake_running_ms_p50=milliseconds(percentile(wake_running, 50)),
            wake_running_ms_p99=milliseconds(percentile(wake_running, 99)),
            wake_finish_ms_p50=milliseconds(percentile(wake_finishes, 50)),
            wake_finish_ms_p99=milliseconds(percentile(wake_finishes, 99)),
            latency_ms_p50=milliseconds(percentile(latencies, 50)),
            latency_ms_p99=milliseconds(percentile(latencies, 99)),
            reply_ms_p50=milliseconds(percentile(replies, 50)),
            reply_ms_p99=milliseconds(percentile(replies, 99)),
            throughput_rps=round(len(completed) / elapsed, 2),
            lost_ids=[r.request_id for r in lost[:20]],
            workload=self.config.workload,
            shutdown_reason=self.shutdown_reason,
            ended_by_shutdown=sum(1 for r in records if r.ended_by_shutdown),
            prompt_tokens=prompt_tokens,
            ideal_reusable_tokens=ideal,
            hit_tokens=hits,
            queried_tokens=queried,
            prefill_tokens=prefill,
            hit_rate=ratio(hits, queried),
            ideal_hit_rate=None if ideal is None else ratio(ideal, prompt_tokens),
            ideal_fraction=None if ideal is None else ratio(hits, ideal),
            ttft_ms_p50=milliseconds(percentile(ttfts, 50)),
            ttft_ms_p99=milliseconds(percentile(ttfts, 99)),
            sessions_started=self.sessions_started,
        )


# ---------------------------------------------------------------- command line


async def _run_cli(args: argparse.Namespace, config: LoadConfig) -> int:
    try:
        addresses = await asyncio.to_thread(
            wait_for_address_file, args.addr_file, ("frontend", "front_publish"),
            args.wait_addr_file, poll_s=0.05)
    except AddressFileTimeout as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 4
    gen = LoadGenerator(addresses, config)
    try:
        try:
            await gen.start()
            await gen.wait_ready(timeout_s=args.wait_ready)
        except FrontendError as exc:
            print(f"loadgen: could not start: {exc}", file=sys.stderr)
            return 4
        summary = await gen.run()
    finally:
        await gen.close()
    if args.json:
        print(json.dumps(summary.to_dict()), flush=True)
    else:
        print("\n".join(summary_lines(summary)), flush=True)
    return 0 if summary.healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return run_loop(_run_cli(args, config))


if __name__ == "__main__":
    raise SystemExit(main())
