"""``back_publish`` upstream (XPUB, vLLM C3): engines' subscriptions, which open the gate."""

from __future__ import annotations

from coordinator.core.events import (
    ENGINE_SUBSCRIBED,
    ENGINE_UNSUBSCRIBED,
    BadFrame,
    EngineSubscribed,
    EngineUnsubscribed,
)
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError


def decode(frames: list[bytes]) -> EngineSubscribed | EngineUnsubscribed | BadFrame:
    if len(frames) != 1:
        return BadFrame("back_publish", ProtocolError(f"got {len(frames)} frames",
                                                      reason="frame_count"),
                        frame_count=len(frames))
    frame = frames[0]
    if frame == vllm.SUBSCRIBE:
        return ENGINE_SUBSCRIBED
    if frame == vllm.UNSUBSCRIBE:
        return ENGINE_UNSUBSCRIBED
    return BadFrame("back_publish", ProtocolError(f"{frame[:32]!r}", reason="unexpected_frame"),
                    frame_count=1)
