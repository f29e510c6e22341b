"""Requests on an engine's input sockets (vLLM 0.33's F1 plane), as typed records.

An engine reads requests from a DEALER per `inputs` address of INIT (the
coordinator's `dispatch` socket and any frontend's own) and, for wave starts,
from its XSUB on `coordinator_input`. Every message is `[type, *payload]`:

    type    name            payload frames
    \x00    ADD             one or more, opaque here: vLLM's `EngineCoreRequest` (and
                            one frame per zero-copy tensor), or a `SimRequest`
    \x01    ABORT           one: a msgpack array of request id strings
    \x02    START_DP_WAVE   one: `[wave, exclude_rank or nil]`
    \x03    UTILITY         `[client_index, call_id, method_name, args]`, then one
                            frame per zero-copy tensor in `args`

UTILITY is what vLLM's frontends send for `call_utility`: `client_index` is the
frontend whose output socket gets the `UtilityOutput`, `call_id` is
`uuid1().int >> 64` (an unsigned 64-bit number), and `args` is the call's
positional arguments (a tuple in vLLM, so always a msgpack array). vLLM's
msgpack encoder moves large tensors and arrays out of the first frame into
frames of their own; those stay in the record's `frames`, undecoded.

A lone `READY` frame on the coordinator socket is the start-up gate, sent again
to everyone when a late engine subscribes; it is not a request and parses to
None. Anything else (an unknown type byte, a missing or extra frame, a payload
that does not decode to its shape) raises `ProtocolError`, whose `reason` is one
of "frame_count", "unexpected_type", "decode" or "bad_value". A vLLM engine's
input thread dies on such a message; a reader built on this module drops it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final

import msgspec

from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.frontend import MAX_CLIENT_INDEX
from coordinator.protocol.vllm import (
    ABORT,
    ADD,
    READY,
    START_DP_WAVE,
    UTILITY,
    BufferLike,
    decode_abort,
    decode_start_dp_wave,
)

__all__ = [
    "MAX_UTILITY_CALL_ID",
    "AbortRequests",
    "AddRequest",
    "InboundRequest",
    "StartDpWave",
    "UtilityCall",
    "encode_utility",
    "parse_engine_input",
]

#: vLLM's call ids are the top 64 bits of a UUID1.
MAX_UTILITY_CALL_ID: Final = 2**64 - 1

UtilityClientIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_CLIENT_INDEX)]
# msgpack integers end at 2**64 - 1, so `ge=0` bounds a decoded call id both ways.
UtilityCallId = Annotated[int, msgspec.Meta(ge=0)]
UtilityPayload = tuple[UtilityClientIndex, UtilityCallId, str, list[Any]]

_encoder = msgspec.msgpack.Encoder()
_utility_decoder = msgspec.msgpack.Decoder(UtilityPayload)


@dataclass(frozen=True)
class StartDpWave:
    """START_DP_WAVE: wave `wave` has started; `exclude` is the rank that started it."""

    TYPE: ClassVar[bytes] = START_DP_WAVE
    wave: int
    exclude: int | None
    source: int
    """Which input the message came in on (the reader's own numbering)."""
    frames: tuple[bytes, ...]
    """The payload frames as received (everything after the type frame)."""


@dataclass(frozen=True)
class AddRequest:
    """ADD: a request; its payload frames are opaque here."""

    TYPE: ClassVar[bytes] = ADD
    source: int
    frames: tuple[bytes, ...]


@dataclass(frozen=True)
class AbortRequests:
    """ABORT: request ids to drop."""

    TYPE: ClassVar[bytes] = ABORT
    request_ids: list[str]
    source: int
    frames: tuple[bytes, ...]


@dataclass(frozen=True)
class UtilityCall:
    """UTILITY: `[client_index, call_id, method_name, args]` from a frontend."""

    TYPE: ClassVar[bytes] = UTILITY
    client_index: int
    call_id: int
    method: str
    args: list[Any]
    source: int
    frames: tuple[bytes, ...]
    """The payload frames: the call itself, then any zero-copy tensor frames."""


InboundRequest = StartDpWave | AddRequest | AbortRequests | UtilityCall


def encode_utility(client_index: int, call_id: int, method: str,
                   args: Sequence[Any] = ()) -> list[bytes]:
    """The frames of a UTILITY request: `b"\\x03"` and `[client_index, call_id, method, args]`."""
    if type(client_index) is not int or not 0 <= client_index <= MAX_CLIENT_INDEX:
        raise ValueError(
            f"client_index must be an int in [0, {MAX_CLIENT_INDEX}], got {client_index!r}"
        )
    if type(call_id) is not int or not 0 <= call_id <= MAX_UTILITY_CALL_ID:
        raise ValueError(
            f"call_id must be an int in [0, {MAX_UTILITY_CALL_ID}], got {call_id!r}"
        )
    if not isinstance(method, str):
        raise ValueError(f"method must be a string, got {method!r}")
    return [UTILITY, _encoder.encode((client_index, call_id, method, list(args)))]


def _decode_utility(payload: BufferLike) -> UtilityPayload:
    try:
        return _utility_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad UTILITY payload: {exc}", reason="bad_value") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable UTILITY payload: {exc}", reason="decode") from None


def parse_engine_input(frames: Sequence[bytes], source: int) -> InboundRequest | None:
    """Turn one multipart message from an engine input socket into a request record.

    Returns None for a `READY` frame (nothing to do); raises ProtocolError for
    anything malformed or of unknown type. `source` is copied into the record.
    """
    if not frames:
        raise ProtocolError("empty message", reason="frame_count")
    type_byte = frames[0]
    payload = tuple(frames[1:])
    if type_byte == READY:
        return None
    if type_byte == START_DP_WAVE:
        wave, exclude = decode_start_dp_wave(frames)
        return StartDpWave(wave=wave, exclude=exclude, source=source, frames=payload)
    if type_byte == ADD:
        if not payload:
            raise ProtocolError("ADD without a payload frame", reason="frame_count")
        return AddRequest(source=source, frames=payload)
    if type_byte == ABORT:
        if len(payload) != 1:
            raise ProtocolError("ABORT needs exactly one payload frame", reason="frame_count")
        return AbortRequests(request_ids=decode_abort(payload[0]), source=source, frames=payload)
    if type_byte == UTILITY:
        if not payload:
            raise ProtocolError("UTILITY without a payload frame", reason="frame_count")
        client_index, call_id, method, args = _decode_utility(payload[0])
        return UtilityCall(
            client_index=client_index,
            call_id=call_id,
            method=method,
            args=args,
            source=source,
            frames=payload,
        )
    raise ProtocolError(f"unknown request type byte {type_byte[:8]!r}", reason="unexpected_type")
