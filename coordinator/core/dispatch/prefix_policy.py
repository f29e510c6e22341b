"""The ``prefix`` policy: the routing rule fed with the prefix index and token loads.

Theory of operation
-------------------
``routing.choose_rank`` is the rule; this module gives it its inputs and
remembers what it decided:

* the request's prompt (``RoutePrompt``): its token ids and the keys vLLM
  mixes into a block's hash (LoRA name, cache salt, multimodal items), read
  from the vLLM ADD payload the submit carries or from the frontend
  protocol's ``PromptKeys``, and its session id;
* how many leading tokens each candidate has cached, from the prefix index
  (none while no index exists yet, or for prompts the index cannot match:
  prompt embeddings, no token ids);
* each candidate's load in tokens (``routing.TokenLoad``): its latest
  stats report plus the cost of everything dispatched to it since; in
  lockstep, also the largest load among ranks that step with the group but
  take no work (draining, cordoned);
* the session's last rank and the recent dispatch counts (affinity and
  spreading among near-equal ranks).

The lookup hashes each block of the prompt, the decision's main cost; a
turn of a conversation takes over the keys of what it repeats from the
previous turn's prompt (``SessionPrompts``), so it hashes only its new blocks.

A decision is committed with ``commit`` once the request is handed to its
rank (its cost joins the rank's load, its session moves there) and taken
back with ``undo`` if the send failed. A stats report from a rank clears
what was counted for it (``on_report``). ``counters`` say how decisions
went: by reason, with the prompt tokens seen and the tokens estimated to
hit the cache.

No IO, no clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.core.dispatch.balancer import LoadTable
from coordinator.core.dispatch.prefix_rule import (
    RecentDispatches,
    RouteDecision,
    RoutingConfig,
    SessionAffinity,
    TokenLoad,
    choose_rank,
)
from coordinator.core.kv.prefix_index import PrefixIndex, PromptBlocks, prompt_extras
from coordinator.protocol.engine_request import (
    AddRequestHead,
    MultiModalPlaceholder,
    PlaceholderRange,
)
from coordinator.protocol.frontend import PromptKeys

__all__ = ["PREFIX_POLICY", "PrefixRouter", "RouteCounters", "RoutePrompt", "SessionPrompts"]

PREFIX_POLICY = "prefix"
"""The policy name (``serve --policy prefix``)."""
RECENT_WINDOW = 256
MAX_SESSIONS = 1 << 16


@dataclass(frozen=True)
class RoutePrompt:
    """What the rule needs to know about one request's prompt."""

    token_ids: Sequence[int] | None
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: Sequence[MultiModalPlaceholder] | None = None
    session_id: str | None = None
    cacheable: bool = True
    """False when the engine keys the blocks by something the coordinator cannot
    recompute (prompt embeddings)."""

    @classmethod
    def from_add(cls, head: AddRequestHead) -> RoutePrompt:
        """From a decoded vLLM ADD payload."""
        return cls(head.prompt_token_ids, head.lora_name, head.cache_salt, head.mm_features,
                   head.session_id, head.cacheable)

    @classmethod
    def from_keys(cls, keys: PromptKeys) -> RoutePrompt:
        """From the frontend protocol's ``PromptKeys``."""
        features = None
        if keys.mm_items:
            features = [MultiModalPlaceholder(item.identifier,
                                              PlaceholderRange(item.offset, item.length))
                        for item in keys.mm_items]
        return cls(keys.token_ids, keys.lora_name, keys.cache_salt, features, keys.session_id)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def blocks(self, index: PrefixIndex,
               reuse: PromptBlocks | None = None) -> PromptBlocks | None:
        """The prompt prepared for ``index``'s queries, or None if it cannot match;
        ``reuse`` is an earlier prompt whose keys for shared blocks are taken over."""
        tokens = self.token_ids
        if tokens is None or not self.cacheable:
            return None
        num_blocks = max(0, len(tokens) - 1) // index.block_size
        extras = prompt_extras(num_blocks, index.block_size, lora_name=self.lora_name,
                               mm_features=self.mm_features, cache_salt=self.cache_salt)
        return index.prompt(tokens, extras, reuse)


class SessionPrompts:
    """The last prompt of each recent session, so the next turn keys only its new blocks.

    A turn of a conversation repeats the previous turn's prompt and adds to it;
    the keys of what it repeats are taken over (``PromptBlocks``), and hashing,
    the lookup's main cost, is paid only for the new blocks. Bounded by the
    bytes the prompts hold (least recently used first out).
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._prompts: OrderedDict[str, PromptBlocks] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, session: str | None) -> PromptBlocks | None:
        return None if session is None else self._prompts.get(session)

    def put(self, session: str, blocks: PromptBlocks) -> None:
        prompts = self._prompts
        old = prompts.pop(session, None)
        if old is not None:
            self._bytes -= old.nbytes
        size = blocks.nbytes
        if size > self.max_bytes:
            return
        while prompts and self._bytes + size > self.max_bytes:
            self._bytes -= prompts.popitem(last=False)[1].nbytes
        prompts[session] = blocks
        self._bytes += size


@dataclass
class RouteCounters:
    """How decisions went, for metrics; every field only grows."""

    reasons: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0  # prompt tokens of the requests routed
    cached_tokens: int = 0  # of those, estimated to hit the chosen rank's cache
    unmatched: int = 0  # requests routed without a prefix lookup (no index, no tokens)


class PrefixRouter:
    """Routing state of the ``prefix`` policy; see the module docstring."""

    def __init__(self, config: RoutingConfig, size: int) -> None:
        self.config = config
        self.token_load = TokenLoad(size, config)
        self.recent = RecentDispatches(RECENT_WINDOW)
        self.sessions = SessionAffinity(MAX_SESSIONS)
        self.prompts = SessionPrompts()
        self.counters = RouteCounters()

    def resize(self, size: int) -> None:
        self.token_load.resize(size)

    def choose(self, candidates: Sequence[int], table: LoadTable, index: PrefixIndex | None,
               prompt: RoutePrompt | None, *, stepping: Sequence[int] = ()) -> RouteDecision | None:
        """The rule's decision among ``candidates``; ``stepping`` are ranks that step
        with the group but take no work (their load counts towards the maximum)."""
        if not candidates:
            return None
        cached = None
        session = prompt.session_id if prompt is not None else None
        if prompt is not None and index is not None:
            blocks = prompt.blocks(index, self.prompts.get(session))
            if blocks is not None:
                cached = index.cached_tokens(blocks, candidates)
                if session is not None:
                    self.prompts.put(session, blocks)
        loads = self.token_load.loads(table, candidates)
        others = self.token_load.loads(table, stepping) if stepping else ()
        return choose_rank(
            candidates, loads, cached, prompt.prompt_tokens if prompt is not None else 0,
            self.config, session_rank=self.sessions.rank_for(session),
            recent=self.recent.counts(candidates), others_max=max(others, default=0.0),
        )

    def commit(self, decision: RouteDecision, prompt: RoutePrompt | None) -> None:
        """The request went to ``decision.rank``: count its cost there."""
        rank = decision.rank
        self.token_load.note_dispatched(rank, decision.cost)
        self.recent.note(rank)
        counters = self.counters
        counters.reasons[decision.reason.value] += 1
        counters.cached_tokens += decision.cached_tokens
        if prompt is None or prompt.token_ids is None:
            counters.unmatched += 1
            return
        counters.prompt_tokens += prompt.prompt_tokens
        if prompt.session_id is not None:
            self.sessions.note(prompt.session_id, rank)

    def commit_explicit(self, rank: int, prompt: RoutePrompt | None) -> float:
        """A request sent to a rank its frontend named: count an estimate of its cost."""
        cost = self.token_load.queued_request_tokens
        self.token_load.note_dispatched(rank, cost)
        self.recent.note(rank)
        if prompt is not None and prompt.session_id is not None:
            self.sessions.note(prompt.session_id, rank)
        return cost

    def undo(self, rank: int, cost: float) -> None:
        """The request never reached ``rank`` (its send failed)."""
        self.token_load.forget(rank, cost)

    def on_report(self, rank: int) -> None:
        """A stats report from ``rank``: it covers everything sent to it before."""
        self.token_load.on_report(rank)
