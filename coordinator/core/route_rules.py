"""Choosing a request's rank, for submits and for ``route`` calls.

With ``--policy prefix`` the choice is the router's (``core.router``): it
reads the prompt (the submit's ``PromptKeys``, or else the vLLM ADD payload,
decoded only here and only for this policy), asks the prefix index what
each candidate has cached and applies the routing rule; the decision's cost
is counted on the chosen rank until its next stats report. The other
policies pick from the load table, with the session's last rank (from
``PromptKeys``, never from decoding the payload) preferred among equals.

A ``route`` call asks for a rank without handing the request over: the
frontend sends it to the engine itself (the vLLM plugin route). The answer
is counted on the rank exactly like a dispatch. Its candidates are the ranks
the caller names (or the whole group) that can take requests here, plus the
ranks that never registered here at all: in the plugin route engines
register with vLLM's own launcher, so the coordinator knows them only from
their stats. Ranks it knows cannot take work (handshaking, draining,
cordoned, dead) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core.context import CoreContext
from coordinator.core.dispatch.ledger import NO_READY_ENGINE
from coordinator.core.dispatch.prefix_policy import RoutePrompt
from coordinator.core.ranks.membership import RankState
from coordinator.protocol import frontend as fp
from coordinator.protocol.engine_request import decode_add_request
from coordinator.protocol.errors import ProtocolError


class RouteRules(CoreContext):
    """The rank choice shared by submits and ``route`` calls."""

    def _read_prompt(self, keys: fp.PromptKeys | None,
                     payload: Sequence[bytes]) -> RoutePrompt | None:
        """The request's prompt: its keys if given, else (for the prefix policy only, which
        alone needs the tokens) the vLLM ADD payload; None if that is not one."""
        if keys is not None:
            return RoutePrompt.from_keys(keys)
        try:
            head = decode_add_request(payload[0])
        except ProtocolError:
            # Not a vLLM ADD (the simulated engines' own payload, say): routed by load alone.
            self.counters["route.unreadable_payloads"] += 1
            return None
        return RoutePrompt.from_add(head)

    def _choose(self, candidates: Sequence[int],
                prompt: RoutePrompt | None) -> tuple[int, float, str] | None:
        """The chosen rank, the cost counted on it and the reason; None without candidates.

        The choice is committed (its cost and session noted); ``_unchoose`` takes the
        cost back if the request never reaches the rank.
        """
        router = self.router
        session = prompt.session_id if prompt is not None else None
        if router is None:
            rank = self.policy.pick(self.loads, candidates, self.sessions.rank_for(session))
            if rank is None:
                return None
            if session is not None:
                self.sessions.note(session, rank)
            return rank, 0.0, "load"
        kv = self.kv
        decision = router.choose(candidates, self.loads, kv.index if kv is not None else None,
                                 prompt, stepping=self._stepping(candidates))
        if decision is None:
            return None
        router.commit(decision, prompt)
        return decision.rank, decision.cost, decision.reason.value

    def _unchoose(self, rank: int, cost: float) -> None:
        if self.router is not None:
            self.router.undo(rank, cost)

    def _stepping(self, candidates: Sequence[int]) -> list[int]:
        """In lockstep, the ranks that step with the group but are not candidates."""
        if not self.config.lockstep:
            return []
        chosen = set(candidates)
        stepping = []
        # Usually every rank is a candidate: no lease is looked at (each look copies it).
        for rank in self.rank_range:
            if rank in chosen:
                continue
            lease = self.membership.lease(rank)
            if lease is not None and lease.state in (
                RankState.READY, RankState.DRAINING, RankState.CORDONED,
            ):
                stepping.append(rank)
        return stepping

    def _on_route(self, identity: bytes, msg: fp.Route) -> None:
        if self.shutting_down:
            self._reply(identity, fp.ErrorReply(msg.call_id, fp.ERR_SHUTTING_DOWN,
                                                "the coordinator is shutting down",
                                                msg.request_id))
            return
        ranks: Sequence[int] = self.rank_range if msg.ranks is None else msg.ranks
        outside = [rank for rank in ranks if rank not in self.rank_range]
        if outside:
            self.counters["route.refused.unknown_rank"] += 1
            self._reply(identity, fp.ErrorReply(
                msg.call_id, fp.ERR_UNKNOWN_RANK, f"dp_rank={outside[0]} is outside "
                f"{self.rank_range.start}..{self.rank_range.stop - 1}", msg.request_id))
            return
        dispatchable = set(self.membership.dispatchable())
        candidates = sorted({rank for rank in ranks
                             if rank in dispatchable or self.membership.lease(rank) is None})
        prompt = RoutePrompt.from_keys(msg.prompt) if msg.prompt is not None else None
        chosen = self._choose(candidates, prompt)
        if chosen is None:
            self.counters["route.refused.no_ready_engine"] += 1
            self._reply(identity, fp.ErrorReply(msg.call_id, NO_READY_ENGINE.code,
                                                NO_READY_ENGINE.message, msg.request_id))
            return
        rank, _cost, reason = chosen
        self.loads.note_dispatched(rank)
        self.counters["route.answered"] += 1
        self._reply(identity, fp.Routed(msg.call_id, msg.request_id, rank, reason))
