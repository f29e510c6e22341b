"""Submit admission and the ledger of requests in flight.

Theory of operation
-------------------
The coordinator routes each submitted request to one rank and remembers where
it went until the frontend says it finished (``finished``) or aborts it. That
routing entry is what lets an abort reach the right engine, what tells a
frontend which of its requests died with a rank, and what says when a
draining rank has nothing left. Token outputs never pass through here.

A submit is admitted by the checks below, in order; the first that applies
refuses it with its error code, and a refused submit changes nothing:

====  ===============================================  ======================
step  refused when                                     code
====  ===============================================  ======================
1     the coordinator is shutting down                 ``shutting_down``
2     the request id is already in flight              ``duplicate_request_id``
3     ``max_in_flight`` requests are in flight         ``too_many_in_flight``
4     an explicit ``dp_rank`` is outside the range     ``unknown_rank``
5     an explicit ``dp_rank`` is not dispatchable      ``rank_not_ready``
6     no rank is dispatchable (no explicit rank)       ``no_ready_engine``
7     no dispatchable rank can deliver the frontend's  ``undeliverable``
      outputs (its INIT did not carry the frontend)
8     the ADD could not be handed to any candidate     ``engine_unreachable``
====  ===============================================  ======================

Steps 1 to 3 are ``RequestLedger.refusal``; 4 and 5 ``explicit_rank_refusal``;
7 ``undeliverable_refusal`` (see ``frontends.registry``: a rank only delivers
outputs to the frontends its INIT named, so a request sent anywhere else would
be lost without a word); 6 and 8 follow from the balancer and from the send (``dispatch_refusal``):
when the ADD to the chosen rank cannot be sent (its connection is gone, e.g.
an engine restarting), the next best rank is tried, until one takes it or all
were tried. An explicit ``dp_rank`` is never moved to another rank.

The ledger's entries change only here:

* ``add`` when a submit is dispatched (and ``forget`` again at once if its ADD
  turns out to be unsendable, before anything else happens);
* ``forget`` on ``finished`` and ``abort``: when a rank's last entry goes and
  the rank is draining, every frontend is told it drained;
* ``take_rank`` when the rank died or was replaced: its requests are reported
  failed, each to the frontend connection that submitted it;
* ``move_frontend`` when a frontend re-registers its index from a new
  connection: failure notices follow it there;
* ``take_frontend`` when a frontend's registration expired: nobody is left to
  say its requests finished, so their entries go (the engines still run them).

No IO: the caller sends replies and notices.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.frontends.registry import inits_went_to
from coordinator.protocol import frontend as fp


@dataclass(frozen=True)
class Refusal:
    """Why a submit was not admitted: an error code of the frontend protocol and a text."""

    code: str
    message: str


SHUTTING_DOWN = Refusal(fp.ERR_SHUTTING_DOWN, "the coordinator is shutting down")
STOPPING = Refusal(fp.ERR_SHUTTING_DOWN, "the coordinator is stopping (a graceful stop): "
                   "it takes no new requests while those in flight finish; send this one "
                   "elsewhere or again once it is back")
NO_READY_ENGINE = Refusal(fp.ERR_NO_READY_ENGINE, "no engine is ready to take requests")


@dataclass(slots=True)
class InFlight:
    """Where one request went, and which frontend connection submitted it."""

    rank: int
    frontend: bytes


def explicit_rank_refusal(
    rank: int, *, in_range: bool, state: str, rank_start: int, rank_count: int
) -> Refusal:
    """Steps 4 and 5: why a submit naming a rank that is not dispatchable cannot go there;
    ``state`` describes the rank."""
    if not in_range:
        last = rank_start + rank_count - 1
        return Refusal(fp.ERR_UNKNOWN_RANK, f"dp_rank={rank} is outside {rank_start}..{last}")
    return Refusal(fp.ERR_RANK_NOT_READY, f"dp_rank={rank} cannot take requests ({state})")


def undeliverable_refusal(blind: list[int]) -> Refusal:
    """Step 7: every rank that could take the request has no output address for the
    frontend (``blind``, sorted): its INIT went out before the frontend registered."""
    return Refusal(fp.ERR_UNDELIVERABLE, (
        f"no engine can deliver outputs to this frontend: it registered after "
        f"{inits_went_to(blind)}, which did not carry its output address, so their outputs "
        f"would be lost. Start the coordinator with --frontends N (INITs then wait for "
        f"every frontend), or restart those engines (a new INIT carries this frontend)"))


def dispatch_refusal(tried: tuple[int, ...], *, explicit: bool) -> Refusal:
    """Step 8: no candidate took the ADD (``tried`` in the order they were tried)."""
    if explicit:
        return Refusal(fp.ERR_ENGINE_UNREACHABLE,
                       f"dp_rank={tried[0]} is not connected on dispatch")
    return Refusal(fp.ERR_ENGINE_UNREACHABLE,
                   f"no ready engine is connected on dispatch (tried dp_rank {list(tried)})")


class RequestLedger:
    """Requests in flight by id, with a count per rank."""

    def __init__(self, *, max_in_flight: int) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._entries: dict[str, InFlight] = {}
        self._per_rank: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> InFlight | None:
        return self._entries.get(request_id)

    def count(self, rank: int) -> int:
        """Requests in flight on ``rank``."""
        return self._per_rank.get(rank, 0)

    def per_rank(self) -> dict[int, int]:
        """A copy of the counts per rank (ranks with nothing in flight left out)."""
        return dict(self._per_rank)

    def refusal(self, request_id: str, *, shutting_down: bool) -> Refusal | None:
        """Steps 1 to 3 of admission."""
        if shutting_down:
            return SHUTTING_DOWN
        if request_id in self._entries:
            return Refusal(fp.ERR_DUPLICATE_REQUEST,
                           f"request {request_id!r} is already in flight")
        if len(self._entries) >= self.max_in_flight:
            return Refusal(fp.ERR_TOO_MANY_IN_FLIGHT,
                           f"{len(self._entries)} requests in flight (frontends must send "
                           "'finished' for completed requests)")
        return None

    def add(self, request_id: str, rank: int, frontend: bytes) -> None:
        self._entries[request_id] = InFlight(rank, frontend)
        self._per_rank[rank] = self._per_rank.get(rank, 0) + 1

    def forget(self, request_id: str) -> InFlight | None:
        """Drop one entry; None if it was not in flight. Check ``count(rank)`` for drains."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            left = self._per_rank[entry.rank] - 1
            if left:
                self._per_rank[entry.rank] = left
            else:
                del self._per_rank[entry.rank]
        return entry

    def take_rank(self, rank: int) -> dict[bytes, list[str]]:
        """Drop every request on ``rank``; returns them by submitting frontend connection."""
        if rank not in self._per_rank:
            return {}
        taken: dict[bytes, list[str]] = {}
        for request_id, entry in list(self._entries.items()):
            if entry.rank == rank:
                taken.setdefault(entry.frontend, []).append(request_id)
                del self._entries[request_id]
        del self._per_rank[rank]
        return taken

    def take_frontend(self, frontend: bytes) -> list[InFlight]:
        """Drop every request submitted from connection ``frontend`` (its registration
        expired: nobody will say they finished); returns them."""
        taken = [(request_id, entry) for request_id, entry in self._entries.items()
                 if entry.frontend == frontend]
        for request_id, _ in taken:
            self.forget(request_id)
        return [entry for _, entry in taken]

    def move_frontend(self, old: bytes, new: bytes) -> int:
        """Failure notices for ``old``'s requests go to ``new`` from now on; returns how many."""
        moved = 0
        for entry in self._entries.values():
            if entry.frontend == old:
                entry.frontend = new
                moved += 1
        return moved
