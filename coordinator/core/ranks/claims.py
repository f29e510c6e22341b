"""Who may claim a rank: HELLO verdicts and dispatch identities, decided on connection facts.

Theory of operation
-------------------
An engine claims a rank twice: with HELLO on ``handshake`` and, once it has its
INIT, by greeting on ``dispatch`` under the rank's identity. Both sockets are
ROUTERs that give an identity to the first live connection that carries it
(libzmq refuses a second one, silently, while the first is open), so what a
claim means depends on whether the rank's current holder is still connected.
That is decided by connection facts, never by the holder's lease clock: the
server numbers every connection of the two sockets, says which one a HELLO or
a greeting came on, and reports when one closes.

A holder is *connected* (``holder_connected``) while its HELLO connection is
open (between HELLO and READY, when a vLLM engine loads its model and says
nothing for minutes; heartbeats drop that connection if its peer stops
answering). A holder that greeted on ``dispatch`` is judged by what its
connection there carries: the caller probes it (an empty ABORT, which fails
at once when nobody holds the identity, and whose answer says when the engine
was last heard; see ``core.liveness``) and asks again with the answer. So is
a holder known by no connection facts (a registration restored from a state
file).

``hello_verdict`` is what a HELLO does to a rank whose *live* lease is
``holder``:

=======================  ===============  ================  ===================================
live holder's engine_id  new engine_id    holder connected  verdict
=======================  ===============  ================  ===================================
(no live holder)         anything         -                 take: new lease, new incarnation
X                        X (not None)     -                 duplicate: idempotent, renews lease
any                      differs, or      no                take over: the holder's lease turns
                         both None                          DEAD (disconnected), then take
X                        Y != X           yes               refuse: ENGINE_ID_MISMATCH
None                     None             yes               refuse: RANK_HELD
any                      differs, or      unknown, holder   probe the holder first
                         both None        greeted
X                        Y != X           unknown, never    refuse: ENGINE_ID_MISMATCH
                                          greeted
None                     None             unknown, never    take: nothing says the old vLLM
                                          greeted           engine is still there
=======================  ===============  ================  ===================================

So a HELLO whose holder vanished (its connections closed) frees the rank at
once, and a live, connected holder always keeps it, whether or not the engines
carry ids. A HANDSHAKING lease whose HELLO connection closed is not dead: a tcp
connection that dropped for a moment comes back under the same identity, and
its engine's READY is still accepted unless another engine took the rank.

On ``dispatch`` (``Greeting``) the rank's identity belongs to the connection
its current incarnation greeted from. An engine greets once per connection and
never again after a reconnect, so a greeting for a rank whose engine already
greeted, from another connection, is a second claim: that rank gets no new
requests while the claiming connection is open, and the claim is counted and
logged once. A second connection that claims a rank while its engine's
connection is open is turned away by libzmq before the coordinator sees any of
its messages: it gets nothing, and all that shows is a connection that never
greets. ``SilentConnections`` notices those: a dispatch connection that has not
greeted ``GREETING_GRACE_S`` after it was accepted is counted and logged once
(an engine greets as soon as it connects, but not again when its connection
is re-established, so a reconnecting engine shows up here too). What libzmq
allows on an unauthenticated network is written down in docs/OPERATIONS.md.

No IO, no clock: the facts come in as plain values.
"""

from __future__ import annotations

import enum
from typing import Protocol

__all__ = [
    "GREETING_GRACE_S",
    "Greeting",
    "HelloVerdict",
    "Holder",
    "SilentConnections",
    "hello_verdict",
    "holder_connected",
]

#: An engine greets on ``dispatch`` as soon as it connects; this long without is silence.
GREETING_GRACE_S = 2.0


class HelloVerdict(enum.Enum):
    TAKE = "take"
    DUPLICATE = "duplicate"
    MISMATCH = "mismatch"
    RANK_HELD = "rank_held"
    PROBE_HOLDER = "probe_holder"
    TAKE_OVER = "take_over"


class Greeting(enum.Enum):
    """What a greeting on ``dispatch`` meant (``Membership.greeted``)."""

    BOUND = "bound"  # the current incarnation greeted: this connection holds the rank
    REPEATED = "repeated"  # again from that connection, or without connection facts
    SECOND_CLAIM = "second_claim"  # another connection claims a rank whose engine greeted
    UNREGISTERED = "unregistered"  # no live lease: handshook elsewhere, or not at all


class Holder(Protocol):
    """What the verdicts read of a rank's lease (``membership.EngineLease``)."""

    @property
    def engine_id(self) -> str | None: ...
    @property
    def handshaking(self) -> bool: ...
    @property
    def handshake_conn(self) -> int: ...
    @property
    def handshake_lost(self) -> bool: ...
    @property
    def dispatch_connected(self) -> bool: ...


def holder_connected(holder: Holder) -> bool | None:
    """Whether ``holder``'s engine is still connected, by connection facts; None: unknown."""
    hello_known = holder.handshaking and holder.handshake_conn != 0
    if hello_known and not holder.handshake_lost:
        return True
    if holder.dispatch_connected:
        return None  # what its dispatch connection carries decides: probe it
    if hello_known:
        return False  # its HELLO connection closed and it never greeted: it vanished
    return None


def hello_verdict(
    holder: Holder | None, engine_id: str | None, connected: bool | None
) -> HelloVerdict:
    """What a HELLO carrying ``engine_id`` does to a rank whose live lease is ``holder``.

    ``connected`` is whether the holder is still connected (``holder_connected``,
    or a probe's answer); None: not known.
    """
    if holder is None:
        return HelloVerdict.TAKE
    if holder.engine_id is not None and holder.engine_id == engine_id:
        return HelloVerdict.DUPLICATE
    both_unnamed = holder.engine_id is None and engine_id is None
    if connected is None:
        if holder.dispatch_connected:
            return HelloVerdict.PROBE_HOLDER  # only a holder that greeted can be probed
        # Nothing to go by: a vLLM engine says HELLO once per process, so a new HELLO
        # without an id is a new process; differing ids are refused as they always were.
        return HelloVerdict.TAKE if both_unnamed else HelloVerdict.MISMATCH
    if not connected:
        return HelloVerdict.TAKE_OVER
    return HelloVerdict.RANK_HELD if both_unnamed else HelloVerdict.MISMATCH


class SilentConnections:
    """Dispatch connections that have not greeted yet, until they do, close, or are overdue.

    Holds one entry per open, silent connection (each holds a file descriptor, so
    the process's descriptor limit bounds it).
    """

    def __init__(self, grace_s: float = GREETING_GRACE_S) -> None:
        self.grace_s = grace_s
        self._pending: dict[int, tuple[float, str]] = {}

    def opened(self, conn: int, now: float, peer: str) -> None:
        self._pending[conn] = (now + self.grace_s, peer)

    def spoke(self, conn: int) -> None:
        self._pending.pop(conn, None)

    def closed(self, conn: int) -> None:
        self._pending.pop(conn, None)

    def overdue(self, now: float) -> list[tuple[int, str]]:
        """Connections silent past the grace, each reported once: ``(conn, peer)``."""
        due = [(conn, peer) for conn, (at, peer) in self._pending.items() if at <= now]
        for conn, _ in due:
            del self._pending[conn]
        return due
