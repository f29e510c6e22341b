"""The simulated engine's scheduler, step by step: prefill, decode, cache hits, capacity."""

from __future__ import annotations

from coordinator.protocol.kv_events import AllBlocksCleared, BlockStored
from coordinator.protocol.vllm import PrefixCacheStats
from coordinator.sim.request import SimWork, answer_tokens
from coordinator.sim.scheduler import SchedulerConfig, SimScheduler, StepResult

BS = 16


def vllm_work(request_id: str, prompt: list[int], steps: int, **extra: object) -> SimWork:
    return SimWork(request_id, 0, 0, steps, prompt, cacheable=True, vllm=True,
                   **extra)  # type: ignore[arg-type]


def step(sched: SimScheduler, now: float = 0.0) -> tuple[int, StepResult]:
    plan = sched.schedule()
    return plan.prefill_tokens, sched.complete(plan, now)


def run_to_end(sched: SimScheduler, limit: int = 1000) -> list[tuple[int, StepResult]]:
    steps = []
    while sched.has_work:
        steps.append(step(sched, float(len(steps))))
        assert len(steps) < limit
    return steps


def test_a_request_without_a_prompt_runs_its_decode_steps_and_nothing_else() -> None:
    sched = SimScheduler(SchedulerConfig(max_batch=4))
    sched.add(SimWork("s", 0, 0, 3), 0.0)
    steps = run_to_end(sched)
    assert [prefill for prefill, _ in steps] == [0, 0, 0]
    assert [len(r.first_tokens) for _, r in steps] == [1, 0, 0]
    assert [len(r.finished) for _, r in steps] == [0, 0, 1]
    assert sched.take_prefix_stats() is None and sched.pool.num_cached == 0


def test_prefill_then_decode_and_the_kv_of_prompt_plus_answer_stays_cached() -> None:
    sched = SimScheduler(SchedulerConfig(max_batch=4, record_events=True))
    prompt = list(range(40))
    sched.add(vllm_work("a", prompt, 3), 0.0)
    assert sched.kv_cache_usage == 0.0
    prefill, first = step(sched, 1.0)
    assert prefill == 40 and [a.request_id for a in first.first_tokens] == ["a"]
    assert first.first_tokens[0].first_token_at == 1.0
    steps = run_to_end(sched)
    assert [p for p, _ in steps] == [0, 0] and steps[-1][1].finished
    # 40 + 3 - 1 = 42 tokens of KV: two full blocks, prompt and the first answer token.
    stored = [e for e in sched.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]
    assert stored[0].token_ids == prompt[:32]
    assert sched.take_prefix_stats() == PrefixCacheStats(requests=1, queries=40, hits=0)
    assert sched.pool.num_cached == 2 and sched.pool.usage == 0.0


def test_the_next_turn_hits_its_history_and_computes_only_the_rest() -> None:
    sched = SimScheduler(SchedulerConfig(max_batch=4))
    turn1 = list(range(100, 190))  # 90 tokens
    sched.add(vllm_work("t1", turn1, 20), 0.0)
    run_to_end(sched)
    history = turn1 + answer_tokens(turn1, 20)  # 110 tokens, 109 of them computed
    turn2 = history + list(range(500, 530))
    sched.add(vllm_work("t2", turn2, 5), 0.0)
    prefill, _ = step(sched)
    cached = (109 // BS) * BS
    assert prefill == len(turn2) - cached
    assert sched.take_prefix_stats() == PrefixCacheStats(
        requests=2, queries=90 + len(turn2), hits=cached)
    assert (sched.prompt_tokens, sched.hit_tokens) == (90 + len(turn2), cached)


def test_a_changed_salt_or_adapter_misses() -> None:
    sched = SimScheduler(SchedulerConfig())
    prompt = list(range(64))
    sched.add(vllm_work("a", prompt, 1, cache_salt="x"), 0.0)
    run_to_end(sched)
    sched.add(vllm_work("b", prompt, 1, cache_salt="y"), 0.0)
    assert step(sched)[0] == 64
    sched.add(vllm_work("c", prompt, 1, cache_salt="x"), 0.0)
    assert step(sched)[0] == 64 - 48


def test_the_token_budget_chunks_a_long_prefill_and_decodes_go_first() -> None:
    sched = SimScheduler(SchedulerConfig(max_batch=2, max_num_batched_tokens=32))
    sched.add(SimWork("d", 0, 0, 10), 0.0)
    step(sched)  # d is decoding now
    sched.add(vllm_work("p", list(range(100)), 2), 0.0)
    chunks = [step(sched)[0] for _ in range(4)]
    # d's decode token comes out of each step's 32 first.
    assert chunks == [31, 31, 31, 7]
    assert sched.running["p"].generated == 1


def test_admission_waits_for_blocks_and_refuses_what_can_never_fit() -> None:
    sched = SimScheduler(SchedulerConfig(max_batch=8, kv_blocks=8))
    sched.add(vllm_work("big", list(range(200)), 1), 0.0)  # 13 blocks > 8
    sched.add(vllm_work("a", list(range(1000, 1080)), 17), 0.0)  # 96 tokens: 6 blocks
    sched.add(vllm_work("b", list(range(2000, 2040)), 1), 0.0)  # 3 blocks: waits for a
    sched.add(SimWork("s", 0, 0, 1), 0.0)  # behind b: first come, first served
    step(sched)
    assert [a.request_id for a in sched.rejected] == ["big"]
    assert list(sched.running) == ["a"] and [w.request_id for w in sched.waiting] == ["b", "s"]
    while "a" in sched.running:
        step(sched)
    step(sched)
    assert "b" not in sched.running and not sched.waiting  # b and s ran and finished
    assert not sched.holds("big")


def test_an_abort_frees_the_blocks_wherever_the_request_is() -> None:
    sched = SimScheduler(SchedulerConfig(kv_blocks=8))
    sched.add(vllm_work("a", list(range(70)), 30), 0.0)
    sched.add(vllm_work("b", list(range(1000, 1070)), 30), 0.0)
    step(sched)
    assert sched.pool.usage > 0 and [w.request_id for w in sched.waiting] == ["b"]
    gone = sched.abort(["a", "b", "nobody"])
    assert {a.request_id for a in gone} == {"a", "b"}
    assert sched.pool.usage == 0 and sched.pool.reserved == 0 and not sched.has_work
    assert sched.abort(["a"]) == []
    assert sched.add(vllm_work("a", [1, 2], 1), 0.0) is not None


def test_duplicate_request_ids_are_refused() -> None:
    sched = SimScheduler(SchedulerConfig())
    assert sched.add(SimWork("x", 0, 0, 2), 0.0) is not None
    assert sched.add(SimWork("x", 0, 0, 2), 0.0) is None


def test_reset_is_refused_while_blocks_are_in_use_or_preempts_when_asked() -> None:
    sched = SimScheduler(SchedulerConfig(record_events=True))
    prompt = list(range(48))
    sched.add(vllm_work("a", prompt, 4), 0.0)
    step(sched)
    sched.take_events()
    sched.take_prefix_stats()
    assert not sched.reset_prefix_cache()
    assert sched.take_events() == [] and sched.take_prefix_stats() is None
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert sched.take_events() == [AllBlocksCleared()]
    assert sched.take_prefix_stats() == PrefixCacheStats(reset=True)
    assert [w.request_id for w in sched.waiting] == ["a"] and sched.preempted == 1
    # Re-admitted: it recomputes its prompt and the token it had sampled, and is
    # counted among the preempted requests.
    prefill, result = step(sched)
    assert prefill == 49 and not result.first_tokens
    assert sched.take_prefix_stats() == PrefixCacheStats(
        preempted_requests=1, preempted_queries=49, preempted_hits=0)
    steps = run_to_end(sched)
    assert steps[-1][1].finished[0].generated == 4
    assert sched.reset_prefix_cache()
