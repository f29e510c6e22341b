"""Connection facts of the rank leases: which connection holds a rank, and what a close means.

Theory of operation
-------------------
The server numbers the connections of ``handshake`` and ``dispatch``, says
which one a HELLO, READY or dispatch greeting came on, and reports when one
closes. Those facts, never the lease clock, say whether a rank's engine is
still connected (``core.claims`` decides HELLO on them, ``core.liveness``
picks the ranks to probe by them). Each lease carries its own
(``LeaseConnections``, which ``membership.EngineLease`` extends):

* its *handshake connection*, the one that said HELLO (or READY) last, and
  whether it closed since (``handshake_lost``);
* its *dispatch connection*, the one its current incarnation greeted from.
  The rank's identity on ``dispatch`` belongs to that connection; whether it
  closed (``dispatch_closed``) decides which connection a probe names;
* a *second claim* (``dispatch_claimed_by``): another connection that greeted
  for the rank while the first may still be open. An engine greets once per
  connection and never again after a reconnect, so that greeting is someone
  else's; the rank gets no new requests while the claiming connection is
  open, and once it closes the identity is free again, so whoever holds it
  next must answer a probe first;
* whether it is *lost* on ``dispatch`` (``dispatch_lost``): its connection
  closed, a probe missed it, or it carried nothing lately, and no probe has
  heard it since. A lost rank gets no new requests; it is not dead.

A rank is *reachable on dispatch* (``reachable_on_dispatch``) once it greeted
there, while it is neither lost nor claimed by another connection.

``Connections`` is the book of open connections a lease was seen on
(connection -> rank), so that a closing connection finds its lease. A lease
that a new HELLO replaced, or that left the range, is forgotten by it
(``forget``): a late close of the old engine's connection then changes nothing
for its successor. Each connection is reported closed once.

The lease lifecycle (HELLO, READY, renewal, expiry, revival) lives in
``core.ranks.membership``, which keeps this book beside its leases. No IO, no
clock: the facts come in as plain values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.core.ranks.claims import Greeting

__all__ = ["Connections", "LeaseConnections", "reachable_on_dispatch"]


@dataclass(kw_only=True)
class LeaseConnections:
    """What the connections of one lease's engine are known to have done."""

    dispatch_connected: bool = False
    """The engine greeted on ``dispatch`` (or was restored, and reconnects on its own)."""
    handshake_conn: int = 0
    """The connection that said HELLO (0: not known)."""
    handshake_lost: bool = False
    dispatch_conn: int = 0
    """The connection the engine greeted from on ``dispatch`` (0: not known)."""
    dispatch_closed: bool = False
    """That connection closed."""
    dispatch_lost: bool = False
    """Not reachable there (its connection closed, a probe missed it, or it carried
    nothing lately) since a probe last heard it: no new requests go there."""
    dispatch_claimed_by: int = 0
    """Another connection that greeted for this rank and is still open (a second claim)."""


def reachable_on_dispatch(facts: LeaseConnections) -> bool:
    """Greeted on ``dispatch``, not lost there and not claimed by another connection."""
    return facts.dispatch_connected and not facts.dispatch_lost and not facts.dispatch_claimed_by


@dataclass
class Connections:
    """The open connections the leases were seen on, to act on their closing."""

    _rank_of: dict[int, int] = field(default_factory=dict, init=False)

    def said_hello(self, rank: int, facts: LeaseConnections, conn: int) -> None:
        """``conn`` (0: not known) said HELLO or READY for ``rank``: its handshake
        connection now; a previous one of the same lease is no longer followed."""
        if not conn:
            return
        if facts.handshake_conn and facts.handshake_conn != conn:
            self._rank_of.pop(facts.handshake_conn, None)
        facts.handshake_conn = conn
        facts.handshake_lost = False
        self._rank_of[conn] = rank

    def greeted(self, rank: int, facts: LeaseConnections, conn: int) -> Greeting:
        """A greeting for ``rank``'s live lease arrived on ``dispatch`` from ``conn``
        (0: not known): BOUND, REPEATED or SECOND_CLAIM."""
        if conn and facts.dispatch_conn and conn != facts.dispatch_conn:
            # An engine greets once per connection and never again after a reconnect:
            # a greeting from another connection is someone else's.
            facts.dispatch_claimed_by = conn
            self._rank_of[conn] = rank
            return Greeting.SECOND_CLAIM
        bound = conn != 0 and facts.dispatch_conn == 0
        facts.dispatch_connected = True
        facts.dispatch_lost = False
        if conn:
            facts.dispatch_conn = conn
            self._rank_of[conn] = rank
        return Greeting.BOUND if bound else Greeting.REPEATED

    def closed(self, conn: int, leases: Mapping[int, LeaseConnections]) -> int | None:
        """``conn`` closed: the rank whose lease (in ``leases``) was seen on it, with that
        lease's facts updated; None if no current lease was, or it was reported before."""
        rank = self._rank_of.pop(conn, None)
        facts = None if rank is None else leases.get(rank)
        if facts is None:
            return None
        if conn == facts.handshake_conn:
            facts.handshake_lost = True
        if conn == facts.dispatch_conn:
            facts.dispatch_closed = True
            facts.dispatch_lost = True
        if conn == facts.dispatch_claimed_by:
            # The identity is free again; whoever holds it next must answer a probe.
            facts.dispatch_claimed_by = 0
            facts.dispatch_lost = True
        return rank

    def forget(self, rank: int, facts: LeaseConnections) -> None:
        """``rank``'s lease with ``facts`` is gone (replaced, or out of the range)."""
        for conn in (facts.handshake_conn, facts.dispatch_conn, facts.dispatch_claimed_by):
            if conn and self._rank_of.get(conn) == rank:
                del self._rank_of[conn]
