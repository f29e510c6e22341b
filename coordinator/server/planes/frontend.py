"""``frontend`` (ROUTER, this project's protocol): ``[identity, header, *payload]``.

The operators' ``admin`` socket speaks the same protocol; its messages carry the
channel they came in on, and a frontend's carry its CURVE key when it has one,
so that the core can judge who may change membership (``core.authority``).
"""

from __future__ import annotations

from coordinator.core.events import BadFrame, FrontendRequestReceived
from coordinator.core.ranks.authority import Channel
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError


def decode(frames: list[bytes], channel: Channel = "frontend",
           user_id: str | None = None) -> FrontendRequestReceived | BadFrame:
    count = len(frames)
    if count < 2:
        return BadFrame(channel, ProtocolError(f"got {count} frames", reason="frame_count"),
                        identity=frames[0] if frames else None, frame_count=count)
    identity = frames[0]
    try:
        message, payload = fp.decode_request(frames[1:])
    except ProtocolError as exc:
        # The call id, when readable, lets the frontend match the error to its call.
        return BadFrame(channel, exc, identity=identity, frame_count=count,
                        call_id=fp.salvage_call_id(frames[1]))
    return FrontendRequestReceived(identity, message, payload, channel, user_id)
