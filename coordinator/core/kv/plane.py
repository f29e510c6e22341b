"""What the coordinator knows of each rank's prefix cache: subscriptions, streams, index.

Theory of operation
-------------------
``KVPlane`` puts together, for the ranks whose engines publish KV cache
events:

* where to reach each rank's publisher (``subscription``), from the
  configured endpoint (``--kv-events-endpoint``, offset by rank as vLLM's
  publisher does) or from what the rank's engine announced in its greeting
  (its publisher's resolved endpoints), with a wildcard host replaced by the
  host the engine connected from, or loopback;
* each rank's stream machine (``core.kv_stream``), which says what to do with
  each batch;
* the prefix index (``core.prefix_index``), built once the block size is
  known: from the engines' greetings, the configured size, or else the first
  stored block seen;
* the queue of batches waiting to be applied to the index. Applying is the
  only work here that grows with what peers send, so it is paid in bounded
  slices (``drain(budget)``, counted in blocks; an event with more blocks
  than a slice is cut into consecutive parts), between which the server
  serves everything else: a burst of events never delays a dispatch by more
  than one slice. The queue itself is bounded (``max_pending_blocks``): the
  server stops reading events while it is full, and what then overflows the
  publishers' queues is a gap like any other.

``reset_rank`` empties one rank's index and drops its queued batches (an
epoch per rank tells queued batches of an emptied index from later ones).

No IO, no clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from coordinator.core.kv.prefix_index import (
    DEFAULT_MAX_BLOCKS,
    DEFAULT_MAX_BLOCKS_PER_RANK,
    PrefixIndex,
)
from coordinator.core.kv.stream import KVStreams
from coordinator.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GreetingKV,
    KVEvent,
    KVEventBatch,
    KVSubscription,
    subscription_for,
)

__all__ = ["KVPlane", "KVSettings", "Subscription"]

DEFAULT_APPLY_BUDGET_BLOCKS = 1024
# Events with more blocks than this are applied in parts, so a slice stays a slice.
CHUNK_BLOCKS = 256
DEFAULT_MAX_PENDING_BLOCKS = 1 << 16


@dataclass(frozen=True)
class KVSettings:
    """The KV event settings of one coordinator (the ``serve --kv-*`` flags)."""

    endpoint: str | None = None
    """vLLM's ``kv_events_config.endpoint``, as configured for every rank."""
    replay_endpoint: str | None = None
    from_greetings: bool = True
    """Follow the publishers engines announce in their greetings."""
    block_size: int | None = None
    """Tokens per block; None: learn it from the engines."""
    max_blocks_per_rank: int = DEFAULT_MAX_BLOCKS_PER_RANK
    max_blocks: int = DEFAULT_MAX_BLOCKS
    replay_timeout_s: float = 1.0
    apply_budget_blocks: int = DEFAULT_APPLY_BUDGET_BLOCKS
    max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                # Rank 0 needs no offset; the rest of the checks are the same for all.
                subscription_for(value, 0, replay=name == "replay_endpoint")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"KV block size must be >= 1, got {self.block_size}")
        if self.apply_budget_blocks < 1 or self.max_pending_blocks < 1:
            raise ValueError("the apply budget and the pending bound must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None or self.from_greetings


class _Queued:
    __slots__ = ("blocks_left", "epoch", "events", "position", "rank")

    def __init__(self, rank: int, epoch: int, events: list[KVEvent], blocks: int) -> None:
        self.rank = rank
        self.epoch = epoch
        self.events = events
        self.position = 0
        self.blocks_left = blocks


class Subscription(NamedTuple):
    """Where one rank's publisher is: its live stream, and its replay endpoint if any."""

    live: KVSubscription
    replay: str | None
    source: str  # "configured" or "greeting"


def _event_blocks(event: KVEvent) -> int:
    if isinstance(event, (BlockStored, BlockRemoved)):
        return max(1, len(event.block_hashes))
    return 1


def _split(event: BlockStored | BlockRemoved, chunk: int) -> list[KVEvent]:
    """``event`` as consecutive events of at most ``chunk`` blocks, with the same effect.

    A stored chain continues from the previous part's last block; an event
    the index would skip whole (a token count that does not fit its hashes)
    is left whole.
    """
    if isinstance(event, BlockRemoved):
        hashes = event.block_hashes
        return [msgspec.structs.replace(event, block_hashes=hashes[i : i + chunk])
                for i in range(0, len(hashes), chunk)]
    hashes, size = event.block_hashes, event.block_size
    extras, lookahead = event.extra_keys, event.lookahead_token_ids
    if (len(event.token_ids) != len(hashes) * size
            or (extras is not None and len(extras) != len(hashes))
            or (lookahead is not None and len(lookahead) != len(hashes))):
        return [event]
    parts: list[KVEvent] = []
    for i in range(0, len(hashes), chunk):
        parts.append(msgspec.structs.replace(
            event,
            block_hashes=hashes[i : i + chunk],
            parent_block_hash=event.parent_block_hash if i == 0 else hashes[i - 1],
            token_ids=event.token_ids[i * size : (i + chunk) * size],
            extra_keys=None if extras is None else extras[i : i + chunk],
            lookahead_token_ids=None if lookahead is None else lookahead[i : i + chunk],
        ))
    return parts


@dataclass
class KVCounters:
    """Events by kind, for metrics; every field only grows."""

    events: Counter[str] = field(default_factory=Counter)
    unknown_events: int = 0
    bad_batches: Counter[str] = field(default_factory=Counter)
    resets: Counter[str] = field(default_factory=Counter)
    batches_by_rank: Counter[int] = field(default_factory=Counter)


class KVPlane:
    """Subscriptions, streams, index and apply queue; see the module docstring."""

    def __init__(self, settings: KVSettings) -> None:
        self.settings = settings
        self.streams: KVStreams[KVEventBatch] = KVStreams(
            replay_timeout_s=settings.replay_timeout_s)
        self.index: PrefixIndex | None = None
        if settings.block_size is not None:
            self.index = self._new_index(settings.block_size)
        self.subscriptions: dict[int, Subscription] = {}
        self.counters = KVCounters()
        self.block_size_source = "configured" if settings.block_size is not None else None
        self._pending: deque[_Queued] = deque()
        self._pending_blocks = 0
        self._epochs: dict[int, int] = {}

    # ---- where the publishers are ---------------------------------------------------------

    def configured_subscription(self, rank: int, host: str | None = None) -> Subscription | None:
        """The subscription the configured endpoints give ``rank``."""
        endpoint = self.settings.endpoint
        if endpoint is None:
            return None
        replay = self.settings.replay_endpoint
        return Subscription(
            subscription_for(endpoint, rank, host),
            subscription_for(replay, rank, host, replay=True).address if replay else None,
            "configured",
        )

    def greeted_subscription(self, rank: int, greeting: GreetingKV | None,
                             host: str | None) -> Subscription | None:
        """The subscription a rank's greeting announces, else the configured one.

        The greeting's endpoints are already offset for the rank; a wildcard
        host in them still needs the engine's host. Raises ValueError for an
        endpoint the coordinator cannot reach (inproc, port 0).
        """
        settings = greeting.kv_events_config if greeting is not None else None
        if settings is None or not settings.publishes or not self.settings.from_greetings:
            return self.configured_subscription(rank, host)
        # Rank 0: the announced endpoints carry their rank's offset already.
        live = subscription_for(settings.endpoint, 0, host)
        replay = settings.replay_endpoint
        return Subscription(
            live, subscription_for(replay, 0, host, replay=True).address if replay else None,
            "greeting",
        )

    def subscribe(self, rank: int, subscription: Subscription) -> None:
        """Follow ``rank``'s publisher there, from scratch (its index is emptied)."""
        self.reset_rank(rank, None)
        self.subscriptions[rank] = subscription
        self.streams.subscribe(rank, replay=subscription.replay is not None)

    def unsubscribe(self, rank: int) -> None:
        self.reset_rank(rank, None)
        self.subscriptions.pop(rank, None)
        self.streams.unsubscribe(rank)

    # ---- the index ------------------------------------------------------------------------

    def _new_index(self, block_size: int) -> PrefixIndex:
        return PrefixIndex(block_size, max_blocks_per_rank=self.settings.max_blocks_per_rank,
                           max_blocks=self.settings.max_blocks)

    def learn_block_size(self, block_size: int, source: str) -> bool:
        """A block size from ``source``; True if the index was (re)built for it.

        A configured size always wins. A size that differs from the index's
        rebuilds it empty (every rank starts again from its next batches).
        """
        if self.block_size_source == "configured":
            return False
        if self.index is not None and self.index.block_size == block_size:
            return False
        if self.index is not None and source == "event":
            return False  # a greeting's size stands; odd events are skipped by the index
        self.index = self._new_index(block_size)
        self.block_size_source = source
        self._pending.clear()
        self._pending_blocks = 0
        for rank in list(self.streams.ranks()):
            self._epochs[rank] = self._epochs.get(rank, 0) + 1
            self.streams.reset(rank)
        return True

    def reset_rank(self, rank: int, cause: str | None) -> int:
        """Forget what ``rank`` holds (and its queued batches); returns the blocks it held."""
        self._epochs[rank] = self._epochs.get(rank, 0) + 1
        if cause is not None:
            self.counters.resets[cause] += 1
        return self.index.reset_rank(rank) if self.index is not None else 0

    # ---- the apply queue ------------------------------------------------------------------

    @property
    def pending_blocks(self) -> int:
        """Blocks queued for the index (a bound on the work ``drain`` has left)."""
        return self._pending_blocks

    @property
    def backlog_full(self) -> bool:
        return self._pending_blocks >= self.settings.max_pending_blocks

    def enqueue(self, rank: int, batch: KVEventBatch) -> None:
        """Queue ``batch`` for ``rank``'s index (see ``drain``)."""
        self.counters.batches_by_rank[rank] += 1
        if self.index is None:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.learn_block_size(event.block_size, "event")
                    break
        chunk = min(CHUNK_BLOCKS, self.settings.apply_budget_blocks)
        events: list[KVEvent] = []
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)) and len(event.block_hashes) > chunk:
                events.extend(_split(event, chunk))
            else:
                events.append(event)
        blocks = sum(_event_blocks(event) for event in events)
        if blocks:
            self._pending.append(_Queued(rank, self._epochs.get(rank, 0), events, blocks))
            self._pending_blocks += blocks

    def drain(self, budget: int) -> int:
        """Apply queued events, oldest first: at most ``budget`` blocks (at least one event)."""
        index = self.index
        done = 0
        pending = self._pending
        counters = self.counters.events
        while pending and done < budget:
            item = pending[0]
            if index is None or self._epochs.get(item.rank, 0) != item.epoch:
                # Queued for an index that was emptied since: nothing to apply.
                pending.popleft()
                self._pending_blocks -= item.blocks_left
                continue
            events, rank = item.events, item.rank
            while item.position < len(events):
                event = events[item.position]
                cost = _event_blocks(event)
                if done and done + cost > budget:
                    break
                item.position += 1
                item.blocks_left -= cost
                self._pending_blocks -= cost
                index.apply(rank, event)
                counters[_KIND[type(event)]] += 1
                done += cost
            if item.position < len(events):
                break
            pending.popleft()
        return done

    def cached_blocks(self, ranks: Sequence[int]) -> dict[int, int]:
        index = self.index
        return {rank: index.blocks(rank) if index is not None else 0 for rank in ranks}


_KIND: dict[type, str] = {
    BlockStored: "stored",
    BlockRemoved: "removed",
    AllBlocksCleared: "cleared",
}
