"""Liveness: which engines are probed, what a probe proves, and what a pause of our own means.

Theory of operation
-------------------
A registration is a lease renewed by what arrives from its engine
(``Membership``), and leases are judged by what arrived, never by how much
wall time the coordinator spent. vLLM engines send nothing while idle, so
silence alone proves nothing, and the coordinator *probes* quiet engines: an
empty ABORT on the dispatch socket, a no-op for every vLLM engine (dense or
MoE, idle or busy). The dispatch socket has ``ROUTER_MANDATORY``, so a probe
fails at once when nobody holds the rank's identity there.

A probe that was only queued proves nothing about the engine by itself: a host
that was cut off still has an open connection until something notices. What
counts is what arrived. The dispatch socket pings every connection
(``heartbeat_ivl_s``), and every engine's ZeroMQ answers by itself, idle or
busy, so a live engine is heard at least that often. A probe's answer says how
long ago anything last arrived on the rank's connection:

* over tcp the server reads it from the kernel (``SendSucceeded.heard_ago_s``).
  The connection is not dropped for silence (only after ``TCP_SILENCE_LIMIT_S``):
  a host cut off by a partition keeps it, and when the partition heals the same
  connection carries on (an engine never learns of a connection dropped during
  a partition, since the drop cannot reach it, and would never reconnect);
* over ipc, where a dropped connection always reaches the local engine, libzmq
  drops a connection silent for ``heartbeat_timeout_s`` after a ping, so an
  open one was heard within ``heard_within_s`` (interval plus timeout), and
  that is what its probe proves (as for any connection the server cannot
  measure).

A probe renews the lease to when the engine was heard, never later, so a host
that vanished dies ``--lease-ttl-s`` after the last thing that really arrived
from it. An answer with nothing heard for ``silent_after_s`` (three ping
intervals: two pings went unanswered) is *silent*: the rank gets no new
requests until it is heard again, long before it would be declared dead.

The lease timer runs every ``check_interval_s(ttl)``. At each run it probes
(``ranks_to_probe``) every lease greeted on dispatch, not claimed by another
connection (see ``core.claims``), and

* live and quiet for ``quiet_after_s(ttl)`` or more, or live whose dispatch
  connection dropped (it gets no new requests until a probe reaches it), or
* DEAD, but revivable: it died settled, of silence or of a failed probe.

Then every other lease past its TTL expires (``Membership.expire``, sparing
the probed ones: their probe's answer decides). ``PROBE_OUTCOMES`` says what
an answer does (``ProbeAnswer``: heard lately, silent, or missed because
nobody holds the identity), given the lease's condition when it was probed:

================  ========  ===============================================
lease             answer    effect
================  ========  ===============================================
live, quiet       heard     renewed to when it was heard
live, quiet       silent    renewed to when it was heard; no new requests
live, quiet       missed    DEAD (disconnected), revivable
live, heard       heard     renewed to when it was heard
live, heard       silent    renewed to when it was heard; no new requests
live, heard       missed    unreachable: no new requests, probed next run
dead, revivable   heard     revived: back to the state it died in
dead, revivable   silent    nothing: still dead
dead, revivable   missed    nothing: still dead
================  ========  ===============================================

"Live, heard" is a lease whose last traffic is newer than ``quiet_after_s``:
an engine whose stats arrive but whose dispatch connection is gone is alive
(it steps in waves and finishes its requests, whose outputs go straight to
the frontends), so it is only kept out of dispatch until its connection is
back.

A HELLO for a rank whose holder cannot be judged by connection facts probes
the holder too (``core.claims``): ``HOLDER_PROBE_OUTCOMES``; a holder that is
silent or missed is taken over, and its connection, if still open, is cut so
that its successor can connect under the same identity.

**A pause of the coordinator itself** (SIGSTOP, a frozen VM, swapping, a long
collection) is nobody's silence. The timer is due at least every
``observe_interval_s``; a tick that comes ``pause_credit_s`` late or more
means the process did not run for that long, and every live lease is credited
with the lateness (``Membership.credit_pause``) before anything is judged.
The lease check of that tick is deferred by one interval, so what the engines
sent meanwhile, queued in the sockets, is read first.

No IO, no clock: the caller sends the probes and reports their outcomes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from coordinator.core.ranks.membership import EngineLease, RankState
from coordinator.protocol import vllm

# An empty ABORT: the type frame and an empty request id list.
PROBE_FRAMES: tuple[bytes, bytes] = (vllm.ABORT, vllm.encode_abort([]))

#: A tick at least this late says the coordinator did not run meanwhile.
PAUSE_CREDIT_S = 1.0

#: A tcp dispatch connection silent this long is dropped all the same (a backstop for a
#: crashed host's connection that no successor came to take over).
TCP_SILENCE_LIMIT_S = 600.0


class ProbeKind(enum.Enum):
    LEASE = "lease"  # from the lease timer
    HOLDER = "holder"  # the holder of a rank another engine says HELLO for


class ProbeAnswer(enum.Enum):
    """What a probe found."""

    HEARD = "heard"  # sent, and the connection carried something lately
    SILENT = "silent"  # sent, but nothing arrived on the connection lately
    MISSED = "missed"  # nobody holds the identity


class LeaseCondition(enum.Enum):
    """A probed lease, as its probe's answer finds it."""

    QUIET = "live, quiet"
    HEARD = "live, heard"
    REVIVABLE = "dead, revivable"
    FINAL = "dead for good"


class ProbeEffect(enum.Enum):
    RENEW = "renew"
    DISCONNECT = "disconnect"
    UNREACHABLE = "unreachable"
    STALE = "stale"
    REVIVE = "revive"
    NOTHING = "nothing"
    REFUSE_HELLO = "refuse_hello"
    TAKE_OVER = "take_over"


_C = LeaseCondition
_A = ProbeAnswer
_P = ProbeEffect

PROBE_OUTCOMES: Mapping[tuple[LeaseCondition, ProbeAnswer], ProbeEffect] = {
    (_C.QUIET, _A.HEARD): _P.RENEW,
    (_C.QUIET, _A.SILENT): _P.STALE,
    (_C.QUIET, _A.MISSED): _P.DISCONNECT,
    (_C.HEARD, _A.HEARD): _P.RENEW,
    (_C.HEARD, _A.SILENT): _P.STALE,
    (_C.HEARD, _A.MISSED): _P.UNREACHABLE,
    (_C.REVIVABLE, _A.HEARD): _P.REVIVE,
    (_C.REVIVABLE, _A.SILENT): _P.NOTHING,
    (_C.REVIVABLE, _A.MISSED): _P.NOTHING,
    (_C.FINAL, _A.HEARD): _P.NOTHING,
    (_C.FINAL, _A.SILENT): _P.NOTHING,
    (_C.FINAL, _A.MISSED): _P.NOTHING,
}

HOLDER_PROBE_OUTCOMES: Mapping[ProbeAnswer, ProbeEffect] = {
    _A.HEARD: _P.REFUSE_HELLO,
    _A.SILENT: _P.TAKE_OVER,
    _A.MISSED: _P.TAKE_OVER,
}


def check_interval_s(lease_ttl_s: float) -> float:
    """How often the lease timer runs: four times per TTL, between 50 ms and 1 s."""
    return max(0.05, min(1.0, lease_ttl_s / 4))


def quiet_after_s(lease_ttl_s: float) -> float:
    """Silence after which a lease is probed: a third of the TTL, so two probes fit in it."""
    return lease_ttl_s / 3


def heartbeat_ivl_s(lease_ttl_s: float) -> float:
    """ZMTP ping interval on ``handshake`` and ``dispatch``: a tenth of the TTL, >= 20 ms."""
    return max(0.02, lease_ttl_s / 10)


def heartbeat_timeout_s(lease_ttl_s: float) -> float:
    """How long after a ping a silent connection is dropped (``handshake``, and
    ``dispatch`` over ipc): 0.4 TTL, at least 100 ms."""
    return max(0.1, lease_ttl_s * 0.4)


def heard_within_s(lease_ttl_s: float) -> float:
    """Half a TTL: a connection heard within this long is a live one (interval plus
    timeout: an open, heartbeated connection was heard at least that recently)."""
    return heartbeat_ivl_s(lease_ttl_s) + heartbeat_timeout_s(lease_ttl_s)


def silent_after_s(lease_ttl_s: float) -> float:
    """Nothing heard for three ping intervals (two pings unanswered): silent."""
    return 3 * heartbeat_ivl_s(lease_ttl_s)


def answer_of(sent: bool, heard_ago_s: float | None, silent_after: float) -> ProbeAnswer:
    """What a probe found: ``heard_ago_s`` is None when it could not be measured."""
    if not sent:
        return _A.MISSED
    if heard_ago_s is None or heard_ago_s <= silent_after:
        return _A.HEARD
    return _A.SILENT


def condition(lease: EngineLease, now: float, quiet_after: float) -> LeaseCondition:
    """How a probe's answer finds ``lease``."""
    if lease.state is RankState.DEAD:
        return _C.REVIVABLE if lease.died_from is not None else _C.FINAL
    return _C.QUIET if now - lease.last_seen >= quiet_after else _C.HEARD


def probe_due(lease: EngineLease, now: float, quiet_after: float) -> bool:
    """Whether the lease timer probes ``lease`` at ``now``."""
    if not lease.dispatch_connected or lease.dispatch_claimed_by:
        return False  # never greeted, or its identity is someone else's: nothing to ask
    if lease.state is RankState.DEAD:
        return lease.died_from is not None
    return lease.dispatch_lost or now - lease.last_seen >= quiet_after


def ranks_to_probe(leases: Iterable[EngineLease], now: float, quiet_after: float) -> list[int]:
    """The ranks the lease timer probes at ``now``, ascending if ``leases`` is."""
    return [lease.rank for lease in leases if probe_due(lease, now, quiet_after)]


def pause_of(due: float, now: float) -> float:
    """Seconds the coordinator did not run, for a tick due at ``due`` that came at ``now``
    (0 when it came in time)."""
    late = now - due
    return late if late >= PAUSE_CREDIT_S else 0.0
