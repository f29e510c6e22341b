"""A simulated engine's scheduler: admission, a token budget per step, the prefix cache.

Theory of operation
-------------------
Requests wait in arrival order and run in a batch of at most ``max_batch``.
A request has a prompt of ``P`` tokens (none for a ``SimRequest``) and asks
for ``N`` output tokens. Its progress is two counts, as in vLLM: ``computed``
(tokens whose KV exists) and ``generated`` (tokens sampled). A step computes
up to ``P + generated`` tokens and then samples one more; so the step that
finishes the prompt (the prefill) yields the first token, and each later
step computes the previous token and samples the next (a decode step). The
request is done when ``generated == N``: it then holds the KV of
``P + N - 1`` tokens, whose full blocks stay cached after it leaves.

Every step shares ``max_num_batched_tokens`` among the running requests in
admission order: a decode takes one token, a prefill as many as are left
(chunked when the budget runs out). The step's duration is the engine's base
step time plus ``prefill_s_per_token`` for every prompt token computed (the
engine applies it; ``StepPlan.prefill_tokens`` is the count). A prefix-cache
hit means those tokens are never computed: a shorter time to first token for
the request, and a shorter step for everyone in it (in lockstep, for the
whole group).

===================  ==========================================================
event                effect
===================  ==========================================================
add(work)            queued at the back; a duplicate request id is refused
schedule()           admits from the front while the batch has room: a request
                     with a prompt looks up its cached prefix, takes those blocks
                     and reserves the rest it will ever need (its KV cannot run
                     out mid-way, so nothing is preempted for room); when the
                     blocks do not fit it waits, and so does everyone behind it
                     (first come, first served). Then the budget is shared and
                     each request's blocks for this step are allocated and the
                     newly full ones cached (KV events: evictions, stores)
complete(plan)       applies the step: computed tokens, sampled tokens, first
                     tokens, finished requests (their blocks freed, kept cached)
abort(ids)           the requests leave wherever they are; blocks freed
reset_prefix_cache   vLLM's: refused while any block is in use, unless running
                     requests are preempted first (back to the front of the
                     queue, their KV lost; re-admission looks up again)
===================  ==========================================================

A request that could never fit (more blocks than the cache has) is rejected
at admission; vLLM refuses such prompts before they reach the engine.

Prefix-cache statistics are vLLM's ``PrefixCacheStats`` deltas: at each
admission with a lookup, ``requests`` + 1, ``queries`` + the request's
tokens, ``hits`` + its cached tokens (the ``preempted_*`` fields for a
re-admission); ``reset`` when the cache was reset. ``take_prefix_stats``
hands them out and starts again, as vLLM's ``make_stats`` does.

This module does no IO and reads no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from coordinator.protocol.kv_events import KVEvent
from coordinator.protocol.vllm import PrefixCacheStats
from coordinator.sim.prefix_cache import BlockPool, CacheRequest, MultiModalSpan
from coordinator.sim.request import SimWork, answer_tokens

__all__ = ["Active", "SchedulerConfig", "SimScheduler", "StepPlan", "StepResult"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64
    block_size: int = 16
    kv_blocks: int = 4096
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 8192
    record_events: bool = False

    def validate(self) -> None:
        if self.max_batch < 1 or self.block_size < 1 or self.kv_blocks < 1:
            raise ValueError("max_batch, block_size and kv_blocks must be at least 1")
        if self.max_num_batched_tokens < self.max_batch:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must cover one "
                f"decode token per running request (max_batch {self.max_batch})"
            )


@dataclass(eq=False)
class Active:
    """One request inside the engine."""

    work: SimWork
    arrived_at: float
    #: The request's tokens in the cache; None for a request without a prompt.
    cache: CacheRequest | None
    prompt_len: int
    generated: int = 0
    computed: int = 0
    admitted: bool = False
    preemptions: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    _answer: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.work.request_id

    @property
    def target(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.prompt_len + self.generated

    def final_tokens(self) -> int:
        """Tokens whose KV the request holds when it finishes."""
        return self.prompt_len + self.work.decode_steps - 1

    def token(self, index: int) -> int:
        """Generated token ``index`` (0-based)."""
        if not self._answer:
            self._answer = answer_tokens(self.work.prompt_token_ids, self.work.decode_steps)
        return self._answer[index]


@dataclass
class StepPlan:
    """What one step computes: (request, tokens) in order, and how many were prompt tokens."""

    work: list[tuple[Active, int]] = field(default_factory=list)
    prefill_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.work


@dataclass
class StepResult:
    first_tokens: list[Active] = field(default_factory=list)
    finished: list[Active] = field(default_factory=list)


class SimScheduler:
    """The waiting queue, the running batch and the KV cache of one engine."""

    def __init__(self, config: SchedulerConfig, *, root_hash: bytes | None = None) -> None:
        config.validate()
        self.config = config
        self.pool = BlockPool(
            config.kv_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            record_events=config.record_events,
            root_hash=root_hash,
        )
        self.waiting: deque[Active] = deque()
        self.running: dict[str, Active] = {}
        self._held: dict[str, Active] = {}
        self._stats = PrefixCacheStats()
        self.rejected: list[Active] = []
        # Totals over the engine's life, for its summary.
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.prefill_tokens = 0
        self.preempted = 0

    # --- queries ---------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def kv_cache_usage(self) -> float:
        """Blocks in use; a request without a prompt counts as 1/max_batch of the cache."""
        promptless = sum(1 for a in self.running.values() if a.cache is None)
        return min(1.0, self.pool.usage + promptless / self.config.max_batch)

    # --- events ----------------------------------------------------------

    def add(self, work: SimWork, now: float) -> Active | None:
        """Queue a request; None if its id is already held."""
        if work.request_id in self._held:
            return None
        cache = None
        if work.prompt_token_ids:
            lora = work.lora
            cache = CacheRequest(
                work.request_id,
                list(work.prompt_token_ids),
                lora_name=None if lora is None else lora.lora_name,
                lora_path="" if lora is None else lora.lora_path,
                lora_id=None if lora is None else lora.lora_int_id,
                mm=tuple(
                    MultiModalSpan(f.identifier, f.mm_position.offset, f.mm_position.length)
                    for f in work.mm_features
                ),
                cache_salt=work.cache_salt,
                session_id=work.session_id,
            )
        active = Active(work, now, cache, len(work.prompt_token_ids))
        self._held[work.request_id] = active
        self.waiting.append(active)
        return active

    def abort(self, request_ids: Iterable[str]) -> list[Active]:
        """Remove these requests wherever they are; the ones that were held."""
        gone = [self._held.pop(rid) for rid in set(request_ids) if rid in self._held]
        if not gone:
            return []
        ids = {a.request_id for a in gone}
        self.waiting = deque(a for a in self.waiting if a.request_id not in ids)
        for active in gone:
            if self.running.pop(active.request_id, None) is not None and active.cache:
                self.pool.free(active.cache)
        return gone

    def schedule(self) -> StepPlan:
        """Admit what fits, share the token budget, allocate and cache this step's blocks."""
        self._admit()
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        for active in self.running.values():
            need = active.target - active.computed
            tokens = min(need, budget)
            if need > 0 and tokens == 0:
                continue  # out of budget this step
            budget -= tokens
            plan.work.append((active, tokens))
            in_prefill = active.generated == 0 or active.computed < active.target - 1
            if in_prefill:
                plan.prefill_tokens += tokens
            cache = active.cache
            if cache is not None and tokens:
                upto = active.computed + tokens
                # The generated tokens a block needs are known: they were sampled.
                while len(cache.tokens) < upto:
                    cache.tokens.append(active.token(len(cache.tokens) - active.prompt_len))
                self.pool.allocate(cache, upto)
                if active.work.cacheable:
                    self.pool.commit(cache, upto)
        self.prefill_tokens += plan.prefill_tokens
        return plan

    def complete(self, plan: StepPlan, now: float) -> StepResult:
        """Apply a planned step once its time has passed."""
        result = StepResult()
        for active, tokens in plan.work:
            if active.request_id not in self.running:
                continue  # aborted meanwhile
            active.computed += tokens
            if active.computed < active.target:
                continue  # a chunk of a longer prefill
            active.generated += 1
            if active.generated == 1:
                active.first_token_at = now
                result.first_tokens.append(active)
            if active.generated >= active.work.decode_steps:
                del self.running[active.request_id]
                del self._held[active.request_id]
                if active.cache is not None:
                    self.pool.free(active.cache)
                result.finished.append(active)
        return result

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's reset: False while blocks are in use, unless running requests are preempted."""
        if reset_running_requests:
            for active in reversed(list(self.running.values())):
                self._preempt(active)
            self.running.clear()
        done = self.pool.reset()
        if done:
            self._stats.reset = True
        return done

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def take_prefix_stats(self) -> PrefixCacheStats | None:
        """The statistics since the last call, or None when nothing was recorded."""
        stats = self._stats
        if not (stats.requests or stats.preempted_requests or stats.reset):
            return None
        self._stats = PrefixCacheStats()
        return stats

    # --- internals -------------------------------------------------------

    def _admit(self) -> None:
        pool = self.pool
        while self.waiting and len(self.running) < self.config.max_batch:
            active = self.waiting[0]
            cache = active.cache
            if cache is not None:
                total = pool.blocks_for(active.final_tokens())
                if total > pool.num_blocks:
                    self.waiting.popleft()
                    del self._held[active.request_id]
                    self.rejected.append(active)
                    continue
                # All tokens sampled so far are part of what is looked up (after a
                # preemption), as vLLM's request.num_tokens is.
                while len(cache.tokens) < active.target:
                    cache.tokens.append(active.token(len(cache.tokens) - active.prompt_len))
                lookup = active.work.cacheable and pool.enable_caching
                hits = pool.lookup(cache) if lookup else 0
                if not pool.admit(cache, hits, total):
                    return
                active.computed = hits * pool.block_size
                if lookup:
                    self._record(active, active.target, active.computed)
            self.waiting.popleft()
            active.admitted = True
            self.running[active.request_id] = active

    def _record(self, active: Active, queries: int, hits: int) -> None:
        stats = self._stats
        if active.preemptions:
            stats.preempted_requests += 1
            stats.preempted_queries += queries
            stats.preempted_hits += hits
            return
        stats.requests += 1
        stats.queries += queries
        stats.hits += hits
        active.cached_tokens = hits
        self.prompt_tokens += queries
        self.hit_tokens += hits

    def _preempt(self, active: Active) -> None:
        if active.cache is not None:
            self.pool.free(active.cache)
        active.computed = 0
        active.admitted = False
        active.preemptions += 1
        self.preempted += 1
        self.waiting.appendleft(active)
