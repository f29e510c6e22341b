"""``front_publish`` upstream (XPUB, vLLM C1): subscriptions, SCALE_ELASTIC_EP, legacy wakes."""

from __future__ import annotations

from coordinator.core.events import (
    FRONTEND_SUBSCRIBED,
    FRONTEND_UNSUBSCRIBED,
    BadFrame,
    FrontendSubscribed,
    FrontendUnsubscribed,
)
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError

FrontUpstream = (
    FrontendSubscribed
    | FrontendUnsubscribed
    | vllm.ScaleElasticEP
    | vllm.LegacyFirstRequest
    | BadFrame
)


def decode(frames: list[bytes]) -> FrontUpstream:
    if len(frames) != 1:
        return BadFrame("front_publish", ProtocolError(f"got {len(frames)} frames",
                                                       reason="frame_count"),
                        frame_count=len(frames))
    frame = frames[0]
    # A subscription frame is its flag byte and any topic.
    if frame[:1] == vllm.SUBSCRIBE:
        return FRONTEND_SUBSCRIBED
    if frame[:1] == vllm.UNSUBSCRIBE:
        return FRONTEND_UNSUBSCRIBED
    try:
        return vllm.decode_front_upstream(frame)
    except ProtocolError as exc:
        return BadFrame("front_publish", exc, frame_count=1)
