"""A message past its socket's size bound, as the event the core counts and answers.

The reader (``server.transport.FrameReader``) keeps only the frames read before
the bound was passed; on a ROUTER those start with the peer's identity, and on
``frontend`` the header follows, so the refusal can name its call.
"""

from __future__ import annotations

from coordinator.core.actions import SocketName
from coordinator.core.events import BadFrame
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import identity_to_rank

ROUTER_SOCKETS = frozenset({"handshake", "dispatch", "frontend", "admin"})


def oversize_event(socket: SocketName, kept: list[bytes], total: int, frame_count: int,
                   limit: int) -> BadFrame:
    """The ``BadFrame`` (reason ``too_large``) for a message of ``total`` bytes."""
    error = ProtocolError(f"a message of {frame_count} frames and {total} bytes "
                          f"is larger than this socket's bound of {limit} bytes",
                          reason="too_large")
    if socket not in ROUTER_SOCKETS or not kept:
        return BadFrame(socket, error, frame_count=frame_count)
    identity = kept[0]
    if socket in ("frontend", "admin"):
        call_id = fp.salvage_call_id(kept[1]) if len(kept) > 1 else 0
        return BadFrame(socket, error, identity=identity, frame_count=frame_count,
                        call_id=call_id)
    if socket == "handshake":
        try:
            rank: int | None = identity_to_rank(identity)
        except ProtocolError:
            rank = None
        return BadFrame(socket, error, identity=identity, rank=rank, frame_count=frame_count)
    return BadFrame(socket, error, identity=identity, frame_count=frame_count)
