"""Prefix-reusing workloads: determinism, growing histories, and the ideal reuse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.sim.request import SimWork, answer_tokens
from coordinator.sim.scheduler import SchedulerConfig, SimScheduler
from coordinator.sim.workload import (
    ChatConfig,
    DocumentsConfig,
    Session,
    Turn,
    ideal_reuse,
    plan_chat,
    plan_documents,
)


def prompts(session: Session) -> list[list[int]]:
    return [session.prompt(index) for index in range(len(session.turns))]


def test_the_same_seed_plans_the_same_traffic_and_another_seed_other_traffic() -> None:
    config = ChatConfig(sessions=5, turns=3, system_prompt_tokens=40)
    first, again, other = plan_chat(config, 1), plan_chat(config, 1), plan_chat(config, 2)
    assert [prompts(s) for s in first] == [prompts(s) for s in again]
    assert [s.turns for s in first] == [s.turns for s in again]
    assert [prompts(s) for s in first] != [prompts(s) for s in other]
    docs = DocumentsConfig(documents=2, document_tokens=50, questions=6)
    assert [prompts(s) for s in plan_documents(docs, 4)] == [
        prompts(s) for s in plan_documents(docs, 4)]


def test_a_chat_history_grows_by_each_turns_prompt_and_answer() -> None:
    config = ChatConfig(sessions=4, turns=4, system_prompts=2, system_prompt_tokens=30,
                        user_tokens=(3, 9), answer_tokens=(2, 7), think_s=0.25)
    sessions = plan_chat(config, 9)
    assert len({s.prefix for s in sessions}) <= 2
    for session in sessions:
        turns = prompts(session)
        assert turns[0] == [*session.prefix, *session.turns[0].user_tokens]
        for index in range(1, len(turns)):
            before = turns[index - 1]
            answer = answer_tokens(before, session.turns[index - 1].max_tokens)
            assert turns[index] == [*before, *answer, *session.turns[index].user_tokens]
        assert all(t.think_s >= 0 for t in session.turns)
        assert all(2 <= t.max_tokens <= 7 for t in session.turns)
    with pytest.raises(IndexError):
        sessions[0].prompt(4)
    assert sessions[0].prompt_tokens == sum(len(p) for p in prompts(sessions[0]))


def test_documents_are_shared_prefixes_of_one_turn_sessions() -> None:
    sessions = plan_documents(DocumentsConfig(documents=3, document_tokens=64, questions=30,
                                              question_tokens=(4, 8)), 1)
    assert len({s.prefix for s in sessions}) == 3
    assert all(len(s.turns) == 1 and len(s.prefix) == 64 for s in sessions)


@pytest.mark.parametrize("bad", [
    ChatConfig(sessions=0), ChatConfig(user_tokens=(5, 2)), ChatConfig(answer_tokens=(0, 3)),
    ChatConfig(think_s=-1.0), DocumentsConfig(questions=0), DocumentsConfig(document_tokens=0),
])
def test_bad_plans_are_refused(bad: ChatConfig | DocumentsConfig) -> None:
    with pytest.raises(ValueError):
        bad.validate()


def test_the_ideal_counts_whole_blocks_before_the_last_token_of_what_was_computed() -> None:
    head = list(range(40))
    # The first request computes 40 + 3 - 1 = 42 tokens: two full blocks of 16.
    # The second shares 35 tokens, and may use at most (41 - 1) // 16 = 2 blocks.
    second = [*head[:35], 7, 7, 7, 7, 7, 7]
    assert ideal_reuse([(head, 3), (second, 1)], 16) == 32
    assert ideal_reuse([(head, 3), (head[:20], 1)], 16) == 16
    assert ideal_reuse([(head, 3), ([1, *head], 1)], 16) == 0
    # An answer is part of what the next turn can reuse.
    turn2 = [*head, *answer_tokens(head, 30), 5, 5]
    assert ideal_reuse([(head, 30), (turn2, 1)], 16) == ((40 + 29) // 16) * 16
    with pytest.raises(ValueError):
        ideal_reuse([], 0)


def test_a_capacity_limits_the_ideal_with_lru_eviction() -> None:
    a, b = list(range(64)), list(range(100, 164))
    plan = [(a, 1), (b, 1), (a, 1)]
    assert ideal_reuse(plan, 16) == 48
    assert ideal_reuse(plan, 16, capacity_blocks=8) == 48
    assert ideal_reuse(plan, 16, capacity_blocks=4) == 0  # b pushed a out
    assert ideal_reuse([(a, 1), (a, 1), (b, 1), (a, 1)], 16, capacity_blocks=5) == 48


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), block=st.sampled_from([4, 16]))
def test_one_engine_running_turns_in_order_reaches_the_ideal_exactly(seed: int,
                                                                     block: int) -> None:
    """The ideal is the engine's own prefix cache when nothing competes and nothing evicts."""
    sessions = plan_chat(ChatConfig(sessions=3, turns=3, system_prompts=2,
                                    system_prompt_tokens=37, user_tokens=(1, 20),
                                    answer_tokens=(1, 12), think_s=0.0), seed)
    sent = []
    engine = SimScheduler(SchedulerConfig(block_size=block, kv_blocks=10_000))
    for session in sessions:
        for index, turn in enumerate(session.turns):
            prompt = session.prompt(index)
            sent.append((prompt, turn.max_tokens))
            engine.add(SimWork(f"{session.session_id}-{index}", 0, 0, turn.max_tokens,
                               prompt, cacheable=True, vllm=True), 0.0)
            while engine.has_work:
                engine.complete(engine.schedule(), 0.0)
    assert engine.hit_tokens == ideal_reuse(sent, block)
    assert ideal_reuse(sent, block) == ideal_reuse(sent, block, capacity_blocks=10_000)


def test_a_turn_is_a_frozen_value() -> None:
    turn = Turn((1, 2), 3)
    with pytest.raises(AttributeError):
        turn.max_tokens = 4  # type: ignore[misc]
