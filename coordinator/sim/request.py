"""The ADD payload a simulated engine runs: one frame holding a `SimRequest`."""

from __future__ import annotations

from typing import Annotated

import msgspec

from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.frontend import MAX_CLIENT_INDEX
from coordinator.protocol.vllm import MAX_WAVE

__all__ = ["SimRequest", "decode_sim_request", "encode_sim_request"]


class SimRequest(msgspec.Struct, array_like=True, frozen=True):
    """The ADD payload a simulated engine understands."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    client_index: Annotated[int, msgspec.Meta(ge=0, le=MAX_CLIENT_INDEX)]
    current_wave: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAVE)]
    decode_steps: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
    #: Sender's `time.monotonic_ns()` at submission, for latency measurement.
    submitted_ns: int | None = None


_sim_request_encoder = msgspec.msgpack.Encoder()
_sim_request_decoder = msgspec.msgpack.Decoder(SimRequest)


def encode_sim_request(request: SimRequest) -> bytes:
    return _sim_request_encoder.encode(request)


def decode_sim_request(buf: bytes) -> SimRequest:
    """Decode an ADD payload frame; raises ProtocolError on anything else."""
    try:
        return _sim_request_decoder.decode(buf)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad SimRequest: {exc}", reason="bad_value") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable SimRequest: {exc}", reason="decode") from exc
