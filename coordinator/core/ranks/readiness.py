"""Whether the group serves: the rule behind ``/readyz``.

Readiness answers one question for a load balancer or an orchestrator: can a
request sent now be served? Taking one rank out for routine maintenance
(``cordon``, ``drain``) leaves the others serving, so it does not make the group
unready; a group that cannot take a request does.

=============  ===================  ===========================  =======
start-up gate  dispatchable ranks   the other ranks              serves
=============  ===================  ===========================  =======
closed         any                  any                          no
open           none                 any (all cordoned/draining,  no
                                    dead, absent, handshaking)
open           one or more          any                          yes
=============  ===================  ===========================  =======

*Dispatchable* is membership's word: READY, greeted on ``dispatch``, reachable
and alive. The gate is closed until every engine of the group subscribed
(``core.waves.gate``): before that no engine is past its start-up, whatever
its handshake says. An empty rank range never serves.

A serving group may still be short of ranks; ``Readiness.out`` names each rank
that takes no requests and why (its state), so the probe's body shows it.

Pure: no IO, no clock; the caller passes what the core knows at one moment.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Final

MAINTENANCE_STATES = frozenset({"cordoned", "draining"})
"""States an operator puts a rank in on purpose."""


@dataclass(frozen=True)
class Readiness:
    """The rule's verdict, with what an operator needs to read it."""

    serves: bool
    reason: str
    out: dict[int, str] = field(default_factory=dict)
    """Ranks that take no requests now, with their state."""


NOT_JUDGED: Final = Readiness(False, "the group has not been judged yet")
"""Before the first view: what a snapshot without a verdict says."""


def group_serves(states: Mapping[int, str], dispatchable: Collection[int], *,
                 gate_open: bool) -> Readiness:
    """Whether the group serves (see the module's table).

    ``states`` is every rank of the range with its state (``absent`` for a rank
    without a lease); ``dispatchable`` the ranks that may get new requests now.
    """
    serving = [rank for rank in states if rank in dispatchable]
    out = {rank: ("ready, not dispatchable" if state == "ready" else state)
           for rank, state in states.items() if rank not in dispatchable}
    if not states:
        return Readiness(False, "the group has no ranks", out)
    if not gate_open:
        return Readiness(False, "the group has not started: the start-up gate is closed "
                         "until every engine has subscribed", out)
    if not serving:
        if set(out.values()) <= MAINTENANCE_STATES:
            reason = "every rank is cordoned or draining: no rank takes requests"
        else:
            reason = f"no rank can take requests ({_counts(out)})"
        return Readiness(False, reason, out)
    if not out:
        return Readiness(True, f"all {len(states)} ranks take requests", out)
    return Readiness(True, f"{len(serving)} of {len(states)} ranks take requests "
                     f"({_counts(out)})", out)


def _counts(out: Mapping[int, str]) -> str:
    """``'1 cordoned, 2 dead'``: the ranks out of dispatch, by state."""
    by_state: dict[str, int] = {}
    for state in out.values():
        by_state[state] = by_state.get(state, 0) + 1
    return ", ".join(f"{count} {state}" for state, count in sorted(by_state.items()))
