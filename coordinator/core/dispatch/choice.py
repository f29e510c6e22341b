"""The choice of a rank for a request, shared by submits and ``route`` calls.

With ``--policy prefix`` the choice is the prefix policy's
(``dispatch.prefix_policy``): it reads the prompt (the submit's ``PromptKeys``,
or else the vLLM ADD payload, decoded only here and only for this policy),
asks the prefix index what each candidate has cached and applies the routing
rule (``dispatch.prefix_rule``); the decision's cost is counted on the chosen
rank until its next stats report. The other policies pick from the load table
(``dispatch.balancer``), with the session's last rank (from ``PromptKeys``,
never from decoding the payload) preferred among equals.

A choice is committed when it is made (its cost and session noted);
``unchoose`` takes the cost back if the request never reaches the rank.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

from coordinator.core.config import CoreConfig
from coordinator.core.dispatch.balancer import BalancePolicy, LoadTable, make_policy
from coordinator.core.dispatch.prefix_policy import PREFIX_POLICY, PrefixRouter, RoutePrompt
from coordinator.core.dispatch.prefix_rule import RoutingConfig, SessionAffinity
from coordinator.core.kv.prefix_index import PrefixIndex
from coordinator.core.ranks.membership import Membership, RankState
from coordinator.core.ranks.span import RankSpan
from coordinator.protocol import frontend as fp
from coordinator.protocol.engine_request import decode_add_request
from coordinator.protocol.errors import ProtocolError

Choice = tuple[int, float, str]
"""The chosen rank, the cost counted on it and the reason."""

# Ranks that step with a lockstep group although they take no new requests.
_STEPPING = (RankState.READY, RankState.DRAINING, RankState.CORDONED)


class RankChoice:
    """The load table, the policy and (with ``prefix``) the prefix router."""

    def __init__(self, config: CoreConfig, counters: Counter[str], span: RankSpan,
                 membership: Membership, rng: random.Random,
                 index: Callable[[], PrefixIndex | None]) -> None:
        self._lockstep = config.lockstep
        self._counters = counters
        self._span = span
        self._membership = membership
        self._index = index
        self.loads = LoadTable(span.end)
        prefix = config.policy == PREFIX_POLICY
        # The prefix policy decides through the router; the plain policy answers the rest.
        self.policy: BalancePolicy = make_policy("least-loaded" if prefix else config.policy, rng)
        self.sessions = SessionAffinity()
        self.router = PrefixRouter(
            RoutingConfig(lockstep=config.lockstep, slack_tokens=config.prefix_slack_tokens),
            span.end) if prefix else None

    def read_prompt(self, keys: fp.PromptKeys | None,
                    payload: Sequence[bytes]) -> RoutePrompt | None:
        """The request's prompt: its keys if given, else (for the prefix policy only, which
        alone needs the tokens) the vLLM ADD payload; None if that is not one."""
        if keys is not None:
            return RoutePrompt.from_keys(keys)
        try:
            head = decode_add_request(payload[0])
        except ProtocolError:
            # Not a vLLM ADD (the simulated engines' own payload, say): routed by load alone.
            self._counters["route.unreadable_payloads"] += 1
            return None
        return RoutePrompt.from_add(head)

    def choose(self, candidates: Sequence[int], prompt: RoutePrompt | None) -> Choice | None:
        """The committed choice among ``candidates``; None without candidates."""
        router = self.router
        session = prompt.session_id if prompt is not None else None
        if router is None:
            rank = self.policy.pick(self.loads, candidates, self.sessions.rank_for(session))
            if rank is None:
                return None
            if session is not None:
                self.sessions.note(session, rank)
            return rank, 0.0, "load"
        decision = router.choose(candidates, self.loads, self._index(), prompt,
                                 stepping=self._stepping(candidates))
        if decision is None:
            return None
        router.commit(decision, prompt)
        return decision.rank, decision.cost, decision.reason.value

    def unchoose(self, rank: int, cost: float) -> None:
        if self.router is not None:
            self.router.undo(rank, cost)

    def resize(self, end: int) -> None:
        self.loads.resize(end)
        if self.router is not None:
            self.router.resize(end)

    def _stepping(self, candidates: Sequence[int]) -> list[int]:
        """In lockstep, the ranks that step with the group but are not candidates."""
        if not self._lockstep:
            return []
        chosen = set(candidates)
        stepping = []
        # Usually every rank is a candidate: no lease is looked at (each look copies it).
        for rank in self._span.range:
            if rank in chosen:
                continue
            lease = self._membership.lease(rank)
            if lease is not None and lease.state in _STEPPING:
                stepping.append(rank)
        return stepping
