"""``back_output`` (PULL, vLLM C2): ``EngineCoreOutputs`` with stats and wave reports.

The hot path: the decoded ``EngineReport`` is itself the event. The socket is
read in batches by ``coordinator.server.stats_reader``, which decodes each
kept frame with ``decode_frame``; ``decode`` is the one-message form.
"""

from __future__ import annotations

from coordinator.core.events import BadFrame
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError


def decode(frames: list[bytes]) -> vllm.EngineReport | BadFrame:
    if len(frames) != 1:
        return frame_count_error(len(frames))
    return decode_frame(frames[0])


def decode_frame(frame: bytes) -> vllm.EngineReport | BadFrame:
    """One single-frame message."""
    try:
        report = vllm.decode_engine_report(frame)
        vllm.check_coordinator_traffic(report)
    except ProtocolError as exc:
        return BadFrame("back_output", exc, frame_count=1)
    return report


def frame_count_error(count: int) -> BadFrame:
    """A message of ``count`` frames: engines send exactly one."""
    return BadFrame("back_output", ProtocolError(
        f"expected 1 frame, got {count}", reason="frame_count"), frame_count=count)
