"""``back_output`` (PULL, vLLM C2): ``EngineCoreOutputs`` with stats and wave reports.

The hot path: the decoded ``EngineReport`` is itself the event.
"""

from __future__ import annotations

from coordinator.core.events import BadFrame
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError


def decode(frames: list[bytes]) -> vllm.EngineReport | BadFrame:
    if len(frames) != 1:
        return BadFrame("back_output", ProtocolError(
            f"expected 1 frame, got {len(frames)}", reason="frame_count"), frame_count=len(frames))
    try:
        report = vllm.decode_engine_report(frames[0])
        vllm.check_coordinator_traffic(report)
    except ProtocolError as exc:
        return BadFrame("back_output", exc, frame_count=1)
    return report
