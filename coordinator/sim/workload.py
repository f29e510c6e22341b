"""Traffic that reuses prompt prefixes, planned from a seed, and the reuse it allows at best.

Two workloads, both lists of *sessions*: a session is a prefix every one of
its prompts starts with, and turns sent one after the other.

Multi-turn chat (`plan_chat`)
    Every session starts from one of a few shared system prompts. Turn ``k``
    sends the system prompt, then for every earlier turn its user message and
    the answer the engine gave, then turn ``k``'s user message: the history
    grows by each turn's prompt and answer, as a chat frontend re-sends it.
    Between turns the user thinks (exponentially distributed, mean
    ``think_s``). The answer is what a simulated engine generates for that
    prompt (`coordinator.sim.request.answer_tokens`), so the history the next
    turn sends is exactly what the engine computed.

Shared documents (`plan_documents`)
    A few long documents; every question is a one-turn session whose prompt
    is one document (chosen at random) followed by the question.

Everything is drawn from ``random.Random(seed)``: the same seed gives the
same sessions, prompts, lengths and think times in any process.

The ideal (`ideal_reuse`)
    The benchmark's denominator: how many prompt tokens a prefix cache could
    serve if every request ran where the prompts before it left their KV,
    capacity permitting. Requests are taken in the order they were sent;
    each one can reuse the longest run of leading full blocks of its prompt,
    less the last token (which an engine always computes), that some earlier
    request computed (its prompt and its answer but the last token). With a
    capacity, computed blocks live in one LRU cache of that many blocks (the
    pooled capacity of the group, an upper bound for any placement); without
    one, nothing is ever evicted. Concurrent requests count as if each earlier
    one had finished, so the figure is a bound, never an under-estimate.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from coordinator.sim.request import answer_tokens

__all__ = [
    "ChatConfig",
    "DocumentsConfig",
    "Session",
    "Turn",
    "ideal_reuse",
    "plan_chat",
    "plan_documents",
]

# Prompt token ids: below the range simulated answers use, above special tokens.
_PROMPT_VOCAB = (100, 1000)


@dataclass(frozen=True)
class Turn:
    """One request of a session: what the user adds, how long the answer is, then a pause."""

    user_tokens: tuple[int, ...]
    max_tokens: int
    think_s: float = 0.0


@dataclass
class Session:
    """A prefix and turns sent one after the other; `prompt()` builds each turn's prompt."""

    session_id: str
    prefix: tuple[int, ...]
    turns: list[Turn]
    # The history before each turn built so far (the prefix, then every exchange).
    _histories: list[list[int]] = field(default_factory=list, repr=False)

    def prompt(self, index: int) -> list[int]:
        """Turn ``index``'s prompt: the prefix, every earlier exchange, this user message."""
        if not 0 <= index < len(self.turns):
            raise IndexError(f"session {self.session_id} has no turn {index}")
        histories = self._histories
        if not histories:
            histories.append(list(self.prefix))
        while len(histories) <= index:
            previous = self.turns[len(histories) - 1]
            asked = histories[-1] + list(previous.user_tokens)
            histories.append(asked + answer_tokens(asked, previous.max_tokens))
        return [*histories[index], *self.turns[index].user_tokens]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all turns."""
        return sum(len(self.prompt(index)) for index in range(len(self.turns)))


@dataclass(frozen=True)
class ChatConfig:
    """Multi-turn chat sessions (see the module docstring)."""

    sessions: int = 64
    turns: int = 4
    system_prompts: int = 2
    system_prompt_tokens: int = 1024
    user_tokens: tuple[int, int] = (64, 256)
    answer_tokens: tuple[int, int] = (32, 192)
    think_s: float = 0.5

    def validate(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.system_prompts < 1:
            raise ValueError("sessions, turns and system_prompts must be at least 1")
        if self.system_prompt_tokens < 0 or self.think_s < 0:
            raise ValueError("system_prompt_tokens and think_s must not be negative")
        _check_range("user_tokens", self.user_tokens, 1)
        _check_range("answer_tokens", self.answer_tokens, 1)


@dataclass(frozen=True)
class DocumentsConfig:
    """Many questions over a few long documents (see the module docstring)."""

    documents: int = 4
    document_tokens: int = 4096
    questions: int = 256
    question_tokens: tuple[int, int] = (16, 96)
    answer_tokens: tuple[int, int] = (16, 128)

    def validate(self) -> None:
        if self.documents < 1 or self.document_tokens < 1 or self.questions < 1:
            raise ValueError("documents, document_tokens and questions must be at least 1")
        _check_range("question_tokens", self.question_tokens, 1)
        _check_range("answer_tokens", self.answer_tokens, 1)


def _check_range(name: str, bounds: tuple[int, int], least: int) -> None:
    low, high = bounds
    if not least <= low <= high:
        raise ValueError(f"{name} must be a range ({least} <= low <= high), got {bounds}")


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    low, high = _PROMPT_VOCAB
    return tuple(rng.randrange(low, high) for _ in range(count))


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def plan_chat(config: ChatConfig, seed: int) -> list[Session]:
    """The sessions of a multi-turn chat workload, the same for the same seed."""
    config.validate()
    rng = random.Random(f"chat {seed}")
    systems = [_tokens(rng, config.system_prompt_tokens) for _ in range(config.system_prompts)]
    sessions = []
    for index in range(config.sessions):
        turns = [
            Turn(_tokens(rng, _length(rng, config.user_tokens)),
                 _length(rng, config.answer_tokens),
                 rng.expovariate(1.0 / config.think_s) if config.think_s > 0 else 0.0)
            for _ in range(config.turns)
        ]
        sessions.append(Session(f"chat-{seed}-{index}", rng.choice(systems), turns))
    return sessions


def plan_documents(config: DocumentsConfig, seed: int) -> list[Session]:
    """One-question sessions over shared documents, the same for the same seed."""
    config.validate()
    rng = random.Random(f"documents {seed}")
    documents = [_tokens(rng, config.document_tokens) for _ in range(config.documents)]
    return [
        Session(f"doc-{seed}-{index}", rng.choice(documents),
                [Turn(_tokens(rng, _length(rng, config.question_tokens)),
                      _length(rng, config.answer_tokens))])
        for index in range(config.questions)
    ]


def ideal_reuse(
    requests: Iterable[tuple[Sequence[int], int]],
    block_size: int,
    capacity_blocks: int | None = None,
) -> int:
    """Prompt tokens a prefix cache could serve at best; `requests` in the order sent."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    if capacity_blocks is not None and capacity_blocks < 1:
        raise ValueError("capacity_blocks must be at least 1")
    cache: OrderedDict[int, None] = OrderedDict()
    total = 0
    for prompt, max_tokens in requests:
        computed = [*prompt, *answer_tokens(prompt, max(0, max_tokens - 1))]
        keys = _chain(computed, block_size)
        usable = max(0, len(prompt) - 1) // block_size
        hits = 0
        while hits < usable and keys[hits] in cache:
            hits += 1
        total += hits * block_size
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return total


def _chain(tokens: Sequence[int], block_size: int) -> list[int]:
    keys = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys
