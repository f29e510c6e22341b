"""One simulated lockstep DP engine: an `EngineAgent` and a vLLM-like step loop."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import zmq.asyncio

from coordinator.engine import (
    AbortRequests,
    AddRequest,
    EngineAgent,
    InboundRequest,
    StartDpWave,
    UtilityCall,
    default_ready_response,
)
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.vllm import EngineCoreOutputs, EngineReadyResponse, SchedulerStats
from coordinator.sim.collective import CollectiveClient, CollectiveHang
from coordinator.sim.kv_publisher import KVEventPublisher
from coordinator.sim.outputs import PrefillStats, prefill_stats_for, token_output
from coordinator.sim.request import FINISH_ERROR, FINISH_LENGTH, decode_add_payload
from coordinator.sim.scheduler import Active, SchedulerConfig, SimScheduler, StepResult

__all__ = ["HangPolicy", "SimConfig", "SimCounters", "SimEngine", "sim_config_hash"]

logger = logging.getLogger("coordinator.sim")

HangPolicy = Literal["fail", "wait"]


def sim_config_hash(world_size: int) -> str:
    """The `parallel_config_hash` simulated engines send: equal for one group size."""
    return hashlib.sha256(f"coordinator.sim dp_size={world_size}".encode()).hexdigest()


@dataclass
class SimConfig:
    """How a simulated engine behaves. Ranks of one group must agree on the lockstep knobs."""

    world_size: int = 2
    rank_start: int = 0
    step_time_s: float = 0.005
    max_batch: int = 64
    #: Honour the reduced "unfinished" flag on step 1 and every N steps (vLLM: 16).
    dp_sync_interval: int = 16
    collective_timeout_s: float = 10.0
    on_hang: HangPolicy = "fail"
    #: False: a dense engine (no waves, no collective), like vLLM's EngineCoreProc.
    lockstep: bool = True
    #: False: send no load stats (vLLM engines in external-LB mode).
    publish_stats: bool = True
    # The KV cache and the cost of a prefill.
    block_size: int = 16
    #: KV cache capacity in blocks (vLLM's num_gpu_blocks, less its null block).
    kv_blocks: int = 4096
    enable_prefix_caching: bool = True
    #: Tokens computed per step across the batch (vLLM's max_num_batched_tokens).
    max_num_batched_tokens: int = 8192
    #: Added to a step for every prompt token it computes (cache hits are free).
    prefill_s_per_token: float = 5e-6
    #: vLLM's log_stats: prefix-cache statistics to a frontend with the outputs.
    log_stats: bool = True
    # KV cache events, as vLLM's --kv-events-config (None: no publisher).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_buffer_steps: int = 10_000
    kv_events_topic: str = ""
    # Agent options.
    vllm_shaped: bool = False
    #: HELLO's engine_id; None: a fresh random one. A group appends "-<rank>".
    engine_id: str | None = None
    parallel_config_hash: str | None = None
    heartbeat_interval_s: float | None = 2.0
    handshake_timeout_s: float = 60.0
    ready_timeout_s: float = 120.0
    accept_timeout_s: float = 30.0
    local: bool = False
    headless: bool = True
    #: CURVE key files (this engine's NAME.key_secret, the coordinator's NAME.key).
    curve_secret_key: str | None = None
    curve_server_key: str | None = None

    def config_hash(self) -> str:
        if self.parallel_config_hash is not None:
            return self.parallel_config_hash
        return sim_config_hash(self.world_size)

    @property
    def group_ranks(self) -> range:
        return range(self.rank_start, self.rank_start + self.world_size)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch=self.max_batch,
            block_size=self.block_size,
            kv_blocks=self.kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            max_num_batched_tokens=self.max_num_batched_tokens,
            record_events=self.kv_events_endpoint is not None,
        )


@dataclass
class SimCounters:
    """What an engine did; for tests and reports."""

    steps: int = 0
    dummy_steps: int = 0
    collectives: int = 0
    added: int = 0
    finished: int = 0
    aborted: int = 0
    dropped: int = 0
    rejected: int = 0
    kv_event_batches: int = 0
    prefix_cache_resets: int = 0
    start_waves_sent: list[int] = field(default_factory=list)
    wave_completes_sent: list[int] = field(default_factory=list)
    wakes_applied: list[int] = field(default_factory=list)


class SimEngine:
    """One simulated DP rank: an EngineAgent and a vLLM-like step loop.

    `start()` opens the KV event publisher if one is configured, runs the agent
    handshake (which completes only when every rank of the group has subscribed
    at the coordinator) and launches the loop; `stop()` ends it. State is
    exposed read-only for tests: `current_wave`, `engines_running`,
    `step_counter`, `num_waiting`, `num_running`, `counters`, `hangs`, `failed`,
    `scheduler` (queues and KV cache) and `publisher`.
    """

    def __init__(
        self,
        rank: int,
        handshake_address: str,
        *,
        config: SimConfig | None = None,
        collective_address: str | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.rank = rank
        self.config = cfg = config if config is not None else SimConfig()
        if rank not in cfg.group_ranks:
            raise ValueError(f"rank {rank} is outside the group {cfg.group_ranks}")
        if cfg.lockstep and collective_address is None:
            raise ValueError("a lockstep engine needs a collective_address")
        if cfg.max_batch < 1 or cfg.dp_sync_interval < 1:
            raise ValueError("max_batch and dp_sync_interval must be at least 1")
        if cfg.prefill_s_per_token < 0:
            raise ValueError("prefill_s_per_token must not be negative")
        self.scheduler = SimScheduler(cfg.scheduler_config())
        self.publisher: KVEventPublisher | None = None
        if cfg.kv_events_endpoint is not None:
            # Resolved now: a bad endpoint is a configuration error, before any socket.
            self.publisher = KVEventPublisher(
                cfg.kv_events_endpoint,
                rank,
                replay_endpoint=cfg.kv_events_replay_endpoint,
                buffer_steps=cfg.kv_events_buffer_steps,
                topic=cfg.kv_events_topic,
                context=context,
            )
        self.agent = EngineAgent(
            handshake_address,
            rank,
            local=cfg.local,
            headless=cfg.headless,
            engine_id=cfg.engine_id,
            parallel_config_hash=cfg.config_hash(),
            vllm_shaped=cfg.vllm_shaped,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            handshake_timeout_s=cfg.handshake_timeout_s,
            ready_timeout_s=cfg.ready_timeout_s,
            accept_timeout_s=cfg.accept_timeout_s,
            context=context,
            curve_secret_key=cfg.curve_secret_key,
            curve_server_key=cfg.curve_server_key,
            ready_response=self._ready_response(),
        )
        self._collective_address = collective_address
        self._collective: CollectiveClient | None = None
        self._context = context

        self.current_wave = 0
        self.engines_running = False
        self.step_counter = 0
        #: When True, START_DP_WAVE is dropped (fault injection: a never-woken peer).
        self.ignore_start_wave = False
        self.hangs: list[CollectiveHang] = []
        self.failed: BaseException | None = None
        self.counters = SimCounters()

        self._last_counts = (0, 0)
        self._seq = 0
        self._unfrozen = asyncio.Event()
        self._unfrozen.set()
        self._task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------ control

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def _ready_response(self) -> EngineReadyResponse:
        """The greeting a vLLM engine with this cache and publisher sends."""
        cfg = self.config
        base = default_ready_response(self.rank, cfg.world_size)
        return msgspec.structs.replace(
            base,
            # vLLM counts its null block among the GPU blocks.
            num_gpu_blocks=cfg.kv_blocks + 1,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_batch,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            kv_cache_size_tokens=cfg.kv_blocks * cfg.block_size,
            kv_events_config=None if self.publisher is None else self.publisher.config,
        )

    @property
    def frozen(self) -> bool:
        return not self._unfrozen.is_set()

    @property
    def done(self) -> asyncio.Event:
        """Set once the step loop has ended (stopped or failed)."""
        return self._stopped

    def freeze(self, *, silence: bool = False) -> None:
        """Stop stepping (and handling input) until `unfreeze()`.

        With `silence`, heartbeats stop too, so the coordinator's lease can lapse.
        """
        self._unfrozen.clear()
        if silence:
            self.agent.heartbeats_enabled = False

    def unfreeze(self) -> None:
        self._unfrozen.set()
        self.agent.heartbeats_enabled = True

    async def start(self) -> None:
        """Join the coordinator, then run the step loop in a task."""
        if self.config.lockstep and self._collective_address is not None:
            self._collective = CollectiveClient(
                self._collective_address,
                self.rank,
                timeout_s=self.config.collective_timeout_s,
                context=self._context,
            )
        try:
            if self.publisher is not None:
                # Before the greeting names its endpoints, so they exist when read.
                self.publisher.start()
            await self.agent.start()
        except BaseException:
            self._close_collective()
            await self._close_publisher()
            raise
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"sim-engine-{self.rank}"
        )

    async def stop(self, linger_s: float = 0.5) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._stopped.set()
        self._close_collective()
        await self._close_publisher()
        await self.agent.close(linger_s=linger_s)

    async def _close_publisher(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()

    def _close_collective(self) -> None:
        if self._collective is not None:
            self._collective.close()
            self._collective = None

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        try:
            if self.config.lockstep:
                await self._lockstep_loop()
            else:
                await self._dense_loop()
        except asyncio.CancelledError:
            raise
        except CollectiveHang as hang:
            self.failed = hang
            logger.error("rank %d: engine dies after a collective hang: %s", self.rank, hang)
            await self._die()
        except Exception as exc:
            self.failed = exc
            logger.exception("rank %d: engine loop failed", self.rank)
            await self._die()
        finally:
            self._stopped.set()

    async def _die(self) -> None:
        """What a dying vLLM engine does: tell the frontends, then drop every socket."""
        with contextlib.suppress(Exception):
            self.agent.send_engine_dead()
        self._close_collective()
        await self._close_publisher()
        await self.agent.close(linger_s=0.5)

    def _has_local_work(self) -> bool:
        return self.scheduler.has_work

    async def _lockstep_loop(self) -> None:
        while True:
            await self._unfrozen.wait()
            was_running = self.engines_running
            await self._process_input()
            self._maybe_publish_counts()
            executed = await self._step()
            self._maybe_publish_counts()

            local_unfinished = self._has_local_work()
            if not executed:
                if not local_unfinished and not self.engines_running:
                    continue
                await self._dummy_step()
            self.engines_running = await self._global_unfinished(local_unfinished)

            leader = self.rank == self.config.rank_start
            if not self.engines_running:
                # Rank 0 speaks for the group; without a coordinator every rank
                # tells its own frontend, as vLLM does.
                if leader or not self.agent.has_coordinator:
                    self._send_wave_complete(self.current_wave)
                self.current_wave += 1
                self.step_counter = 0
            elif not was_running and leader and self.agent.has_coordinator:
                # Rank 0 reports the edge itself, so the coordinator's running
                # flag is an observation even when the wake did not come from it.
                self._send_start_wave(self.current_wave)

    async def _dense_loop(self) -> None:
        while True:
            await self._unfrozen.wait()
            await self._process_input()
            self._maybe_publish_counts()
            await self._step()
            self._maybe_publish_counts()

    def _has_work(self) -> bool:
        return self.engines_running or self._has_local_work()

    async def _process_input(self) -> None:
        while not self._has_work():
            request = await self.agent.recv_request()
            await self._unfrozen.wait()
            self._handle(request)
        while (queued := self.agent.get_request_nowait()) is not None:
            self._handle(queued)

    async def _step(self) -> bool:
        scheduler = self.scheduler
        plan = scheduler.schedule()
        self._report_rejected()
        if plan.empty:
            return False
        cost = plan.prefill_tokens * self.config.prefill_s_per_token
        await asyncio.sleep(self.config.step_time_s + cost)
        self.counters.steps += 1
        result = scheduler.complete(plan, time.monotonic())
        # Events first, as vLLM's scheduler does: whoever learns from an output
        # that a request finished can count on its blocks having been announced.
        self._publish_kv_events()
        self._send_step_outputs(result)
        return True

    async def _dummy_step(self) -> None:
        await asyncio.sleep(self.config.step_time_s)
        self.counters.dummy_steps += 1

    async def _global_unfinished(self, local_unfinished: bool) -> bool:
        """The per-step collective; the reduced flag counts on sync steps only."""
        self.step_counter += 1
        total = await self._all_reduce(int(local_unfinished))
        interval = self.config.dp_sync_interval
        if self.step_counter != 1 and self.step_counter % interval != 0:
            return True
        return total > 0

    async def _all_reduce(self, value: int) -> int:
        client = self._collective
        if client is None:
            raise RuntimeError("lockstep engine has no collective client")
        self._seq += 1
        self.counters.collectives += 1
        seq, wave, step = self._seq, self.current_wave, self.step_counter
        try:
            return await client.all_reduce(seq, value, wave=wave, step=step)
        except CollectiveHang as hang:
            recorded = self._record_hang(hang)
        while self.config.on_hang == "wait":
            try:
                return await client.wait_result(
                    seq, wave=wave, step=step, already_waited_s=recorded.waited_s
                )
            except CollectiveHang as hang:
                recorded = self._record_hang(hang)
        raise recorded

    def _record_hang(self, hang: CollectiveHang) -> CollectiveHang:
        self.hangs.append(hang)
        logger.error("COLLECTIVE HANG: %s", hang)
        return hang

    # ------------------------------------------------------------ requests

    def _handle(self, request: InboundRequest) -> None:
        if isinstance(request, AddRequest):
            self._on_add(request)
        elif isinstance(request, AbortRequests):
            self._on_abort(request.request_ids)
        elif isinstance(request, StartDpWave):
            self._on_start_dp_wave(request.wave, request.exclude)
        elif isinstance(request, UtilityCall):
            self._on_utility(request)

    def _on_add(self, request: AddRequest) -> None:
        try:
            work = decode_add_payload(request.frames[0])
        except ProtocolError as exc:
            self.counters.dropped += 1
            logger.warning("rank %d: dropped an ADD this engine cannot run: %s", self.rank, exc)
            return
        if self.scheduler.add(work, time.monotonic()) is None:
            logger.warning("rank %d: duplicate request id %r ignored", self.rank, work.request_id)
            return
        self.counters.added += 1
        if not (self.config.lockstep and self.agent.has_coordinator):
            return
        if work.current_wave > self.current_wave:
            self.current_wave = work.current_wave
        if not self.engines_running:
            # Running first: this engine is the one left out of the wake it triggers.
            self.engines_running = True
            self._send_start_wave(self.current_wave)

    def _on_abort(self, request_ids: list[str]) -> None:
        gone: dict[int, list[str]] = {}
        for active in self.scheduler.abort(request_ids):
            gone.setdefault(active.work.client_index, []).append(active.request_id)
        for client_index, ids in gone.items():
            self.counters.aborted += len(ids)
            self._send_finished(client_index, ids)

    def _on_start_dp_wave(self, wave: int, exclude: int | None) -> None:
        if not self.config.lockstep:
            logger.error("rank %d: dense engine got START_DP_WAVE; ignored", self.rank)
            return
        if self.ignore_start_wave:
            logger.info("rank %d: ignoring START_DP_WAVE [%d, %s]", self.rank, wave, exclude)
            return
        if exclude != self.rank and wave >= self.current_wave:
            self.current_wave = wave
            if not self.engines_running:
                self.engines_running = True
                self.counters.wakes_applied.append(wave)

    def _on_utility(self, call: UtilityCall) -> None:
        # Shaped like vLLM's UtilityOutput array: [call_id, failure_message, result],
        # the result as vLLM's UtilityResult encodes it: [type info (nil), value].
        if call.method == "reset_prefix_cache":
            running = bool(call.args[0]) if call.args else False
            output: list[Any] = [call.call_id, None, [None, self.reset_prefix_cache(running)]]
        else:
            failure = f"simulated engine has no utility method {call.method!r}"
            output = [call.call_id, failure, None]
        with contextlib.suppress(IndexError):
            self.agent.send_output(call.client_index, EngineCoreOutputs(utility_output=output))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's `reset_prefix_cache`: forget every cached block (AllBlocksCleared).

        Refused (False) while requests hold blocks, unless `reset_running_requests`,
        which sends them back to the queue to start again.
        """
        done = self.scheduler.reset_prefix_cache(reset_running_requests)
        if done:
            self.counters.prefix_cache_resets += 1
            self._publish_kv_events()
        logger.info("rank %d: prefix cache reset %s", self.rank, "done" if done else "refused")
        return done

    # ------------------------------------------------------------ outbound

    def _maybe_publish_counts(self) -> None:
        if not (self.config.publish_stats and self.agent.has_coordinator):
            return
        counts = (self.num_running, self.num_waiting)
        if counts == self._last_counts:
            return
        self._last_counts = counts
        kv = self.scheduler.kv_cache_usage
        lockstep = self.config.lockstep
        self.agent.send_stats(
            waiting=counts[1],
            running=counts[0],
            kv_cache_usage=kv,
            step_counter=self.step_counter if lockstep else 0,
            current_wave=self.current_wave if lockstep else 0,
        )

    def _send_step_outputs(self, result: StepResult) -> None:
        """One message per frontend: token outputs, finished ids, maybe the cache stats."""
        outputs: dict[int, list[Any]] = {}
        finished: dict[int, list[str]] = {}
        done = {id(active) for active in result.finished}
        for active in result.first_tokens:
            if active.work.vllm:
                final = id(active) in done
                outputs.setdefault(active.work.client_index, []).append(token_output(
                    active.request_id, [active.token(0)],
                    finish_reason=FINISH_LENGTH if final else None,
                    prefill_stats=self._prefill_stats(active)))
        for active in result.finished:
            client = active.work.client_index
            finished.setdefault(client, []).append(active.request_id)
            if active.work.vllm and active.work.decode_steps > 1:
                last = active.token(active.work.decode_steps - 1)
                outputs.setdefault(client, []).append(
                    token_output(active.request_id, [last], finish_reason=FINISH_LENGTH))
        self.counters.finished += len(result.finished)
        self._send_outputs(outputs, finished)

    def _prefill_stats(self, active: Active) -> PrefillStats:
        prompt, cached = active.prompt_len, active.cached_tokens
        size = self.config.block_size
        created = 0
        if active.work.cacheable and self.config.enable_prefix_caching:
            created = max(0, (prompt // size) * size - cached)
        return prefill_stats_for(prompt, cached, created)

    def _send_outputs(self, outputs: dict[int, list[Any]], finished: dict[int, list[str]]) -> None:
        stats = self.scheduler.take_prefix_stats() if self.config.log_stats else None
        clients = list(dict.fromkeys([*outputs, *finished]))
        if stats is not None and not clients and self.agent.num_outputs:
            clients = [0]  # vLLM returns the stats even in a step without outputs
        for position, client in enumerate(clients):
            message = EngineCoreOutputs(
                outputs=outputs.get(client, []),
                finished_requests=finished.get(client),
            )
            if position == 0 and stats is not None:
                # vLLM gives the stats to one frontend: the first with outputs.
                message.scheduler_stats = SchedulerStats(
                    num_running_reqs=self.num_running,
                    num_waiting_reqs=self.num_waiting,
                    kv_cache_usage=self.scheduler.kv_cache_usage,
                    prefix_cache_stats=stats,
                )
            try:
                self.agent.send_output(client, message)
            except IndexError as exc:
                logger.warning("rank %d: outputs not delivered: %s", self.rank, exc)

    def _report_rejected(self) -> None:
        rejected, self.scheduler.rejected = self.scheduler.rejected, []
        if not rejected:
            return
        outputs: dict[int, list[Any]] = {}
        finished: dict[int, list[str]] = {}
        for active in rejected:
            logger.warning(
                "rank %d: request %r needs more KV blocks than the cache has (%d); refused",
                self.rank, active.request_id, self.config.kv_blocks)
            client = active.work.client_index
            finished.setdefault(client, []).append(active.request_id)
            outputs.setdefault(client, []).append(
                token_output(active.request_id, [], finish_reason=FINISH_ERROR))
        self.counters.rejected += len(rejected)
        self._send_outputs(outputs, finished)

    def _publish_kv_events(self) -> None:
        if self.publisher is None:
            return
        events = self.scheduler.take_events()
        if events:
            self.publisher.publish(events)
            self.counters.kv_event_batches += 1

    def _send_start_wave(self, wave: int) -> None:
        self.counters.start_waves_sent.append(wave)
        self.agent.send_start_wave(wave)

    def _send_wave_complete(self, wave: int) -> None:
        self.counters.wave_completes_sent.append(wave)
        if self.agent.has_coordinator:
            self.agent.send_wave_complete(wave)
        elif self.agent.num_outputs:
            # Without a coordinator vLLM tells its own frontend (client 0) instead.
            self.agent.send_output(0, EngineCoreOutputs(wave_complete=wave))

    def _send_finished(self, client_index: int, request_ids: list[str]) -> None:
        try:
            self.agent.send_output(client_index, EngineCoreOutputs(finished_requests=request_ids))
        except IndexError as exc:
            logger.warning("rank %d: finished requests not reported: %s", self.rank, exc)

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly report of what this engine did."""
        c = self.counters
        return {
            "rank": self.rank,
            "wave": self.current_wave,
            "running": self.engines_running,
            "steps": c.steps,
            "dummy_steps": c.dummy_steps,
            "collectives": c.collectives,
            "added": c.added,
            "finished": c.finished,
            "aborted": c.aborted,
            "dropped": c.dropped,
            "rejected": c.rejected,
            "prompt_tokens": self.scheduler.prompt_tokens,
            "hit_tokens": self.scheduler.hit_tokens,
            "prefill_tokens": self.scheduler.prefill_tokens,
            "preempted": self.scheduler.preempted,
            "cached_blocks": self.scheduler.pool.num_cached,
            "evicted_blocks": self.scheduler.pool.evictions,
            "kv_cache_usage": round(self.scheduler.kv_cache_usage, 4),
            "kv_event_batches": c.kv_event_batches,
            "prefix_cache_resets": c.prefix_cache_resets,
            "start_waves_sent": c.start_waves_sent[-20:],
            "wave_completes_sent": c.wave_completes_sent[-20:],
            "hang_count": len(self.hangs),
            "hangs": [str(h) for h in self.hangs[-10:]],
            "failed": None if self.failed is None else str(self.failed),
        }
