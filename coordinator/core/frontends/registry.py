"""Frontend registrations (leases): client indices, pinned output addresses, held INITs.

Theory of operation
-------------------
A frontend registers under a *client index* with the address where engines
push its outputs (and, optionally, an address where it takes requests
itself). Engines learn every frontend's output address from their INIT reply,
as a list indexed by client index, and push each request's outputs to the
index the request carries. Three rules follow.

**INITs wait for the frontends.** With ``expected = K > 0`` (``--frontends``)
an engine's INIT is held until K frontends have registered, so that every
engine knows every output address; the held INITs all go out at the
registration that makes K. Without K, INITs go out at once with whatever is
registered (``init_step``):

=======================  ==============================
frontends                INIT
=======================  ==============================
none expected (K = 0)    SEND
K registered             SEND
fewer than K registered  HOLD, until the K-th registers
=======================  ==============================

**A registration is a lease.** Any message from the connection that
registered renews it, and so does a ``heartbeat`` (the SDK sends one every
``interval``, a third of the TTL or less); one not renewed for
``lease_ttl_s`` expires (``expire``): the frontend's slot is free for another,
and so is its client index, within the pin below. A pause of the
coordinator itself (no lease check for several check intervals) renews
every registration instead of judging it: the frontends' messages are still
queued, unread.

**An output address is pinned once an INIT carried it.** Engines keep pushing
to the address they learnt; a registration that moved it would silently send
that index's outputs elsewhere. So once an INIT listed an index's address,
the index keeps it for the life of the coordinator (and across restarts, in the
state file), registered or not: a restarted frontend must bind the same
address to take its index back; a frontend with another address must use
another index. An index no INIT carried is free as soon as its lease expires.
In an INIT, an index with neither a registration nor a pin is given the
coordinator's own ``back_output`` address, so that a stray output for it is
dropped and counted there instead of reaching another frontend.

**Outputs go only where an INIT said so.** An engine learns output addresses
from its INIT alone, so a frontend that registers under an index some INIT did
not carry (no ``--frontends``, and it came after the engines) cannot get
outputs from the engines that INIT went to: they have no socket for that index,
and a request sent there would be lost without a word. The registry remembers
which indices each rank's INIT carried (``note_init``) and, for an index
registered later, which ranks cannot deliver to it (``blind_ranks``): the
dispatch domain sends that frontend's requests only elsewhere, and refuses
them when no rank can deliver. A rank's next INIT (a restarted engine) lifts it.

``register_verdict`` decides a registration; the first matching row wins
(``limit`` is K when K > 0, else ``max_frontends``):

=========================================================  ============  =================
condition                                                  verdict       effect
=========================================================  ============  =================
index >= limit                                             OUT_OF_RANGE  refused
index pinned to another output address                     PINNED        refused
index registered, other output address, INITs sent         PINNED        refused
index not registered                                       NEW           added
index registered from another connection                   MOVED         replaced; the
                                                                         index's requests
                                                                         now report there
index registered from the same connection                  RENEWED       replaced
=========================================================  ============  =================

Indices below the limit are at most as many as the slots, so a limit on
indices is also the limit on registrations, and on the length of INIT's
``outputs``. A refused registration changes nothing.

No IO: the caller sends the replies and the INITs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.core.persisted import SavedFrontend


@dataclass(frozen=True)
class FrontendPeer:
    """One registered frontend."""

    identity: bytes
    client_index: int
    output_address: str
    input_address: str | None


class RegisterVerdict(enum.Enum):
    NEW = "new"
    MOVED = "moved"
    RENEWED = "renewed"
    OUT_OF_RANGE = "out_of_range"
    PINNED = "pinned"


ACCEPTED_VERDICTS = frozenset({RegisterVerdict.NEW, RegisterVerdict.MOVED, RegisterVerdict.RENEWED})


def register_verdict(
    *,
    client_index: int,
    identity: bytes,
    output_address: str,
    previous: FrontendPeer | None,
    expected: int,
    max_frontends: int,
    inits_sent: bool,
    pinned: str | None = None,
) -> RegisterVerdict:
    """The table in the module docstring, top to bottom."""
    if client_index >= (expected or max_frontends):
        return RegisterVerdict.OUT_OF_RANGE
    if pinned is not None and pinned != output_address:
        return RegisterVerdict.PINNED
    if previous is None:
        return RegisterVerdict.NEW
    if previous.output_address != output_address and inits_sent:
        return RegisterVerdict.PINNED
    if previous.identity != identity:
        return RegisterVerdict.MOVED
    return RegisterVerdict.RENEWED


class InitStep(enum.Enum):
    SEND = "send"
    HOLD = "hold"


def init_step(*, expected: int, registered: int) -> InitStep:
    """Whether an engine's INIT goes out now or waits for frontends (the INIT hold)."""
    return InitStep.HOLD if expected and registered < expected else InitStep.SEND


@dataclass(frozen=True)
class Registration:
    """What a registration did: the verdict, the entry it replaced, and why if refused."""

    verdict: RegisterVerdict
    previous: FrontendPeer | None
    refusal: str | None = None


DEFAULT_LEASE_TTL_S = 30.0
# No lease check for this many check intervals: the coordinator itself was paused.
PAUSE_CHECKS = 4


class FrontendRegistry:
    """Registered frontends by client index (leases), the INIT hold and the address pins."""

    def __init__(self, *, expected: int, max_frontends: int,
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        if expected < 0 or max_frontends < 0:
            raise ValueError("expected and max_frontends must be >= 0")
        if not lease_ttl_s > 0:
            raise ValueError(f"the frontend lease TTL must be positive, got {lease_ttl_s}")
        self.expected = expected
        self.max_frontends = max_frontends
        self.lease_ttl_s = lease_ttl_s
        self.inits_sent = False
        self._peers: dict[int, FrontendPeer] = {}
        self._seen: dict[int, float] = {}
        self._by_identity: dict[bytes, list[int]] = {}
        self._pinned: dict[int, str] = {}
        self._held_inits: dict[int, bytes] = {}
        self._last_check: float | None = None
        # Which indices each rank's INIT carried, and for indices registered since, the
        # ranks whose INIT did not (they cannot deliver that index's outputs).
        self._carried: dict[int, frozenset[int]] = {}
        self._blind: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, client_index: int) -> FrontendPeer | None:
        return self._peers.get(client_index)

    def peers(self) -> list[FrontendPeer]:
        """Registered frontends by ascending client index."""
        return [self._peers[index] for index in sorted(self._peers)]

    def identities(self) -> list[bytes]:
        """Connections of every registered frontend (for notices to all of them)."""
        return list(self._by_identity)

    def pinned(self) -> dict[int, str]:
        """Output addresses by client index that INITs carried (a copy)."""
        return dict(self._pinned)

    @property
    def heartbeat_interval_s(self) -> float:
        """How often a frontend should renew its lease (a third of the TTL)."""
        return self.lease_ttl_s / 3

    def register(
        self,
        client_index: int,
        identity: bytes,
        output_address: str,
        input_address: str | None,
        *,
        now: float = 0.0,
    ) -> Registration:
        """Decide and, unless refused, record a registration (a fresh lease)."""
        previous = self._peers.get(client_index)
        verdict = register_verdict(
            client_index=client_index, identity=identity, output_address=output_address,
            previous=previous, expected=self.expected,
            max_frontends=self.max_frontends, inits_sent=self.inits_sent,
            pinned=self._pinned.get(client_index),
        )
        if verdict not in ACCEPTED_VERDICTS:
            return Registration(verdict, previous, self._refusal(verdict, client_index, previous))
        if previous is not None:
            self._unlink(previous)
        self._add(FrontendPeer(identity, client_index, output_address, input_address), now)
        blind = {rank for rank, carried in self._carried.items() if client_index not in carried}
        if blind:
            self._blind[client_index] = blind
        return Registration(verdict, previous)

    def blind_ranks(self, identity: bytes) -> set[int]:
        """The ranks that cannot deliver outputs to an index ``identity`` holds (empty in
        the common case, at the cost of one check)."""
        if not self._blind:
            return set()
        blind: set[int] = set()
        for index in self._by_identity.get(identity, ()):
            blind |= self._blind.get(index, set())
        return blind

    def undeliverable_indices(self) -> dict[int, list[int]]:
        """Registered indices some rank cannot deliver to, with those ranks."""
        return {index: sorted(ranks) for index, ranks in sorted(self._blind.items())}

    def note_init(self, rank: int) -> None:
        """``rank``'s INIT was handed over with every registered or pinned address."""
        carried = frozenset(self._peers) | frozenset(self._pinned)
        self._carried[rank] = carried
        for index in [index for index in self._blind if index in carried]:
            self._blind[index].discard(rank)
            if not self._blind[index]:
                del self._blind[index]

    def touch(self, identity: bytes, now: float) -> None:
        """Traffic from ``identity`` renews every registration it holds (the hot path)."""
        indices = self._by_identity.get(identity)
        if indices is not None:
            seen = self._seen
            for index in indices:
                seen[index] = now

    def holds(self, identity: bytes, client_index: int) -> bool:
        """Whether connection ``identity`` holds the registration of ``client_index``."""
        peer = self._peers.get(client_index)
        return peer is not None and peer.identity == identity

    def expire(self, now: float, *, check_interval_s: float) -> list[FrontendPeer]:
        """Drop the registrations not renewed for ``lease_ttl_s``; return them.

        ``check_interval_s`` is how often the caller checks: a gap of several intervals
        since the last check means the coordinator was paused, and every lease is
        renewed instead (what the frontends sent meanwhile is still unread).
        """
        last, self._last_check = self._last_check, now
        if last is not None and now - last > PAUSE_CHECKS * check_interval_s:
            for index in self._seen:
                self._seen[index] = now
            return []
        deadline = now - self.lease_ttl_s
        gone = [index for index, seen in self._seen.items() if seen < deadline]
        expired = []
        for index in sorted(gone):
            peer = self._peers[index]
            self._unlink(peer)
            expired.append(peer)
        return expired

    def credit_pause(self, now: float) -> None:
        """The coordinator itself did not run until ``now``: what the frontends sent
        meanwhile is still unread, so every lease runs from here."""
        self._last_check = now
        for index in self._seen:
            self._seen[index] = now

    def _add(self, peer: FrontendPeer, now: float) -> None:
        self._peers[peer.client_index] = peer
        self._seen[peer.client_index] = now
        self._by_identity.setdefault(peer.identity, []).append(peer.client_index)

    def _unlink(self, peer: FrontendPeer) -> None:
        self._blind.pop(peer.client_index, None)
        del self._peers[peer.client_index]
        del self._seen[peer.client_index]
        indices = self._by_identity[peer.identity]
        indices.remove(peer.client_index)
        if not indices:
            del self._by_identity[peer.identity]

    def _refusal(
        self, verdict: RegisterVerdict, client_index: int, previous: FrontendPeer | None
    ) -> str:
        if verdict is RegisterVerdict.OUT_OF_RANGE:
            if self.expected:
                return (f"client_index {client_index} is outside 0..{self.expected - 1} "
                        f"(the coordinator was started with --frontends {self.expected})")
            return (f"client_index {client_index} is outside 0..{self.max_frontends - 1} "
                    f"(at most {self.max_frontends} frontends)")
        pinned = self._pinned.get(client_index) or (
            previous.output_address if previous is not None else "?")
        return (f"client_index {client_index} is registered with outputs at {pinned}, which "
                f"engines already use; a restarted frontend must bind that same address (or "
                f"use another client index)")

    # ---- INITs ---------------------------------------------------------------------------

    def init_step(self) -> InitStep:
        return init_step(expected=self.expected, registered=len(self._peers))

    def hold_init(self, rank: int, identity: bytes) -> None:
        """Keep an engine's INIT until the expected frontends registered (newest wins)."""
        self._held_inits[rank] = identity

    def release_inits(self) -> list[tuple[int, bytes]]:
        """Held INITs that may go now, by rank (empty while frontends are missing)."""
        if not self._held_inits or self.init_step() is InitStep.HOLD:
            return []
        held, self._held_inits = self._held_inits, {}
        return sorted(held.items())

    def output_addresses(self, hole: str = "") -> list[str]:
        """The INIT's ``outputs``: by client index, from 0 to the highest registered or
        pinned one; an index with neither gets ``hole``."""
        peers, pinned = self._peers, self._pinned
        if not peers and not pinned:
            return []
        top = max(max(peers, default=0), max(pinned, default=0))
        out = []
        for index in range(top + 1):
            peer = peers.get(index)
            out.append(peer.output_address if peer is not None else pinned.get(index, hole))
        return out

    def pin_outputs(self) -> bool:
        """An INIT is going out with every registered output address: pin them; True if a
        pin is new."""
        changed = False
        for index, peer in self._peers.items():
            if self._pinned.get(index) != peer.output_address:
                self._pinned[index] = peer.output_address
                changed = True
        return changed

    def input_addresses(self) -> list[str]:
        return [peer.input_address for peer in self.peers() if peer.input_address]

    # ---- state file ----------------------------------------------------------------------

    def saved(self) -> list[SavedFrontend]:
        return [
            SavedFrontend(peer.client_index, peer.identity.hex(), peer.output_address,
                          peer.input_address)
            for peer in self._peers.values()
        ]

    def restore(self, frontends: list[SavedFrontend], *, inits_sent: bool, now: float = 0.0,
                pinned: dict[int, str] | None = None) -> None:
        """Resume the registrations (each with a fresh lease) and the pins of a state file."""
        for saved in frontends:
            peer = self._peers.get(saved.client_index)
            if peer is not None:
                self._unlink(peer)
            self._add(FrontendPeer(bytes.fromhex(saved.identity_hex), saved.client_index,
                                   saved.output_address, saved.input_address), now)
        self.inits_sent = inits_sent
        self._pinned.update(pinned or {})


def inits_went_to(ranks: list[int]) -> str:
    """'dp_rank 3 got its INIT' or 'dp_ranks 0, 1 got their INITs'."""
    if len(ranks) == 1:
        return f"dp_rank {ranks[0]} got its INIT"
    return f"dp_ranks {', '.join(map(str, ranks))} got their INITs"
