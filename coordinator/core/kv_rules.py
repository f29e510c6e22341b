"""The core's rules for KV cache events: which publishers to follow, what each batch does.

With ``--kv-events-endpoint`` every rank's publisher is followed from the
start, at the configured endpoint offset by rank (``KVSubscribe``). An
engine's greeting on ``dispatch`` may then say better: its block size, and
its publisher's resolved endpoints and the host it connected from; a
subscription that changes is replaced, from scratch. Each batch, replay end
undecodable message or new connection goes through the rank's stream machine
(``core.kv_stream``), whose effects are carried out here: applied batches are
queued for the index (applied in slices on ``KVDrain``), losses reset the
rank's index, and missed batches are asked for (``KVRequestReplay``). A rank
that dies or is replaced, or whose publisher's connection ends, has its index
emptied and its stream started again (``CoreContext`` for the first two).
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import INFO, WARNING

from coordinator.core.actions import KVRequestReplay, KVSubscribe, KVUnsubscribe
from coordinator.core.context import CoreContext
from coordinator.core.events import (
    EngineGreeted,
    KVBadMessage,
    KVBatchReceived,
    KVDrain,
    KVPublisherConnected,
    KVPublisherDisconnected,
    KVReplayEnded,
)
from coordinator.core.kv.plane import Subscription
from coordinator.core.kv.stream import Apply, Effect, RequestReplay, ResetIndex
from coordinator.protocol.kv_events import KVEventBatch


class KVRules(CoreContext):
    """Handlers for the KV event plane."""

    def _kv_start(self) -> None:
        """Follow every rank's configured publisher (at start-up)."""
        kv = self.kv
        if kv is None:
            return
        for rank in self.rank_range:
            try:
                subscription = kv.configured_subscription(rank)
            except ValueError as exc:
                self._log(WARNING, "cannot follow dp_rank=%d's KV events: %s", rank, exc)
                continue
            if subscription is not None:
                self._kv_follow(rank, subscription)

    def _kv_follow(self, rank: int, subscription: Subscription) -> None:
        if self.kv is None:
            raise RuntimeError('KV rules called without a KV plane')
        self.kv.subscribe(rank, subscription)
        live = subscription.live
        self._out.append(KVSubscribe(rank, live.address, live.bind, subscription.replay))
        self._log(INFO, "dp_rank=%d: following KV events at %s (%s, %s)%s", rank, live.address,
                  "bound" if live.bind else "connected", subscription.source,
                  f", replay at {subscription.replay}" if subscription.replay else "")

    def _kv_greeted(self, event: EngineGreeted, now: float) -> None:
        kv = self.kv
        if kv is None:
            return
        rank, greeting = event.rank, event.kv
        if event.kv_unreadable:
            self.counters["kv.unreadable_greetings"] += 1
        if greeting is not None and greeting.block_size is not None:
            old = kv.index.block_size if kv.index is not None else None
            if kv.learn_block_size(greeting.block_size, "greeting"):
                self._log(INFO if old is None else WARNING,
                          "prefix index block size %d (from dp_rank=%d's greeting%s)",
                          greeting.block_size, rank,
                          "" if old is None else f"; was {old}: every rank starts again")
        try:
            subscription = kv.greeted_subscription(rank, greeting, event.host)
        except ValueError as exc:
            self.counters["kv.unreachable_publishers"] += 1
            self._log(WARNING, "cannot follow dp_rank=%d's KV events: %s", rank, exc,
                      key=f"kv-unreachable:{rank}")
            return
        if subscription is None:
            return
        current = kv.subscriptions.get(rank)
        if current is not None and current[:2] == subscription[:2]:
            return
        self._kv_follow(rank, subscription)

    def _kv_resized(self, before: range) -> None:
        """The group was resized: follow the new ranks, let go of the removed ones."""
        kv = self.kv
        if self.router is not None:
            self.router.resize(self._rank_end)
        if kv is None:
            return
        for rank in before:
            if rank not in self.rank_range and rank in kv.subscriptions:
                kv.unsubscribe(rank)
                self._out.append(KVUnsubscribe(rank))
        for rank in self.rank_range:
            if rank not in before:
                try:
                    subscription = kv.configured_subscription(rank)
                except ValueError:
                    continue
                if subscription is not None:
                    self._kv_follow(rank, subscription)

    # ---- what publishers send -------------------------------------------------------------

    def _on_kv_batch(self, event: KVBatchReceived, now: float) -> None:
        kv = self.kv
        if kv is None or event.rank not in kv.streams:
            self.counters["kv.unfollowed_messages"] += 1
            return
        kv.counters.unknown_events += event.unknown_events
        streams = kv.streams
        if event.replayed:
            effects = streams.replayed(event.rank, event.seq, event.batch, now)
        else:
            effects = streams.live(event.rank, event.seq, event.batch, now)
        self._kv_effects(event.rank, effects)

    def _on_kv_replay_ended(self, event: KVReplayEnded, now: float) -> None:
        kv = self.kv
        if kv is None or event.rank not in kv.streams:
            self.counters["kv.unfollowed_messages"] += 1
            return
        self._kv_effects(event.rank, kv.streams.replay_ended(event.rank, now))

    def _on_kv_bad_message(self, event: KVBadMessage, now: float) -> None:
        kv = self.kv
        if kv is None or event.rank not in kv.streams:
            self.counters["kv.unfollowed_messages"] += 1
            return
        reason = event.error.reason
        kv.counters.bad_batches[reason] += 1
        self._log(WARNING, "dp_rank=%d: dropped a bad KV event message%s (%s): %s", event.rank,
                  " from its replay" if event.replayed else "", reason, event.error,
                  key=f"kv-bad:{event.rank}:{reason}")
        if event.seq is not None:
            self._kv_effects(event.rank, kv.streams.bad(event.rank, event.seq, now,
                                                        replayed=event.replayed))

    def _on_kv_publisher_connected(self, event: KVPublisherConnected, now: float) -> None:
        kv = self.kv
        if kv is None or event.rank not in kv.streams:
            return
        self.counters["kv.connections"] += 1
        self._kv_effects(event.rank, kv.streams.connected(event.rank, now))

    def _on_kv_publisher_disconnected(self, event: KVPublisherDisconnected, now: float) -> None:
        """Whoever connects next may be a new publisher process, which numbers its batches
        from 0 again; ``seq`` alone cannot always tell (a restart's first batches can be
        lost while the subscription is set up), so the rank starts again from scratch:
        the next connection catches up by replay, as at start-up."""
        kv = self.kv
        if kv is None or event.rank not in kv.streams:
            return
        blocks = kv.reset_rank(event.rank, "publisher_disconnected")
        kv.streams.reset(event.rank)
        self._log(INFO, "dp_rank=%d: KV event publisher disconnected; its index (%d blocks) "
                  "starts again from the next connection", event.rank, blocks,
                  key=f"kv-disconnected:{event.rank}")

    def _on_kv_drain(self, event: KVDrain, now: float) -> None:
        kv = self.kv
        if kv is not None:
            kv.drain(kv.settings.apply_budget_blocks)

    def _kv_timer(self, now: float) -> None:
        kv = self.kv
        if kv is None:
            return
        for rank, effects in kv.streams.on_timer(now):
            self._kv_effects(rank, effects)

    def _kv_deadline(self) -> float | None:
        return self.kv.streams.next_deadline() if self.kv is not None else None

    def _kv_effects(self, rank: int, effects: Sequence[Effect[KVEventBatch]]) -> None:
        kv = self.kv
        if kv is None:
            raise RuntimeError('KV effects without a KV plane')
        for effect in effects:
            if isinstance(effect, Apply):
                kv.enqueue(rank, effect.batch)
            elif isinstance(effect, ResetIndex):
                blocks = kv.reset_rank(rank, effect.cause)
                self._log(WARNING, "dp_rank=%d: prefix index emptied (%s; it held %d blocks)",
                          rank, effect.cause.replace("_", " "), blocks,
                          key=f"kv-reset:{rank}:{effect.cause}")
            elif isinstance(effect, RequestReplay):
                self._out.append(KVRequestReplay(rank, effect.start))
