"""The one error type raised for bad input from peers.

Everything under `coordinator.protocol` that parses bytes raises `ProtocolError`
(or a subclass) and nothing else, so a caller can tell "a peer sent garbage"
from "we have a bug". `reason` is a short, stable token suitable for a metric
label or a counter key; the message is for humans.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """Input from a peer that does not follow the wire format."""

    reason: str = "bad_input"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class IdentityError(ProtocolError):
    """A ZMQ identity that is not a two-byte little-endian DP rank."""

    reason = "identity_length"


class RankRangeError(ProtocolError):
    """A well-formed rank that lies outside the configured rank range."""

    reason = "rank_out_of_range"

    def __init__(self, rank: int, start: int, count: int) -> None:
        self.rank = rank
        self.start = start
        self.count = count
        if count <= 0:
            valid = "no ranks are configured"
        else:
            valid = f"valid ranks are {start}..{start + count - 1}"
        super().__init__(
            f"dp_rank={rank} is outside this coordinator's range ({valid}); "
            f"start the engine with a rank in that range, or start the coordinator "
            f"with --rank-start/--engines covering it"
        )
