"""``handshake`` (ROUTER, vLLM H1): ``[identity, HELLO or READY]`` from engines.

``conn`` is the connection the message came on (``server.connections``).
"""

from __future__ import annotations

from coordinator.core.events import BadFrame, HandshakeReceived
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import identity_to_rank


def decode(frames: list[bytes], conn: int = 0) -> HandshakeReceived | BadFrame:
    count = len(frames)
    if count != 2:
        error = ProtocolError(f"expected [identity, payload], got {count} frames",
                              reason="frame_count")
        return BadFrame("handshake", error, identity=frames[0] if frames else None,
                        frame_count=count)
    identity, payload = frames
    try:
        rank = identity_to_rank(identity)
    except ProtocolError as exc:
        return BadFrame("handshake", exc, identity=identity, frame_count=count)
    try:
        message = vllm.decode_handshake(payload)
    except ProtocolError as exc:
        return BadFrame("handshake", exc, identity=identity, rank=rank, frame_count=count)
    return HandshakeReceived(identity, rank, message, conn)
