"""Who holds each DP rank: registrations as leases, and the rules that move them.

Theory of operation
-------------------
The coordinator serves a fixed range of global DP ranks,
``[rank_start, rank_start + rank_count)``. Each rank is held by at most one
*lease*: the registration of the engine process that said HELLO for it. A
lease is kept alive by the engine's traffic; the server calls ``touch`` (or
``greeted``) when something arrives from the rank, and ``expire(now)`` on a
timer. A lease is *alive* while its state is not DEAD and
``now <= last_seen + ttl``, where ``ttl`` is ``lease_ttl_s`` except while
HANDSHAKING, when it is the longer ``handshake_ttl_s``: a vLLM engine loads its
model between INIT and READY and says nothing for minutes meanwhile. A lease
that is not alive no longer blocks its rank: the next HELLO for that rank
replaces it.

Every registration gets an ``incarnation`` number, strictly increasing per
rank, so that the server can tell a restarted engine from the one it replaced
even when both use the same ZMQ identity.

HELLO decides who holds a rank: ``core.claims`` has the verdict, from the
engine ids and connection facts (is the holder's HELLO connection, or the
connection it greeted from on ``dispatch``, still open?). Which connections
each lease was seen on, and what their closing means, is
``core.ranks.connections``; ``Membership`` keeps that book beside the leases
and passes on what the server reports (``greeted``, ``connection_closed``).

After HELLO, a lease moves through the states of ``RankState`` by the events
in ``NEXT_STATE``, a plain (state, event) -> next-state table. For the
operator commands (cordon, uncordon, drain) and READY a missing row is a
refusal; for the liveness events (disconnect, expire) a missing row means
there is nothing to do.

DEAD is a verdict on evidence, so it can be revised by evidence: a settled
lease (READY, CORDONED or DRAINING) that died of silence or of a failed probe
remembers the state it died in, and ``revive`` puts it back there, same
incarnation, once its engine is reachable again (see ``core.liveness``),
unless the group pinned another config hash meanwhile: then it stays dead. A
lease released for a config-hash mismatch, one that died HANDSHAKING, and
one replaced by a new HELLO do not come back: only a new HELLO, which makes a
new incarnation, does.

Leases are judged by what arrived, not by the coordinator's wall time: traffic
renews a lease whatever its age (``touch``), a probe renews it only to the
moment it proves the engine was heard (``renew``), and a pause of the
coordinator itself is credited to every lease (``credit_pause``), so a stall
longer than the TTL condemns nobody.

A READY whose ``parallel_config_hash`` differs from the hash pinned by the
group is refused and the rank is released (its lease turns DEAD): an engine
with other parallel settings would make the collectives hang, and holding its
rank would only block the fixed engine that the operator starts next. The
first accepted READY that carries a hash pins it; it stays pinned while some
other READY-or-later lease that is not DEAD carries a hash, so a whole group
that is redeployed with new settings does not need a coordinator restart. A
lease past its TTL that ``expire`` has not judged yet still pins: traffic
(``touch``) and a probe's answer (``renew``) renew it whatever its age, so it
may well be live, and a READY with another hash meanwhile would put two
settings in one group. Dense and dp=1 engines send no hash, and a missing
hash is always accepted.

This module does no IO and reads no clock: callers pass ``now`` (monotonic
seconds). Calls return what changed (``Accepted``, ``Refused``,
``RankChanged``) and the caller acts on it. A refused call changes nothing,
except the config-hash refusal, which releases the rank as described above.
Leases handed out are copies; changing them does not change the membership.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Collection
from dataclasses import dataclass

from coordinator.core.ranks.claims import Greeting, HelloVerdict, hello_verdict, holder_connected
from coordinator.core.ranks.connections import (
    Connections,
    LeaseConnections,
    reachable_on_dispatch,
)
from coordinator.protocol.errors import RankRangeError
from coordinator.protocol.identity import MAX_RANK

__all__ = [
    "NEXT_STATE",
    "Accepted",
    "EngineLease",
    "Greeting",
    "HelloVerdict",
    "LeaseConnections",
    "LeaseEvent",
    "Membership",
    "ProbeHolder",
    "RankChanged",
    "RankState",
    "RefusalReason",
    "Refused",
    "hello_verdict",
    "holder_connected",
    "is_alive",
]


class RankState(enum.Enum):
    """Where a rank's current lease stands."""

    HANDSHAKING = "handshaking"  # HELLO accepted, READY not yet
    READY = "ready"  # in the wave and eligible for dispatch
    DRAINING = "draining"  # in the wave, gets no new work, finishing what it has
    CORDONED = "cordoned"  # in the wave, gets no new work, until uncordoned
    DEAD = "dead"  # gone; back on evidence of life (if it died settled) or a new HELLO


class LeaseEvent(enum.Enum):
    """Events that move an existing lease (HELLO is decided by ``hello_verdict``)."""

    READY = "ready"
    CORDON = "cordon"
    UNCORDON = "uncordon"
    DRAIN = "drain"
    DISCONNECT = "disconnect"
    EXPIRE = "expire"


_S = RankState
_E = LeaseEvent

# The whole lifecycle of a lease after HELLO. A (state, event) pair that is
# missing here is refused (READY and operator commands) or ignored (liveness).
NEXT_STATE: dict[tuple[RankState, LeaseEvent], RankState] = {
    (_S.HANDSHAKING, _E.READY): _S.READY,
    (_S.HANDSHAKING, _E.DISCONNECT): _S.DEAD,
    (_S.HANDSHAKING, _E.EXPIRE): _S.DEAD,
    (_S.READY, _E.CORDON): _S.CORDONED,
    (_S.READY, _E.DRAIN): _S.DRAINING,
    (_S.READY, _E.DISCONNECT): _S.DEAD,
    (_S.READY, _E.EXPIRE): _S.DEAD,
    (_S.CORDONED, _E.UNCORDON): _S.READY,
    (_S.CORDONED, _E.DRAIN): _S.DRAINING,
    (_S.CORDONED, _E.DISCONNECT): _S.DEAD,
    (_S.CORDONED, _E.EXPIRE): _S.DEAD,
    (_S.DRAINING, _E.UNCORDON): _S.READY,
    (_S.DRAINING, _E.DISCONNECT): _S.DEAD,
    (_S.DRAINING, _E.EXPIRE): _S.DEAD,
}

# Why an operator command is not allowed in a state, phrased as what to do instead.
_COMMAND_HINTS: dict[tuple[RankState, LeaseEvent], str] = {
    (_S.HANDSHAKING, _E.CORDON): "wait until the engine has sent READY",
    (_S.HANDSHAKING, _E.DRAIN): "wait until the engine has sent READY",
    (_S.HANDSHAKING, _E.UNCORDON): "only a cordoned or draining rank can be uncordoned",
    (_S.READY, _E.UNCORDON): "only a cordoned or draining rank can be uncordoned",
    (_S.CORDONED, _E.CORDON): "it is already cordoned",
    (_S.DRAINING, _E.CORDON): (
        "draining already keeps it out of dispatch; uncordon it to stop draining"
    ),
    (_S.DRAINING, _E.DRAIN): "it is already draining",
}

_COMMAND_CAUSES: dict[LeaseEvent, str] = {
    _E.CORDON: "cordoned by operator: stays in the wave, gets no new requests",
    _E.UNCORDON: "uncordoned by operator: back in dispatch",
    _E.DRAIN: "draining by operator request: stays in the wave, gets no new requests",
}

# States that have passed READY: their hash (if any) belongs to the group.
_JOINED = frozenset({_S.READY, _S.CORDONED, _S.DRAINING})


class RefusalReason(enum.Enum):
    """Why a call was refused; the value is a stable token for counters and logs."""

    RANK_OUT_OF_RANGE = "rank_out_of_range"
    ENGINE_ID_MISMATCH = "engine_id_mismatch"
    OUT_OF_ORDER = "out_of_order"
    RANK_HELD = "rank_held"
    CONFIG_HASH_MISMATCH = "config_hash_mismatch"
    UNKNOWN_RANK = "unknown_rank"
    INVALID_TRANSITION = "invalid_transition"


@dataclass(kw_only=True)
class EngineLease(LeaseConnections):
    """One engine's registration for one rank, with its connection facts."""

    rank: int
    engine_id: str | None
    state: RankState
    registered_at: float
    last_seen: float
    local: bool = False
    headless: bool = False
    parallel_config_hash: str | None = None
    incarnation: int
    protocol_version: int | None = None
    """Set by this project's engine SDK in HELLO; such engines wait for ACCEPTED."""
    died_from: RankState | None = None
    """The settled state a DEAD lease died in, while it may still be revived."""

    @property
    def handshaking(self) -> bool:
        return self.state is RankState.HANDSHAKING


@dataclass(frozen=True)
class Refused:
    """A call that was not allowed; ``message`` is the user-facing text with its remedy."""

    reason: RefusalReason
    message: str


@dataclass(frozen=True)
class RankChanged:
    """A lease changed state (``new`` is None when the rank left the range)."""

    rank: int
    old: RankState | None
    new: RankState | None
    cause: str


@dataclass(frozen=True)
class Accepted:
    """A HELLO or READY that was allowed. ``replaced`` is the previous lease, if any;
    ``released`` is the holder's own change when this HELLO took over from it."""

    lease: EngineLease
    replaced: EngineLease | None = None
    duplicate: bool = False
    released: RankChanged | None = None


@dataclass(frozen=True)
class ProbeHolder:
    """A HELLO that can be decided only once it is known whether ``holder`` is still
    connected: probe it, then call ``hello`` again with ``holder_reachable``."""

    rank: int
    holder: EngineLease


def is_alive(lease: EngineLease, now: float | None, lease_ttl_s: float) -> bool:
    """Whether ``lease`` still holds its rank; with ``now=None`` only the state counts."""
    if lease.state is RankState.DEAD:
        return False
    return now is None or now <= lease.last_seen + lease_ttl_s


def _seconds(value: float) -> str:
    return f"{max(value, 0.0):.1f}"


class Membership:
    """The leases of one coordinator's rank range, and the rules that change them."""

    def __init__(
        self,
        *,
        rank_start: int,
        rank_count: int,
        lease_ttl_s: float,
        handshake_ttl_s: float | None = None,
    ) -> None:
        if rank_start < 0 or rank_count < 0 or rank_start + rank_count - 1 > MAX_RANK:
            raise ValueError(
                f"rank range [{rank_start}, {rank_start + rank_count}) does not fit "
                f"in 0..{MAX_RANK}"
            )
        if not (math.isfinite(lease_ttl_s) and lease_ttl_s > 0):
            raise ValueError(f"lease_ttl_s must be a positive number, got {lease_ttl_s}")
        if handshake_ttl_s is not None and not (
            math.isfinite(handshake_ttl_s) and handshake_ttl_s > 0
        ):
            raise ValueError(f"handshake_ttl_s must be a positive number, got {handshake_ttl_s}")
        self._rank_start = rank_start
        self._rank_count = rank_count
        self._lease_ttl_s = lease_ttl_s
        self._handshake_ttl_s = handshake_ttl_s if handshake_ttl_s is not None else lease_ttl_s
        self._group_config_hash: str | None = None
        self._leases: dict[int, EngineLease] = {}
        # dispatchable() without `now` is asked on every submit; recomputed only after
        # a lease's state or connection changes (each such place resets it).
        self._dispatchable: list[int] | None = None
        # Outlives the leases (and resizes), so incarnations never repeat per rank.
        self._last_incarnation: dict[int, int] = {}
        # The connections the leases were seen on, to act on their closing.
        self._connections = Connections()

    @property
    def rank_start(self) -> int:
        return self._rank_start

    @property
    def rank_count(self) -> int:
        return self._rank_count

    @property
    def lease_ttl_s(self) -> float:
        return self._lease_ttl_s

    @property
    def group_config_hash(self) -> str | None:
        """The parallel-config hash the group's engines agree on, once one has been seen."""
        return self._group_config_hash

    # -- queries ---------------------------------------------------------------

    def check_rank(self, rank: int) -> Refused | None:
        """A refusal if ``rank`` lies outside this coordinator's range, else None."""
        if self._rank_start <= rank < self._rank_start + self._rank_count:
            return None
        error = RankRangeError(rank, self._rank_start, self._rank_count)
        return Refused(RefusalReason.RANK_OUT_OF_RANGE, str(error))

    def lease(self, rank: int) -> EngineLease | None:
        """A copy of the rank's current lease (possibly DEAD), or None."""
        held = self._leases.get(rank)
        return None if held is None else dataclasses.replace(held)

    def state(self, rank: int) -> RankState | None:
        """The rank's state, or None without a lease (no copy: for hot paths)."""
        held = self._leases.get(rank)
        return None if held is None else held.state

    def leases(self) -> list[EngineLease]:
        """Copies of all leases, by ascending rank."""
        return [dataclasses.replace(self._leases[r]) for r in sorted(self._leases)]

    def dispatchable(self, *, now: float | None = None) -> list[int]:
        """Ranks that may get new requests: READY, greeted on dispatch and reachable there
        (not lost, not claimed by another connection), alive; ascending.

        Without ``now`` the lease TTL is not checked (the server's ``expire``
        timer keeps DEAD states current); with it, stale leases are left out too.
        """
        if now is None and self._dispatchable is not None:
            return self._dispatchable
        ranks = [
            rank
            for rank in sorted(self._leases)
            if (lease := self._leases[rank]).state is RankState.READY
            and reachable_on_dispatch(lease)
            and self._alive(lease, now)
        ]
        if now is None:
            self._dispatchable = ranks
        return ranks

    def all_ready(self, *, now: float | None = None) -> bool:
        """Whether every rank in range has a READY lease (False for an empty range)."""
        if self._rank_count == 0:
            return False
        for rank in range(self._rank_start, self._rank_start + self._rank_count):
            lease = self._leases.get(rank)
            if lease is None or lease.state is not RankState.READY:
                return False
            if not self._alive(lease, now):
                return False
        return True

    # -- handshake -------------------------------------------------------------

    def hello(
        self,
        rank: int,
        *,
        engine_id: str | None,
        local: bool,
        headless: bool,
        now: float,
        holder_reachable: bool | None = None,
        conn: int = 0,
        protocol_version: int | None = None,
    ) -> Accepted | Refused | ProbeHolder:
        """An engine asks for ``rank`` (handshake HELLO) on connection ``conn``; see
        ``hello_verdict``.

        ``holder_reachable`` is a probe's answer about the live holder; None decides
        by connection facts, and the answer is ``ProbeHolder`` when they cannot tell.
        """
        out_of_range = self.check_rank(rank)
        if out_of_range is not None:
            return out_of_range
        previous = self._leases.get(rank)
        holder = previous if previous is not None and self._alive(previous, now) else None
        connected = holder_reachable
        if holder is not None and connected is None:
            connected = holder_connected(holder)
        verdict = hello_verdict(holder, engine_id, connected)
        released: RankChanged | None = None
        if holder is not None:
            if verdict is HelloVerdict.MISMATCH:
                return Refused(
                    RefusalReason.ENGINE_ID_MISMATCH,
                    self._mismatch_message(holder, engine_id, now),
                )
            if verdict is HelloVerdict.RANK_HELD:
                return Refused(RefusalReason.RANK_HELD, self._held_message(holder, now))
            if verdict is HelloVerdict.PROBE_HOLDER:
                return ProbeHolder(rank, dataclasses.replace(holder))
            if verdict is HelloVerdict.DUPLICATE:
                holder.last_seen = now
                self._connections.said_hello(rank, holder, conn)
                return Accepted(dataclasses.replace(holder), duplicate=True)
            if verdict is HelloVerdict.TAKE_OVER:
                released = self.disconnected(rank, now)[0]
        if previous is not None:
            self._connections.forget(rank, previous)
        incarnation = self._last_incarnation.get(rank, 0) + 1
        self._last_incarnation[rank] = incarnation
        fresh = EngineLease(
            rank=rank,
            engine_id=engine_id,
            state=RankState.HANDSHAKING,
            registered_at=now,
            last_seen=now,
            local=local,
            headless=headless,
            incarnation=incarnation,
            protocol_version=protocol_version,
        )
        self._leases[rank] = fresh
        self._connections.said_hello(rank, fresh, conn)
        self._dispatchable = None
        return Accepted(dataclasses.replace(fresh), replaced=previous, released=released)

    def ready(
        self, rank: int, *, parallel_config_hash: str | None, now: float, conn: int = 0
    ) -> Accepted | Refused:
        """The engine holding ``rank`` finished starting up (handshake READY on ``conn``)."""
        out_of_range = self.check_rank(rank)
        if out_of_range is not None:
            return out_of_range
        lease = self._leases.get(rank)
        if lease is None:
            return Refused(
                RefusalReason.OUT_OF_ORDER,
                f"READY from dp_rank={rank} before any HELLO: an engine must say HELLO "
                f"and receive its INIT reply first; restart the engine so it handshakes "
                f"from the beginning",
            )
        if not self._alive(lease, now):
            if lease.state is RankState.DEAD:
                why = f"its registration (incarnation {lease.incarnation}) is dead"
            else:
                age = _seconds(now - lease.last_seen)
                why = f"its lease expired (last seen {age} s ago)"
            return Refused(
                RefusalReason.OUT_OF_ORDER,
                f"READY from dp_rank={rank}, but {why}; restart the engine so it "
                f"registers again with HELLO",
            )
        if (lease.state, LeaseEvent.READY) not in NEXT_STATE:
            return Refused(
                RefusalReason.OUT_OF_ORDER,
                f"duplicate READY from dp_rank={rank}: the rank is already "
                f"{lease.state.value} (incarnation {lease.incarnation}); READY is "
                f"accepted once per HELLO",
            )
        group_hash = self._pinned_hash()
        if (
            parallel_config_hash is not None
            and group_hash is not None
            and parallel_config_hash != group_hash
        ):
            # The rank is released rather than kept: this engine can never join.
            lease.state = RankState.DEAD
            lease.died_from = None
            self._dispatchable = None
            return Refused(
                RefusalReason.CONFIG_HASH_MISMATCH,
                f"parallel config hash mismatch for dp_rank={rank}: the group runs with "
                f"{group_hash}, this engine has {parallel_config_hash}. Mismatched "
                f"parallel settings make collectives hang, so dp_rank={rank} was "
                f"refused and released; restart it with the same parallel settings as "
                f"the other ranks",
            )
        if parallel_config_hash is not None:
            self._group_config_hash = parallel_config_hash
        lease.state = NEXT_STATE[(lease.state, LeaseEvent.READY)]
        self._dispatchable = None
        lease.parallel_config_hash = parallel_config_hash
        lease.last_seen = now
        self._connections.said_hello(rank, lease, conn)
        return Accepted(dataclasses.replace(lease))

    # -- liveness --------------------------------------------------------------

    def greeted(self, rank: int, now: float, conn: int = 0) -> Greeting:
        """A greeting for ``rank`` arrived on ``dispatch`` from connection ``conn``."""
        lease = self._leases.get(rank)
        if lease is None or not self._alive(lease, now):
            return Greeting.UNREGISTERED
        greeting = self._connections.greeted(rank, lease, conn)
        if greeting is not Greeting.SECOND_CLAIM:
            lease.last_seen = now  # a second claim is someone else's: it renews nothing
        self._dispatchable = None
        return greeting

    def touch(self, rank: int, now: float) -> None:
        """Traffic from ``rank`` renews its lease, however old; a DEAD lease stays DEAD."""
        lease = self._leases.get(rank)
        if lease is not None and lease.state is not RankState.DEAD:
            lease.last_seen = now

    def renew(self, rank: int, heard_at: float) -> None:
        """A probe reached ``rank``'s engine, which proves it was heard at ``heard_at``."""
        lease = self._leases.get(rank)
        if lease is None or lease.state is RankState.DEAD:
            return
        lease.last_seen = max(lease.last_seen, heard_at)
        if lease.dispatch_lost:
            lease.dispatch_lost = False
            self._dispatchable = None

    def mark_unreachable(self, rank: int) -> None:
        """Nobody holds ``rank``'s identity on ``dispatch`` now: no new requests go there."""
        lease = self._leases.get(rank)
        if lease is not None and not lease.dispatch_lost:
            lease.dispatch_lost = True
            self._dispatchable = None

    def revive(self, rank: int, heard_at: float, cause: str) -> RankChanged | Refused | None:
        """A DEAD lease that died settled is back (same incarnation): its engine was heard
        at ``heard_at``. None when the lease cannot be revived; refused when the group
        pinned another parallel config hash meanwhile (it was redeployed while this rank
        was away, and the engine must restart with the group's settings)."""
        lease = self._leases.get(rank)
        if lease is None or lease.state is not RankState.DEAD or lease.died_from is None:
            return None
        if lease.parallel_config_hash is not None:
            pinned = self._pinned_hash()
            if pinned is not None and pinned != lease.parallel_config_hash:
                return Refused(
                    RefusalReason.CONFIG_HASH_MISMATCH,
                    f"dp_rank={rank} is reachable again, but the group now runs with "
                    f"parallel config hash {pinned} and this engine has "
                    f"{lease.parallel_config_hash}; it stays dead: restart it with the "
                    f"group's parallel settings",
                )
            self._group_config_hash = lease.parallel_config_hash
        state = lease.died_from
        lease.died_from = None
        lease.state = state
        lease.last_seen = max(lease.last_seen, heard_at)
        lease.dispatch_lost = False
        self._dispatchable = None
        return RankChanged(rank, RankState.DEAD, state, cause)

    def connection_closed(self, conn: int) -> int | None:
        """A connection a lease was seen on closed; returns the rank whose lease it was
        (see ``core.ranks.connections`` for what the close means)."""
        rank = self._connections.closed(conn, self._leases)
        if rank is not None:
            self._dispatchable = None
        return rank

    def credit_pause(self, seconds: float, now: float) -> None:
        """The coordinator itself did not run for ``seconds``: that time is nobody's
        silence, so every live lease's last sighting moves on by it."""
        for lease in self._leases.values():
            if lease.state is not RankState.DEAD:
                lease.last_seen = min(now, lease.last_seen + seconds)

    def disconnected(
        self, rank: int, now: float, *, incarnation: int | None = None
    ) -> list[RankChanged]:
        """The engine holding ``rank`` is gone; its lease turns DEAD at once.

        Pass ``incarnation`` when the disconnect belongs to a known registration,
        so a late notice about a replaced engine cannot kill its successor.
        """
        lease = self._leases.get(rank)
        if lease is None or (incarnation is not None and incarnation != lease.incarnation):
            return []
        age = _seconds(now - lease.last_seen)
        cause = f"engine disconnected (last seen {age} s ago)"
        return self._apply(lease, LeaseEvent.DISCONNECT, cause)

    def expire(
        self, now: float, *, spare: Collection[int] = (), only: Collection[int] | None = None
    ) -> list[RankChanged]:
        """Leases not renewed within the TTL turn DEAD, except those of ``spare``
        (ranks being probed right now: their probe's answer decides); with ``only``,
        just those ranks are looked at."""
        changes: list[RankChanged] = []
        for rank in sorted(self._leases) if only is None else sorted(only):
            lease = self._leases.get(rank)
            if lease is None or rank in spare:
                continue
            if lease.state is not RankState.DEAD and not self._alive(lease, now):
                age = _seconds(now - lease.last_seen)
                changes += self._apply(
                    lease, LeaseEvent.EXPIRE, f"lease expired (last seen {age} s ago)"
                )
        return changes

    # -- operator commands -----------------------------------------------------

    def cordon(self, rank: int, *, now: float | None = None,
               cause: str | None = None) -> RankChanged | Refused:
        """Keep ``rank`` in the wave but send it no new requests, until uncordoned.
        ``cause`` replaces the operator's cause when a rule of the coordinator cordons."""
        return self._command(rank, LeaseEvent.CORDON, now, cause)

    def uncordon(self, rank: int, *, now: float | None = None) -> RankChanged | Refused:
        """Return a cordoned or draining rank to dispatch."""
        return self._command(rank, LeaseEvent.UNCORDON, now)

    def drain(self, rank: int, *, now: float | None = None) -> RankChanged | Refused:
        """Send ``rank`` no new requests; the server reports when it has none left."""
        return self._command(rank, LeaseEvent.DRAIN, now)

    # -- range -----------------------------------------------------------------

    def restore(
        self,
        rank: int,
        *,
        engine_id: str | None,
        incarnation: int,
        state: RankState,
        local: bool,
        headless: bool,
        parallel_config_hash: str | None,
        now: float,
    ) -> Accepted | Refused:
        """Re-create a lease saved by a previous coordinator process.

        Only settled states come back (READY, CORDONED, DRAINING): a handshake in
        progress cannot be resumed. The lease starts fresh (``last_seen = now``) and
        counts as connected, since its engine's sockets reconnect on their own; the
        server's probes and the TTL then confirm or bury it like any other lease.
        """
        out_of_range = self.check_rank(rank)
        if out_of_range is not None:
            return out_of_range
        if state not in (RankState.READY, RankState.CORDONED, RankState.DRAINING):
            return Refused(
                RefusalReason.INVALID_TRANSITION,
                f"cannot restore dp_rank={rank} as {state.value}: only ready, cordoned or "
                f"draining registrations survive a coordinator restart",
            )
        if rank in self._leases:
            return Refused(
                RefusalReason.INVALID_TRANSITION,
                f"cannot restore dp_rank={rank}: it is already registered",
            )
        incarnation = max(incarnation, self._last_incarnation.get(rank, 0))
        self._last_incarnation[rank] = incarnation
        lease = EngineLease(
            rank=rank,
            engine_id=engine_id,
            state=state,
            registered_at=now,
            last_seen=now,
            local=local,
            headless=headless,
            dispatch_connected=True,
            parallel_config_hash=parallel_config_hash,
            incarnation=incarnation,
        )
        self._leases[rank] = lease
        self._dispatchable = None
        if parallel_config_hash is not None and self._group_config_hash is None:
            self._group_config_hash = parallel_config_hash
        return Accepted(dataclasses.replace(lease))

    def resize(self, new_count: int) -> list[RankChanged]:
        """Change the number of ranks; leases above the new range are dropped."""
        if new_count < 0 or self._rank_start + new_count - 1 > MAX_RANK:
            raise ValueError(f"cannot resize to {new_count} ranks from rank {self._rank_start}")
        old_count = self._rank_count
        self._rank_count = new_count
        end = self._rank_start + new_count
        cause = f"rank removed: group resized from {old_count} to {new_count} ranks"
        dropped = [rank for rank in sorted(self._leases) if rank >= end]
        changes = [RankChanged(rank, self._leases[rank].state, None, cause) for rank in dropped]
        for rank in dropped:
            self._connections.forget(rank, self._leases.pop(rank))
            self._dispatchable = None
        return changes

    # -- internals -------------------------------------------------------------

    def _ttl(self, lease: EngineLease) -> float:
        if lease.state is RankState.HANDSHAKING:
            return self._handshake_ttl_s
        return self._lease_ttl_s

    def _alive(self, lease: EngineLease, now: float | None) -> bool:
        return is_alive(lease, now, self._ttl(lease))

    def _apply(self, lease: EngineLease, event: LeaseEvent, cause: str) -> list[RankChanged]:
        new = NEXT_STATE.get((lease.state, event))
        if new is None:
            return []
        old = lease.state
        lease.state = new
        # Death by silence or disconnect is a verdict on evidence: a settled lease may
        # be revived by evidence of life.
        lease.died_from = old if old in _JOINED else None
        self._dispatchable = None
        return [RankChanged(lease.rank, old, new, cause)]

    def _pinned_hash(self) -> str | None:
        """The group's hash, while a lease that passed READY and is not DEAD carries one.

        Not DEAD, rather than alive at some ``now``: a lease past its TTL is renewed
        by its next traffic or probe answer (``touch``, ``renew``) until ``expire``
        judges it, so until then its hash is still the group's.
        """
        for lease in self._leases.values():
            if lease.state in _JOINED and lease.parallel_config_hash is not None:
                return self._group_config_hash
        return None

    def _command(self, rank: int, event: LeaseEvent, now: float | None,
                 cause: str | None = None) -> RankChanged | Refused:
        out_of_range = self.check_rank(rank)
        if out_of_range is not None:
            return out_of_range
        verb = event.value
        lease = self._leases.get(rank)
        if lease is None or not self._alive(lease, now):
            if lease is None:
                detail = "no engine has registered for it"
            elif lease.state is RankState.DEAD:
                detail = f"its last engine (incarnation {lease.incarnation}) is dead"
            else:
                detail = "its engine's lease has expired"
            return Refused(
                RefusalReason.UNKNOWN_RANK,
                f"cannot {verb} dp_rank={rank}: no live engine holds it ({detail})",
            )
        new = NEXT_STATE.get((lease.state, event))
        if new is None:
            hint = _COMMAND_HINTS[(lease.state, event)]
            return Refused(
                RefusalReason.INVALID_TRANSITION,
                f"cannot {verb} dp_rank={rank}: it is {lease.state.value}; {hint}",
            )
        old = lease.state
        lease.state = new
        self._dispatchable = None
        return RankChanged(rank, old, new, cause or _COMMAND_CAUSES[event])

    def _mismatch_message(self, holder: EngineLease, engine_id: str | None, now: float) -> str:
        rank = holder.rank
        return (
            f"Engine ID mismatch for dp_rank={rank}: expected {holder.engine_id}, "
            f"got {engine_id}. dp_rank={rank} is held by a live engine "
            f"({self._holder_facts(holder, now)}). Stop the old engine: its rank is freed "
            f"as soon as its connections are gone, and this engine is accepted when it "
            f"says HELLO again."
        )

    def _held_message(self, holder: EngineLease, now: float) -> str:
        rank = holder.rank
        return (
            f"dp_rank={rank} is held by a live engine ({self._holder_facts(holder, now)}), "
            f"and neither engine has an engine_id to tell whether they are the same. Stop "
            f"the old engine: its rank is freed as soon as its connections are gone, and "
            f"this engine is accepted when it says HELLO again; or give this engine "
            f"another rank."
        )

    def _holder_facts(self, holder: EngineLease, now: float) -> str:
        age = _seconds(now - holder.last_seen)
        return (
            f"{holder.state.value}, incarnation {holder.incarnation}, still connected, "
            f"last seen {age} s ago"
        )
