"""Engine identities: a DP rank as exactly two little-endian bytes.

vLLM engines set their DEALER identity to `rank.to_bytes(2, "little")` on the
handshake and input sockets, so the identity *is* the rank. Anything of another
length cannot be a vLLM-compatible engine and is refused with the message users
already search for.
"""

from __future__ import annotations

from coordinator.protocol.errors import IdentityError, RankRangeError

IDENTITY_LENGTH = 2
MAX_RANK = (1 << (8 * IDENTITY_LENGTH)) - 1


def rank_to_identity(rank: int) -> bytes:
    """The ZMQ identity of the engine with this global DP rank."""
    if not 0 <= rank <= MAX_RANK:
        raise RankRangeError(rank, 0, MAX_RANK + 1)
    return rank.to_bytes(IDENTITY_LENGTH, "little")


def identity_to_rank(identity: bytes) -> int:
    """The DP rank named by a ZMQ identity; refuses anything but two bytes."""
    if len(identity) != IDENTITY_LENGTH:
        raise IdentityError(
            f"coordinator requires a Python-compatible two-byte engine id, got {identity!r}"
        )
    return int.from_bytes(identity, "little")


def check_rank_in_range(rank: int, start: int, count: int) -> int:
    """Return `rank` if it lies in `[start, start + count)`, else raise RankRangeError."""
    if not start <= rank < start + count:
        raise RankRangeError(rank, start, count)
    return rank
