"""Liveness probes: when to ask if an engine is still connected, and what the answer means.

Theory of operation
-------------------
A registration is a lease renewed by the engine's traffic (``Membership``). But
vLLM engines send nothing while idle, so silence alone proves nothing, and a
lease must not die just because its engine had no work. The coordinator
therefore *probes* quiet engines: it sends an empty ABORT on the dispatch
socket. That is a no-op for every vLLM engine (dense or MoE, idle or busy), and
the dispatch socket has ``ROUTER_MANDATORY``, so the send fails at once when
the engine's connection is gone. A probe that is accepted proves the
connection; one that fails proves it gone (tcp connections that die silently
are cut by ZMTP heartbeats first, which turns them into failed probes).

The lease timer runs every ``check_interval_s(ttl)``. At each run:

* every lease that is not DEAD, greeted on dispatch (so it can be probed) and
  quiet for ``quiet_after_s(ttl)`` or more is probed;
* every other lease past its TTL expires (``Membership.expire``, sparing the
  probed ones: their probe's answer decides). Probing first means a coordinator
  that was itself paused longer than a TTL does not condemn live engines.

A HELLO for a rank held by a live engine with another ``engine_id`` probes the
holder too (``Membership``'s PROBE_HOLDER verdict): a holder whose connection
is gone has died without a goodbye, and its successor takes the rank at once
instead of waiting out the lease.

``PROBE_OUTCOMES`` says what each answer does:

==============  ========  ===================================================
probe           answered  effect
==============  ========  ===================================================
LEASE           yes       the lease is renewed
LEASE           no        the lease turns DEAD (disconnected)
HOLDER          yes       the HELLO is refused: Engine ID mismatch
HOLDER          no        the holder turns DEAD and the new engine takes over
==============  ========  ===================================================

No IO, no clock: the caller sends the probes and reports their outcomes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from coordinator.core.membership import EngineLease, RankState
from coordinator.protocol import vllm

# An empty ABORT: the type frame and an empty request id list.
PROBE_FRAMES: tuple[bytes, bytes] = (vllm.ABORT, vllm.encode_abort([]))


class ProbeKind(enum.Enum):
    LEASE = "lease"  # a quiet lease, from the lease timer
    HOLDER = "holder"  # the holder of a rank another engine says HELLO for


class ProbeEffect(enum.Enum):
    RENEW = "renew"
    DISCONNECT = "disconnect"
    REFUSE_HELLO = "refuse_hello"
    TAKE_OVER = "take_over"


PROBE_OUTCOMES: Mapping[tuple[ProbeKind, bool], ProbeEffect] = {
    (ProbeKind.LEASE, True): ProbeEffect.RENEW,
    (ProbeKind.LEASE, False): ProbeEffect.DISCONNECT,
    (ProbeKind.HOLDER, True): ProbeEffect.REFUSE_HELLO,
    (ProbeKind.HOLDER, False): ProbeEffect.TAKE_OVER,
}


def check_interval_s(lease_ttl_s: float) -> float:
    """How often the lease timer runs: four times per TTL, between 50 ms and 1 s."""
    return max(0.05, min(1.0, lease_ttl_s / 4))


def quiet_after_s(lease_ttl_s: float) -> float:
    """Silence after which a lease is probed: a third of the TTL, so two probes fit in it."""
    return lease_ttl_s / 3


def probe_due(lease: EngineLease, now: float, quiet_after: float) -> bool:
    """Whether the lease timer probes ``lease`` at ``now``."""
    return (
        lease.state is not RankState.DEAD
        and lease.dispatch_connected
        and now - lease.last_seen >= quiet_after
    )


def ranks_to_probe(leases: Iterable[EngineLease], now: float, quiet_after: float) -> list[int]:
    """The ranks the lease timer probes at ``now``, ascending if ``leases`` is."""
    return [lease.rank for lease in leases if probe_due(lease, now, quiet_after)]
