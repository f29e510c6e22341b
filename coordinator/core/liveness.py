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
it does prove is that the connection is open, and the dispatch socket runs
ZMTP heartbeats (``heartbeat_ivl_s``, ``heartbeat_timeout_s``): libzmq pings
every interval and drops a connection on which nothing arrived for the
timeout after a ping. An open connection therefore proves that the engine was
heard at most ``heard_within_s`` (interval plus timeout) ago, and a probe
renews the lease to that moment, no later. A host that vanished is cut off by
the heartbeats within ``heard_within_s``, its probes fail, and its lease dies
within the TTL of the last thing that really arrived from it.

The lease timer runs every ``check_interval_s(ttl)``. At each run it probes
(``ranks_to_probe``) every lease greeted on dispatch, not claimed by another
connection (see ``core.claims``), and

* live and quiet for ``quiet_after_s(ttl)`` or more, or live whose dispatch
  connection dropped (it gets no new requests until a probe reaches it), or
* DEAD, but revivable: it died settled, of silence or of a failed probe.

Then every other lease past its TTL expires (``Membership.expire``, sparing
the probed ones: their probe's answer decides). ``PROBE_OUTCOMES`` says what
an answer does, given the lease's condition when it was probed:

================  ========  ===============================================
lease             answered  effect
================  ========  ===============================================
live, quiet       yes       renewed to when it was surely heard
live, quiet       no        DEAD (disconnected), revivable
live, heard       yes       renewed to when it was surely heard
live, heard       no        unreachable: no new requests, probed next run
dead, revivable   yes       revived: back to the state it died in
dead, revivable   no        nothing: still dead
================  ========  ===============================================

"Heard" is a lease whose last traffic is newer than ``quiet_after_s``: an
engine whose stats arrive but whose dispatch connection is gone is alive (it
steps in waves and finishes its requests, whose outputs go straight to the
frontends), so it is only kept out of dispatch until its connection is back.

A HELLO for a rank whose holder cannot be judged by connection facts probes
the holder too (``core.claims``): ``HOLDER_PROBE_OUTCOMES``.

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

from coordinator.core.membership import EngineLease, RankState
from coordinator.protocol import vllm

# An empty ABORT: the type frame and an empty request id list.
PROBE_FRAMES: tuple[bytes, bytes] = (vllm.ABORT, vllm.encode_abort([]))

#: A tick at least this late says the coordinator did not run meanwhile.
PAUSE_CREDIT_S = 1.0


class ProbeKind(enum.Enum):
    LEASE = "lease"  # from the lease timer
    HOLDER = "holder"  # the holder of a rank another engine says HELLO for


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
    REVIVE = "revive"
    NOTHING = "nothing"
    REFUSE_HELLO = "refuse_hello"
    TAKE_OVER = "take_over"


_C = LeaseCondition
_P = ProbeEffect

PROBE_OUTCOMES: Mapping[tuple[LeaseCondition, bool], ProbeEffect] = {
    (_C.QUIET, True): _P.RENEW,
    (_C.QUIET, False): _P.DISCONNECT,
    (_C.HEARD, True): _P.RENEW,
    (_C.HEARD, False): _P.UNREACHABLE,
    (_C.REVIVABLE, True): _P.REVIVE,
    (_C.REVIVABLE, False): _P.NOTHING,
    (_C.FINAL, True): _P.NOTHING,
    (_C.FINAL, False): _P.NOTHING,
}

HOLDER_PROBE_OUTCOMES: Mapping[bool, ProbeEffect] = {
    True: _P.REFUSE_HELLO,
    False: _P.TAKE_OVER,
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
    """How long after a ping a silent connection is dropped: 0.4 TTL, at least 100 ms."""
    return max(0.1, lease_ttl_s * 0.4)


def heard_within_s(lease_ttl_s: float) -> float:
    """How long ago an engine was surely heard if its heartbeated connection is open."""
    return heartbeat_ivl_s(lease_ttl_s) + heartbeat_timeout_s(lease_ttl_s)


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
