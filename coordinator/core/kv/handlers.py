"""The KV domain's handlers: which publishers to follow, what each batch does.

With ``--kv-events-endpoint`` every rank's publisher is followed from the
start, at the configured endpoint offset by rank (``KVSubscribe``). An
engine's greeting on ``dispatch`` may then say better: its block size, and
its publisher's resolved endpoints and the host it connected from; a
subscription that changes is replaced, from scratch. Each batch, replay end,
undecodable message or new connection goes through the rank's stream machine
(``kv.stream``), whose effects are carried out here: applied batches are
queued for the index (``kv.plane``, applied in slices on ``KVDrain``), losses
reset the rank's index, and missed batches are asked for (``KVRequestReplay``).
A subscription the server could not make is forgotten (``KVSubscribeFailed``),
and a replay it could not ask for is given up at once (``KVReplayUnsent``).
A rank that dies or is replaced, or whose publisher's connection ends, has its
index emptied and its stream started again (``forget_rank``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from logging import ERROR, INFO, WARNING

from coordinator.core.actions import KVRequestReplay, KVSubscribe, KVUnsubscribe
from coordinator.core.events import (
    EngineGreeted,
    KVBadMessage,
    KVBatchReceived,
    KVPublisherConnected,
    KVPublisherDisconnected,
    KVReplayEnded,
    KVReplayUnsent,
    KVSubscribeFailed,
)
from coordinator.core.kv.plane import KVPlane, KVSettings, Subscription
from coordinator.core.kv.prefix_index import PrefixIndex
from coordinator.core.kv.stream import Apply, Effect, RequestReplay, ResetIndex
from coordinator.core.outbox import Outbox
from coordinator.core.ranks.span import RankSpan
from coordinator.protocol.kv_events import KVEventBatch


class KVHandlers:
    """The KV event plane applied to events; see the module docstring."""

    def __init__(self, settings: KVSettings | None, counters: Counter[str],
                 span: RankSpan) -> None:
        self._counters = counters
        self._span = span
        self.plane = KVPlane(settings) if settings is not None and settings.enabled else None

    def index(self) -> PrefixIndex | None:
        """The prefix index (None when KV events are not followed)."""
        return self.plane.index if self.plane is not None else None


    def start(self, out: Outbox) -> None:
        """Follow every rank's configured publisher (at start-up)."""
        plane = self.plane
        if plane is None:
            return
        for rank in self._span.range:
            try:
                subscription = plane.configured_subscription(rank)
            except ValueError as exc:
                out.log(WARNING, "cannot follow dp_rank=%d's KV events: %s", rank, exc)
                continue
            if subscription is not None:
                self._follow(rank, subscription, out)

    def _follow(self, rank: int, subscription: Subscription, out: Outbox) -> None:
        if self.plane is None:
            raise RuntimeError("KV rules called without a KV plane")
        self.plane.subscribe(rank, subscription)
        live = subscription.live
        out.add(KVSubscribe(rank, live.address, live.bind, subscription.replay))
        out.log(INFO, "dp_rank=%d: following KV events at %s (%s, %s)%s", rank, live.address,
                "bound" if live.bind else "connected", subscription.source,
                f", replay at {subscription.replay}" if subscription.replay else "")

    def greeted(self, event: EngineGreeted, out: Outbox) -> None:
        """What an engine's greeting says of its KV event publisher."""
        plane = self.plane
        if plane is None:
            return
        rank, greeting = event.rank, event.kv
        if event.kv_unreadable:
            self._counters["kv.unreadable_greetings"] += 1
        if greeting is not None and greeting.block_size is not None:
            old = plane.index.block_size if plane.index is not None else None
            if plane.learn_block_size(greeting.block_size, "greeting"):
                out.log(INFO if old is None else WARNING,
                        "prefix index block size %d (from dp_rank=%d's greeting%s)",
                        greeting.block_size, rank,
                        "" if old is None else f"; was {old}: every rank starts again")
        try:
            subscription = plane.greeted_subscription(rank, greeting, event.host)
        except ValueError as exc:
            self._counters["kv.unreachable_publishers"] += 1
            out.log(WARNING, "cannot follow dp_rank=%d's KV events: %s", rank, exc,
                    key=f"kv-unreachable:{rank}")
            return
        if subscription is None:
            return
        current = plane.subscriptions.get(rank)
        if current is not None and current[:2] == subscription[:2]:
            return
        self._follow(rank, subscription, out)

    def resized(self, before: range, out: Outbox) -> None:
        """The group was resized: follow the new ranks, let go of the removed ones."""
        plane = self.plane
        if plane is None:
            return
        now_ranks = self._span.range
        for rank in before:
            if rank not in now_ranks and rank in plane.subscriptions:
                plane.unsubscribe(rank)
                out.add(KVUnsubscribe(rank))
        for rank in now_ranks:
            if rank not in before:
                try:
                    subscription = plane.configured_subscription(rank)
                except ValueError:
                    continue
                if subscription is not None:
                    self._follow(rank, subscription, out)

    def forget_rank(self, rank: int, cause: str) -> None:
        """The rank's engine is gone for good or replaced: nothing it cached is there any
        more. (A death the rank may come back from keeps its index: see the fan-out.)"""
        plane = self.plane
        if plane is not None and rank in plane.streams:
            plane.reset_rank(rank, cause)
            plane.streams.reset(rank)

    # ---- what publishers send ------------------------------------------------------------

    def _followed(self, rank: int) -> KVPlane | None:
        plane = self.plane
        if plane is None or rank not in plane.streams:
            self._counters["kv.unfollowed_messages"] += 1
            return None
        return plane

    def on_batch(self, event: KVBatchReceived, now: float, out: Outbox) -> None:
        plane = self._followed(event.rank)
        if plane is None:
            return
        plane.counters.unknown_events += event.unknown_events
        streams = plane.streams
        if event.replayed:
            effects = streams.replayed(event.rank, event.seq, event.batch, now)
        else:
            effects = streams.live(event.rank, event.seq, event.batch, now)
        self._effects(event.rank, effects, out)

    def on_replay_ended(self, event: KVReplayEnded, now: float, out: Outbox) -> None:
        plane = self._followed(event.rank)
        if plane is not None:
            self._effects(event.rank, plane.streams.replay_ended(event.rank, now), out)

    def on_bad_message(self, event: KVBadMessage, now: float, out: Outbox) -> None:
        plane = self._followed(event.rank)
        if plane is None:
            return
        reason = event.error.reason
        plane.counters.bad_batches[reason] += 1
        out.log(WARNING, "dp_rank=%d: dropped a bad KV event message%s (%s): %s", event.rank,
                " from its replay" if event.replayed else "", reason, event.error,
                key=f"kv-bad:{event.rank}:{reason}")
        if event.seq is not None:
            self._effects(event.rank, plane.streams.bad(event.rank, event.seq, now,
                                                        replayed=event.replayed), out)

    def on_publisher_connected(self, event: KVPublisherConnected, now: float,
                               out: Outbox) -> None:
        plane = self.plane
        if plane is None or event.rank not in plane.streams:
            return
        self._counters["kv.connections"] += 1
        self._effects(event.rank, plane.streams.connected(event.rank, now), out)

    def on_publisher_disconnected(self, event: KVPublisherDisconnected, out: Outbox) -> None:
        """Whoever connects next may be a new publisher process, which numbers its batches
        from 0 again; ``seq`` alone cannot always tell (a restart's first batches can be
        lost while the subscription is set up), so the rank starts again from scratch:
        the next connection catches up by replay, as at start-up."""
        plane = self.plane
        if plane is None or event.rank not in plane.streams:
            return
        blocks = plane.reset_rank(event.rank, "publisher_disconnected")
        plane.streams.reset(event.rank)
        out.log(INFO, "dp_rank=%d: KV event publisher disconnected; its index (%d blocks) "
                "starts again from the next connection", event.rank, blocks,
                key=f"kv-disconnected:{event.rank}")

    def on_subscribe_failed(self, event: KVSubscribeFailed, out: Outbox) -> None:
        """Not followed after all: forget the subscription, so that the rank's next
        greeting (or a resize) tries again, and its index holds nothing it cannot mend."""
        self._counters["kv.subscribe_failed"] += 1
        out.log(ERROR, "dp_rank=%d: cannot follow KV events at %s: %s", event.rank,
                event.address, event.error, key=f"kv-subscribe:{event.rank}")
        plane = self.plane
        if plane is not None and event.rank in plane.subscriptions:
            plane.unsubscribe(event.rank)

    def on_replay_unsent(self, event: KVReplayUnsent, now: float, out: Outbox) -> None:
        self._counters["kv.replay_request_failed"] += 1
        out.log(ERROR, "dp_rank=%d: cannot ask for a KV event replay: %s", event.rank,
                event.error, key=f"kv-replay:{event.rank}")
        plane = self.plane
        if plane is not None and event.rank in plane.streams:
            self._effects(event.rank, plane.streams.replay_unsent(event.rank, now), out)

    def drain(self) -> None:
        plane = self.plane
        if plane is not None:
            plane.drain(plane.settings.apply_budget_blocks)

    def on_timer(self, now: float, out: Outbox) -> None:
        plane = self.plane
        if plane is None:
            return
        for rank, effects in plane.streams.on_timer(now):
            self._effects(rank, effects, out)

    def next_deadline(self) -> float | None:
        return self.plane.streams.next_deadline() if self.plane is not None else None

    def _effects(self, rank: int, effects: Sequence[Effect[KVEventBatch]], out: Outbox) -> None:
        plane = self.plane
        if plane is None:
            raise RuntimeError("KV effects without a KV plane")
        for effect in effects:
            if isinstance(effect, Apply):
                plane.enqueue(rank, effect.batch)
            elif isinstance(effect, ResetIndex):
                blocks = plane.reset_rank(rank, effect.cause)
                out.log(WARNING, "dp_rank=%d: prefix index emptied (%s; it held %d blocks)",
                        rank, effect.cause.replace("_", " "), blocks,
                        key=f"kv-reset:{rank}:{effect.cause}")
            elif isinstance(effect, RequestReplay):
                out.add(KVRequestReplay(rank, effect.start))
