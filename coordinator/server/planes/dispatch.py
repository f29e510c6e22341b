"""``dispatch`` (ROUTER, vLLM F1): engines speak here only to greet (their ready response).

``conn`` is the connection the greeting came on (``server.connections``): the
rank's identity there belongs to it. A vLLM 0.33 greeting
(``EngineCoreReadyResponse``) also carries the engine's block size and its KV
event publisher's settings, and the connection says which host the engine is
on (``peer``, for tcp). A greeting that says nothing readable is still a
greeting.
"""

from __future__ import annotations

from coordinator.core.events import BadFrame, EngineGreeted
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import identity_to_rank
from coordinator.protocol.kv_events import decode_greeting_kv


def decode(frames: list[bytes], conn: int = 0,
           peer: str | None = None) -> EngineGreeted | BadFrame:
    if len(frames) < 2:
        return BadFrame("dispatch", ProtocolError(f"got {len(frames)} frames",
                                                  reason="frame_count"), frame_count=len(frames))
    try:
        rank = identity_to_rank(frames[0])
    except ProtocolError as exc:
        return BadFrame("dispatch", exc, frame_count=len(frames))
    version = vllm.decode_greeting_version(frames[1]) if len(frames) == 2 else None
    try:
        kv = decode_greeting_kv(frames[1]) if len(frames) == 2 else None
    except ProtocolError:
        return EngineGreeted(rank, conn, None, peer, kv_unreadable=True, vllm_version=version)
    return EngineGreeted(rank, conn, kv, peer, vllm_version=version)
