"""Wire formats only: msgspec structs, frame encode/decode, identities. No IO."""

from coordinator.protocol.errors import IdentityError, ProtocolError, RankRangeError
from coordinator.protocol.identity import (
    IDENTITY_LENGTH,
    MAX_RANK,
    check_rank_in_range,
    identity_to_rank,
    rank_to_identity,
)

__all__ = [
    "IDENTITY_LENGTH",
    "MAX_RANK",
    "IdentityError",
    "ProtocolError",
    "RankRangeError",
    "check_rank_in_range",
    "identity_to_rank",
    "rank_to_identity",
]
