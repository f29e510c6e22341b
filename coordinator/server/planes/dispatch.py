"""``dispatch`` (ROUTER, vLLM F1): engines speak here only to greet (their ready response).

``conn`` is the connection the greeting came on (``server.connections``): the
rank's identity there belongs to it.
"""

from __future__ import annotations

from coordinator.core.events import BadFrame, EngineGreeted
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import identity_to_rank


def decode(frames: list[bytes], conn: int = 0) -> EngineGreeted | BadFrame:
    if len(frames) < 2:
        return BadFrame("dispatch", ProtocolError(f"got {len(frames)} frames",
                                                  reason="frame_count"), frame_count=len(frames))
    try:
        rank = identity_to_rank(frames[0])
    except ProtocolError as exc:
        return BadFrame("dispatch", exc, frame_count=len(frames))
    # The greeting's content is not needed: that the rank spoke on dispatch is the news.
    return EngineGreeted(rank, conn)
