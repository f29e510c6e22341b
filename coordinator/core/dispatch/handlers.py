"""The dispatch domain's handlers: submits to ADDs, finishes, aborts, ``route`` calls.

Admission and the in-flight ledger are ``dispatch.ledger``; the rank is
``dispatch.choice``'s (the balancer's policy, or the prefix router) over
``Membership.dispatchable()``. ``on_submit`` is the dispatch hot path: one
``DispatchAdd`` for a submit to a running group. For a wave's first request the
wave domain hands back the wake, which rides on the ``DispatchAdd``.

A ``DispatchAdd`` is committed when it is handed out (ledger, load, counters).
If the ADD cannot be sent, the server says so (``SendFailed``) before feeding
anything else; ``dispatch_failed`` undoes the commit and tries the next best
rank, from the ``Retry`` note the ADD carried.

When a rank is gone its requests fail here (``fail_rank``); if the same
incarnation may come back, the failed ids are kept and aborted on the engine
when it does (``rank_revived``), since their frontends were told they failed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from logging import INFO, WARNING

import msgspec

from coordinator.core.actions import Action, DispatchAdd, Send, SendPurpose
from coordinator.core.config import CoreConfig
from coordinator.core.dispatch.choice import RankChoice
from coordinator.core.dispatch.ledger import (
    NO_READY_ENGINE,
    SHUTTING_DOWN,
    STOPPING,
    Refusal,
    RequestLedger,
    dispatch_refusal,
    explicit_rank_refusal,
    undeliverable_refusal,
)
from coordinator.core.dispatch.prefix_policy import RoutePrompt
from coordinator.core.observe.journal import Journal
from coordinator.core.outbox import Outbox
from coordinator.core.ranks.membership import Membership, RankState
from coordinator.core.ranks.span import RankSpan
from coordinator.core.waves.handlers import WaveHandlers
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import rank_to_identity


class Retry(msgspec.Struct, frozen=True):
    """What a failed ADD needs to be tried elsewhere: the frontend connection and call,
    the wave the request was stamped with, the ranks already tried, whether the frontend
    named the rank itself, the cost the prefix policy counted and the prompt it read."""

    frontend: bytes
    call_id: int
    request_id: str
    stamped_wave: int
    tried: tuple[int, ...] = ()
    explicit: bool = False
    cost: float = 0.0
    prompt: RoutePrompt | None = None


class DispatchHandlers:
    """Admission, the choice and the ledger applied to requests; see the module docstring."""

    def __init__(self, config: CoreConfig, journal: Journal, span: RankSpan,
                 membership: Membership, choice: RankChoice, waves: WaveHandlers,
                 frontend_identities: Callable[[], Sequence[bytes]],
                 blind_ranks: Callable[[bytes], set[int]]) -> None:
        self._journal = journal
        self._blind_ranks = blind_ranks
        self._span = span
        self._membership = membership
        self._waves = waves
        self._frontend_identities = frontend_identities
        self.choice = choice
        self.requests = RequestLedger(max_in_flight=config.max_in_flight)
        self.dispatched_by_rank: Counter[int] = Counter()
        self.dispatched = 0
        """ADDs sent (a hot counter, merged into the views as ``submit.dispatched``)."""
        self.shutting_down = False
        self.stopping = False
        """A graceful stop: no new submits or routes; requests in flight finish."""
        # Requests failed when a rank died, by rank: (incarnation, ids), aborted on the
        # engine if that incarnation comes back (its outputs would follow a failure).
        self._failed_at_death: dict[int, tuple[int, list[str]]] = {}

    # ---- submits -----------------------------------------------------------------------

    def on_submit(self, identity: bytes, msg: fp.Submit, payload: list[bytes], now: float,
                  out: Outbox) -> None:
        refusal = STOPPING if self.stopping and not self.shutting_down else (
            self.requests.refusal(msg.request_id, shutting_down=self.shutting_down))
        if refusal is not None:
            self._refuse(identity, msg.call_id, msg.request_id, refusal, out)
            return
        choice, membership = self.choice, self._membership
        rank = msg.dp_rank
        prompt = choice.read_prompt(msg.prompt, payload) if (
            msg.prompt is not None or choice.router is not None) else None
        cost = 0.0
        blind = self._blind_ranks(identity)
        if rank is not None:
            in_range = membership.check_rank(rank) is None
            if not (in_range and rank in membership.dispatchable()):
                lease = membership.lease(rank) if in_range else None
                self._refuse(identity, msg.call_id, msg.request_id, explicit_rank_refusal(
                    rank, in_range=in_range, state=lease.state.value if lease else "not registered",
                    rank_start=self._span.start, rank_count=len(self._span),
                ), out)
                return
            if rank in blind:
                self._refuse_undeliverable(identity, msg, [rank], out)
                return
            if choice.router is not None:
                cost = choice.router.commit_explicit(rank, prompt)
        else:
            candidates = membership.dispatchable()
            if blind:
                reachable = [r for r in candidates if r not in blind]
                if candidates and not reachable:
                    self._refuse_undeliverable(identity, msg, candidates, out)
                    return
                candidates = reachable
            chosen = choice.choose(candidates, prompt)
            if chosen is None:
                self._refuse(identity, msg.call_id, msg.request_id, NO_READY_ENGINE, out)
                return
            rank, cost, _reason = chosen
        retry = Retry(identity, msg.call_id, msg.request_id, msg.wave,
                      explicit=msg.dp_rank is not None, cost=cost, prompt=prompt)
        self._dispatch(retry, payload, rank, now, out, wake=None)

    def _dispatch(self, retry: Retry, payload: list[bytes], rank: int, now: float,
                  out: Outbox, *, wake: tuple[Action, ...] | None) -> None:
        if wake is None:
            # The wake leaves right after the ADD, so that the chosen engine holds its
            # request before its peers step (woken first, they could finish an idle wave
            # before the ADD arrives).
            wake = self._waves.first_request(rank, retry.stamped_wave, retry.request_id, now,
                                             out)
        self.choice.loads.note_dispatched(rank)
        self.dispatched_by_rank[rank] += 1
        self.requests.add(retry.request_id, rank, retry.frontend)
        self.dispatched += 1
        reply = Send("frontend", retry.frontend, (fp.encode(
            fp.Submitted(retry.call_id, retry.request_id, rank, bool(wake))),))
        out.add(DispatchAdd(rank, rank_to_identity(rank), payload, reply, wake, retry))

    def dispatch_failed(self, add: DispatchAdd, now: float, out: Outbox) -> None:
        """The ADD could not be sent: undo its commit, then the next best rank or a refusal."""
        retry: Retry = add.retry
        rank = add.rank
        self.requests.forget(retry.request_id)
        self.choice.loads.note_dispatched(rank, -1)
        self.choice.unchoose(rank, retry.cost)
        self.dispatched_by_rank[rank] -= 1
        self.dispatched -= 1
        tried = (*retry.tried, rank)
        choice = None
        if retry.explicit:
            out.send_failed("dispatch", add.engine)
        else:
            # Leases past their TTL are buried by the lease timer; one not yet buried
            # fails its send here and the next best is tried.
            blind = self._blind_ranks(retry.frontend)
            candidates = [r for r in self._membership.dispatchable()
                          if r not in tried and r not in blind]
            choice = self.choice.choose(candidates, retry.prompt)
        if choice is None:
            # The wave machine counts this wake as sent, so it is sent: at worst the group
            # runs one idle wave, where a wake it believes in but never got could leave
            # the next request's peers unwoken.
            out.extend(add.wake)
            self._refuse(retry.frontend, retry.call_id, retry.request_id,
                         dispatch_refusal(tried, explicit=retry.explicit), out)
            return
        again = msgspec.structs.replace(retry, tried=tried, explicit=False, cost=choice[1])
        self._dispatch(again, add.payload, choice[0], now, out, wake=add.wake)

    def _refuse_undeliverable(self, identity: bytes, msg: fp.Submit, blind: list[int],
                              out: Outbox) -> None:
        refusal = undeliverable_refusal(sorted(blind))
        out.log(WARNING, "refused submits from frontend %s: %s", identity.hex(),
                refusal.message, key=f"undeliverable:{identity.hex()}")
        self._refuse(identity, msg.call_id, msg.request_id, refusal, out)

    def _refuse(self, identity: bytes, call_id: int, request_id: str, refusal: Refusal,
                out: Outbox) -> None:
        self._journal.counters[f"submit.refused.{refusal.code}"] += 1
        out.reply(identity, fp.ErrorReply(call_id, refusal.code, refusal.message, request_id))

    # ---- finishes and aborts -----------------------------------------------------------

    def on_finished(self, msg: fp.Finished, out: Outbox) -> None:
        for request_id in msg.request_ids:
            self._forget(request_id, out)

    def _forget(self, request_id: str, out: Outbox) -> None:
        entry = self.requests.forget(request_id)
        if entry is not None and not self.requests.count(entry.rank):
            self.maybe_drained(entry.rank, out)

    def on_abort(self, identity: bytes, msg: fp.Abort, out: Outbox) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in msg.request_ids:
            entry = self.requests.get(request_id)
            if entry is not None:
                by_rank.setdefault(entry.rank, []).append(request_id)
                self._forget(request_id, out)
        for rank, ids in by_rank.items():
            out.send("dispatch", rank_to_identity(rank), (vllm.ABORT, vllm.encode_abort(ids)),
                     SendPurpose.ABORT)
        routed = [request_id for ids in by_rank.values() for request_id in ids]
        out.reply(identity, fp.Aborted(msg.call_id, routed))

    def maybe_drained(self, rank: int, out: Outbox) -> None:
        """A draining rank with nothing in flight: every frontend hears it is drained."""
        if self._membership.state(rank) is not RankState.DRAINING or self.requests.count(rank):
            return
        out.log(INFO, "dp_rank=%d drained: no requests in flight", rank, key=f"drained:{rank}")
        out.notify(self._frontend_identities(), fp.RankDrained(rank))

    # ---- a rank gone, replaced or back ----------------------------------------------

    def fail_rank(self, rank: int, reason: str, out: Outbox, *,
                  may_return_as: int | None = None) -> None:
        """Fail every request in flight on ``rank``; if its incarnation ``may_return_as``
        comes back, those requests are aborted on the engine then."""
        failed: list[str] = []
        for frontend, ids in self.requests.take_rank(rank).items():
            self._journal.counters["requests.failed"] += len(ids)
            out.reply(frontend, fp.RequestsFailed(ids, rank, reason), SendPurpose.NOTICE)
            failed += ids
        # Every frontend hears of it too, after its own failures: requests sent there
        # before a coordinator restart have no entry here, and the SDK fails them itself.
        out.notify(self._frontend_identities(), fp.RankLost(rank, reason))
        if failed and may_return_as is not None:
            self._failed_at_death[rank] = (may_return_as, failed)

    def new_incarnation(self, rank: int) -> None:
        self._failed_at_death.pop(rank, None)  # a new incarnation never had them

    def rank_revived(self, rank: int, incarnation: int, out: Outbox) -> None:
        failed = self._failed_at_death.pop(rank, None)
        if failed is not None and failed[0] == incarnation:
            # Their frontends were told they failed: the engine must not finish them now.
            self._journal.counters["requests.aborted_on_revival"] += len(failed[1])
            out.send("dispatch", rank_to_identity(rank),
                     (vllm.ABORT, vllm.encode_abort(failed[1])), SendPurpose.ABORT)

    # ---- route calls -------------------------------------------------------------------

    def on_route(self, identity: bytes, msg: fp.Route, out: Outbox) -> None:
        """A rank for a request the frontend sends itself (the vLLM plugin route).

        Candidates are the ranks the caller names (or the whole group) that can take
        requests here, plus the ranks that never registered here at all: in the plugin
        route engines register with vLLM's own launcher, so the coordinator knows them
        only from their stats. Ranks it knows cannot take work are left out. The answer
        is counted on the rank exactly like a dispatch.
        """
        counters = self._journal.counters
        if self.shutting_down or self.stopping:
            refused = STOPPING if not self.shutting_down else SHUTTING_DOWN
            out.reply(identity, fp.ErrorReply(msg.call_id, refused.code, refused.message,
                                              msg.request_id))
            return
        span = self._span.range
        ranks: Sequence[int] = span if msg.ranks is None else msg.ranks
        outside = [rank for rank in ranks if rank not in span]
        if outside:
            counters["route.refused.unknown_rank"] += 1
            out.reply(identity, fp.ErrorReply(
                msg.call_id, fp.ERR_UNKNOWN_RANK, f"dp_rank={outside[0]} is outside "
                f"{span.start}..{span.stop - 1}", msg.request_id))
            return
        membership = self._membership
        dispatchable = set(membership.dispatchable())
        candidates = sorted({rank for rank in ranks
                             if rank in dispatchable or membership.lease(rank) is None})
        prompt = RoutePrompt.from_keys(msg.prompt) if msg.prompt is not None else None
        chosen = self.choice.choose(candidates, prompt)
        if chosen is None:
            counters["route.refused.no_ready_engine"] += 1
            out.reply(identity, fp.ErrorReply(msg.call_id, NO_READY_ENGINE.code,
                                              NO_READY_ENGINE.message, msg.request_id))
            return
        rank, _cost, reason = chosen
        self.choice.loads.note_dispatched(rank)
        counters["route.answered"] += 1
        out.reply(identity, fp.Routed(msg.call_id, msg.request_id, rank, reason))
