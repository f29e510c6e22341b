"""Frontend registrations: client indices, pinned output addresses, and INITs held for them.

Theory of operation
-------------------
A frontend registers under a *client index* with the address where engines
push its outputs (and, optionally, an address where it takes requests
itself). Engines learn every frontend's output address from their INIT reply,
by client index, and push each request's outputs to the index the request
carries. Two rules follow.

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

**An output address is pinned once INITs went out.** Engines keep pushing to
the address they learnt; a re-registration that moved it would silently lose
every output for that index. So after the first INIT was sent a client index
keeps its output address; a restarted frontend must bind the same one.

``register_verdict`` decides a registration; the first matching row wins:

=========================================================  ============  =================
condition                                                  verdict       effect
=========================================================  ============  =================
K > 0 and index >= K                                       OUT_OF_RANGE  refused
index not registered, registered >= max(K, max_frontends)  FULL          refused
index registered, other output address, INITs sent         PINNED        refused
index not registered                                       NEW           added
index registered from another connection                   MOVED         replaced; the
                                                                         index's requests
                                                                         now report there
index registered from the same connection                  RENEWED       replaced
=========================================================  ============  =================

A refused registration changes nothing. Frontends never unregister (a
frontend that goes away keeps its index, so its requests' failure notices
still have an address to go to when it comes back).

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
    FULL = "full"
    PINNED = "pinned"


ACCEPTED_VERDICTS = frozenset({RegisterVerdict.NEW, RegisterVerdict.MOVED, RegisterVerdict.RENEWED})


def register_verdict(
    *,
    client_index: int,
    identity: bytes,
    output_address: str,
    previous: FrontendPeer | None,
    registered: int,
    expected: int,
    max_frontends: int,
    inits_sent: bool,
) -> RegisterVerdict:
    """The table in the module docstring, top to bottom."""
    if expected and client_index >= expected:
        return RegisterVerdict.OUT_OF_RANGE
    if previous is None:
        if registered >= max(expected, max_frontends):
            return RegisterVerdict.FULL
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


class FrontendRegistry:
    """Registered frontends by client index, the INIT hold and the address pin."""

    def __init__(self, *, expected: int, max_frontends: int) -> None:
        if expected < 0 or max_frontends < 0:
            raise ValueError("expected and max_frontends must be >= 0")
        self.expected = expected
        self.max_frontends = max_frontends
        self.inits_sent = False
        self._peers: dict[int, FrontendPeer] = {}
        self._held_inits: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, client_index: int) -> FrontendPeer | None:
        return self._peers.get(client_index)

    def peers(self) -> list[FrontendPeer]:
        """Registered frontends by ascending client index."""
        return [self._peers[index] for index in sorted(self._peers)]

    def identities(self) -> list[bytes]:
        """Connections of every registered frontend (for notices to all of them)."""
        return [peer.identity for peer in self._peers.values()]

    def register(
        self,
        client_index: int,
        identity: bytes,
        output_address: str,
        input_address: str | None,
    ) -> Registration:
        """Decide and, unless refused, record a registration."""
        previous = self._peers.get(client_index)
        verdict = register_verdict(
            client_index=client_index, identity=identity, output_address=output_address,
            previous=previous, registered=len(self._peers), expected=self.expected,
            max_frontends=self.max_frontends, inits_sent=self.inits_sent,
        )
        if verdict not in ACCEPTED_VERDICTS:
            return Registration(verdict, previous, self._refusal(verdict, client_index, previous))
        self._peers[client_index] = FrontendPeer(
            identity, client_index, output_address, input_address
        )
        return Registration(verdict, previous)

    def _refusal(
        self, verdict: RegisterVerdict, client_index: int, previous: FrontendPeer | None
    ) -> str:
        if verdict is RegisterVerdict.OUT_OF_RANGE:
            return (f"client_index {client_index} is outside 0..{self.expected - 1} "
                    f"(the coordinator was started with --frontends {self.expected})")
        if verdict is RegisterVerdict.FULL:
            return "too many frontends registered"
        pinned = previous.output_address if previous is not None else "?"
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

    def output_addresses(self) -> list[str]:
        return [peer.output_address for peer in self.peers()]

    def input_addresses(self) -> list[str]:
        return [peer.input_address for peer in self.peers() if peer.input_address]

    # ---- state file ----------------------------------------------------------------------

    def saved(self) -> list[SavedFrontend]:
        return [
            SavedFrontend(peer.client_index, peer.identity.hex(), peer.output_address,
                          peer.input_address)
            for peer in self._peers.values()
        ]

    def restore(self, frontends: list[SavedFrontend], *, inits_sent: bool) -> None:
        for saved in frontends:
            self._peers[saved.client_index] = FrontendPeer(
                bytes.fromhex(saved.identity_hex), saved.client_index, saved.output_address,
                saved.input_address,
            )
        self.inits_sent = inits_sent
