"""vLLM 0.33 wire formats, byte-compatible with stock engines and front-ends.

Bytes in, values out, and back; no sockets, no clocks. Everything a peer sends
goes through a `decode_*` function that raises `ProtocolError` and nothing else,
so the server can drop, count and log bad input without ever dying on it.
Values the coordinator acts on are bounded here, at the edge, with
`msgspec.Meta`: ranks fit the two-byte identity, waves fit the `u32` that
vLLM's Rust client uses, counts are non-negative and `kv_cache_usage` is a
finite number in [0, 1]. `bool` is never accepted where an int is expected.

Encodings follow vLLM's own serializer (plain msgspec msgpack):

* array-like structs (`EngineCoreOutputs`) are msgpack arrays in field order,
  every field written; decoders take shorter arrays (missing fields default)
  and longer ones (extras ignored);
* vLLM dataclasses (`SchedulerStats`, `EngineHandshakeMetadata`, the engine's
  ready greeting) are msgpack maps with every key, in field order; decoders
  ignore unknown keys and default missing ones;
* the handshake HELLO/READY messages are plain dicts in vLLM, so their keys
  appear only when set (see `encode_handshake`).

Engine stats are the hot path (one message per engine per scheduler change).
`decode_engine_report` reads them through lean structs that hold only what the
coordinator uses and skip the rest of the map without building objects for it,
which is cheaper than the full decode and keeps working if a future engine
changes a stats field the coordinator never reads. The full
`SchedulerStats`/`EngineCoreOutputs` structs exist so the engine SDK can send
reports byte-identical to vLLM's, and for tools that want every field.

Reason tokens on `ProtocolError`: "decode" (not msgpack, or nested too deep),
"bad_value" (wrong type or out of range), "frame_count", "unexpected_type"
(a request type or message shape this peer must not send), "unknown_status"
(a handshake status other than the ones listed here) and
"not_coordinator_traffic" (token outputs or utility results sent to the
coordinator).
"""

from collections.abc import Iterable, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec
from msgspec import Meta

from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import MAX_RANK, identity_to_rank

__all__ = [
    "ABORT",
    "ADD",
    "ENGINE_CORE_DEAD",
    "MAX_WAVE",
    "READY",
    "REQUEST_TYPES",
    "SCALE_ELASTIC_EP",
    "START_DP_WAVE",
    "STATUS_ACCEPTED",
    "STATUS_ERROR",
    "STATUS_HELLO",
    "STATUS_READY",
    "SUBSCRIBE",
    "UNSUBSCRIBE",
    "UTILITY",
    "EngineCoreOutputs",
    "EngineHandshakeMetadata",
    "EngineReadyResponse",
    "EngineReport",
    "EngineZmqAddresses",
    "FrontPublish",
    "HandshakeAccepted",
    "HandshakeError",
    "HandshakeMessage",
    "HandshakeReply",
    "LegacyFirstRequest",
    "PrefixCacheStats",
    "ScaleElasticEP",
    "SchedulerLoad",
    "SchedulerStats",
    "check_coordinator_traffic",
    "decode_abort",
    "decode_engine_outputs",
    "decode_engine_report",
    "decode_front_publish",
    "decode_front_upstream",
    "decode_handshake",
    "decode_handshake_reply",
    "decode_init",
    "decode_ready_response",
    "decode_start_dp_wave",
    "encode_abort",
    "encode_engine_outputs",
    "encode_front_publish",
    "encode_front_publish_rows",
    "encode_handshake",
    "encode_handshake_accepted",
    "encode_handshake_error",
    "encode_handshake_reply",
    "encode_init",
    "encode_ready_response",
    "encode_scale_elastic_ep",
    "encode_start_dp_wave",
    "finished_request_ids",
]

# --- frame constants -------------------------------------------------------

# First frame of every engine-bound request (vLLM's EngineCoreRequestType).
ADD = b"\x00"
ABORT = b"\x01"
START_DP_WAVE = b"\x02"
UTILITY = b"\x03"
REQUEST_TYPES = frozenset({ADD, ABORT, START_DP_WAVE, UTILITY})

# The startup gate reply on the engine publish socket, and the XPUB upstream
# subscription frames that engines and front-ends send with an empty topic.
READY = b"READY"
SUBSCRIBE = b"\x01"
UNSUBSCRIBE = b"\x00"

# Sent by a dying engine to front-end output sockets only, never to the coordinator.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"

# Handshake status strings. HELLO and READY come from engines; ERROR and
# ACCEPTED are this coordinator's replies (the INIT reply carries no status).
STATUS_HELLO = "HELLO"
STATUS_READY = "READY"
STATUS_ERROR = "ERROR"
STATUS_ACCEPTED = "ACCEPTED"

SCALE_ELASTIC_EP = "SCALE_ELASTIC_EP"

# vLLM's Rust client decodes the wave as u32.
MAX_WAVE = (1 << 32) - 1

# --- bounded value types ---------------------------------------------------

Wave = Annotated[int, Meta(ge=0, le=MAX_WAVE)]
# A completed wave is followed by the next one, which must still fit in u32.
CompletedWave = Annotated[int, Meta(ge=0, le=MAX_WAVE - 1)]
EngineIndex = Annotated[int, Meta(ge=0, le=MAX_RANK)]
Count = Annotated[int, Meta(ge=0)]
# NaN fails both bounds, and +/-inf fails one of them, so this is also "finite".
KvCacheUsage = Annotated[float, Meta(ge=0.0, le=1.0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
EngineId = Annotated[str, Meta(min_length=1, max_length=256)]

BufferLike = bytes | bytearray | memoryview

# --- engine outputs (socket C2: engine PUSH -> coordinator PULL) -----------


class PrefixCacheStats(msgspec.Struct):
    """vLLM 0.33 `PrefixCacheStats`: eight keys, encoded as a map."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[str, int] = {}


class SchedulerStats(msgspec.Struct):
    """vLLM 0.33 `SchedulerStats`: all 18 keys, in vLLM's order, with its defaults.

    Encodes byte-identically to vLLM's dataclass. Nested vLLM types that the
    coordinator never reads (iteration details, spec-decode, cudagraph and perf
    stats, eviction events) are `Any`: whatever was decoded re-encodes as it
    came, and an engine SDK may pass plain dicts or its own structs.
    """

    num_running_reqs: Count = 0
    num_waiting_reqs: Count = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = {}
    step_counter: Count = 0
    current_wave: Wave = 0
    kv_cache_usage: KvCacheUsage = 0.0
    iteration_details: Any = None
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    kv_cache_eviction_events: list[Any] = []
    spec_decoding_stats: Any = None
    kv_connector_stats: dict[str, Any] | None = None
    ec_connector_stats: dict[str, Any] | None = None
    waiting_lora_adapters: dict[str, int] = {}
    running_lora_adapters: dict[str, int] = {}
    cudagraph_stats: Any = None
    perf_stats: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """vLLM 0.33 `EngineCoreOutputs`: a 9-element msgpack array.

    On coordinator traffic `outputs` is empty and `utility_output` is nil
    (see `check_coordinator_traffic`). `timestamp` is the engine's monotonic
    clock; vLLM re-stamps a 0.0 on decode, so leaving it 0.0 is harmless.
    """

    engine_index: EngineIndex = 0
    outputs: list[Any] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: Any = None
    finished_requests: list[str] | None = None
    wave_complete: CompletedWave | None = None
    start_wave: Wave | None = None
    weight_version: str | None = None


class SchedulerLoad(msgspec.Struct, gc=False):
    """The part of `SchedulerStats` the coordinator reads; other keys are skipped."""

    num_running_reqs: Count = 0
    num_waiting_reqs: Count = 0
    step_counter: Count = 0
    current_wave: Wave = 0
    kv_cache_usage: KvCacheUsage = 0.0


class EngineReport(msgspec.Struct, array_like=True, gc=False):
    """`EngineCoreOutputs` as the coordinator reads it.

    Accepts every message `decode_engine_outputs` accepts (positions it never
    reads are `Any`) and yields the same values for the fields it keeps. The
    ninth element, `weight_version`, is not read and so not declared; array
    decoding ignores trailing extras. gc=False: decoded values never refer
    back to the struct, so it cannot be part of a reference cycle.
    """

    engine_index: EngineIndex = 0
    outputs: list[Any] = []
    scheduler_stats: SchedulerLoad | None = None
    timestamp: Any = None
    utility_output: Any = None
    finished_requests: Any = None
    wave_complete: CompletedWave | None = None
    start_wave: Wave | None = None


# --- handshake (socket H1: engine DEALER -> coordinator ROUTER) ------------


class HandshakeMessage(msgspec.Struct, omit_defaults=True):
    """HELLO or READY from an engine.

    vLLM sends `status`, `local` and `headless` always, `parallel_config_hash`
    on READY when dp > 1, and the last three keys on READY with elastic EP.
    `engine_id` and `protocol_version` come only from this project's engine
    SDK. Encode with `encode_handshake`, which always writes the first three
    keys (omit_defaults alone would drop `local: false`).
    """

    status: str
    local: bool = False
    headless: bool = False
    parallel_config_hash: str | None = None
    engine_id: EngineId | None = None
    protocol_version: Annotated[int, Meta(ge=0)] | None = None
    coord_store_port: Port | None = None
    elastic_ep_max_dp_size: Annotated[int, Meta(ge=1)] | None = None
    num_redundant_experts: Annotated[int, Meta(ge=0)] | None = None


class _HandshakeWire(msgspec.Struct, omit_defaults=True):
    # Same fields and order as HandshakeMessage, but the first three have no
    # default, so they are always written, as vLLM's launcher requires them.
    status: str
    local: bool
    headless: bool
    parallel_config_hash: str | None = None
    engine_id: str | None = None
    protocol_version: int | None = None
    coord_store_port: int | None = None
    elastic_ep_max_dp_size: int | None = None
    num_redundant_experts: int | None = None


class EngineZmqAddresses(msgspec.Struct):
    """Where an engine connects; every key is always encoded, as vLLM does."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class EngineHandshakeMetadata(msgspec.Struct):
    """The INIT reply to HELLO. It has no status key: vLLM engines decode it as is."""

    addresses: EngineZmqAddresses
    parallel_config: dict[str, int | str | list[int]]


class HandshakeError(msgspec.Struct, tag_field="status", tag=STATUS_ERROR):
    """Refusal reply: `{"status": "ERROR", "reason": ...}`."""

    reason: str


class HandshakeAccepted(msgspec.Struct, tag_field="status", tag=STATUS_ACCEPTED):
    """Reply to an accepted READY: `{"status": "ACCEPTED"}`.

    Stock vLLM engines close the handshake socket after READY and never read it.
    """


HandshakeReply = EngineHandshakeMetadata | HandshakeError | HandshakeAccepted


class _HandshakeReplyWire(msgspec.Struct):
    # Superset of the three replies, so one decode pass tells them apart.
    status: str | None = None
    reason: str | None = None
    addresses: EngineZmqAddresses | None = None
    parallel_config: dict[str, int | str | list[int]] | None = None


# --- engine greeting (socket F1: first message on each engine input DEALER) --


class EngineReadyResponse(msgspec.Struct):
    """vLLM 0.33 `EngineCoreReadyResponse`: 28 keys in vLLM's order.

    vLLM front-ends decode this with 17 required keys; encoding always writes
    all of them. Defaults (vLLM has none for the first 17) make decoding
    tolerant of missing keys; unknown keys are ignored. `kv_events_config` is
    a nested vLLM config object and is passed through as is.
    """

    max_model_len: int = 0
    num_gpu_blocks: int = 0
    block_size: int = 16
    dp_stats_address: str | None = None
    dtype: str = ""
    vllm_version: str = ""
    world_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_rank: EngineIndex = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    instance_id: str = ""
    supports_lora: bool = False
    max_loras: int = 0
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: Any = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None
    coord_store_port: int = 0
    coordinator_input_address: str | None = None
    coordinator_output_address: str | None = None


# --- front-end plane (socket C1) -------------------------------------------

CountRow = tuple[Count, Count, KvCacheUsage]


class FrontPublish(NamedTuple):
    """`[counts, wave, running]` on the front publish socket.

    `counts` is one `[waiting, running, kv_cache_usage]` row per global rank,
    or None for a wave-only publish. vLLM front-ends unpack exactly three
    elements, so decoding requires exactly three.
    """

    counts: list[CountRow] | None
    wave: Wave
    running: bool


class ScaleElasticEP(msgspec.Struct, frozen=True):
    """`["SCALE_ELASTIC_EP", n]` from a front-end: resize the engine table to n."""

    new_count: int


class LegacyFirstRequest(msgspec.Struct, frozen=True):
    """`[engine_index, wave]` from pre-0.33 front-ends: a request went to a paused group."""

    engine_index: int
    wave: int
    by_identity: bool = False
    """The engine was named by its two identity bytes, as vLLM 0.29 to 0.32 send it
    (older front-ends sent the int index)."""


class GreetingVersion(msgspec.Struct, gc=False):
    """The one key of an engine's ready greeting that says which vLLM it runs."""

    vllm_version: str | None = None


# --- module-level codecs (reused on every call) ----------------------------

_encoder = msgspec.msgpack.Encoder()
_engine_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_engine_report_decoder = msgspec.msgpack.Decoder(EngineReport)
_handshake_decoder = msgspec.msgpack.Decoder(HandshakeMessage)
_init_decoder = msgspec.msgpack.Decoder(EngineHandshakeMetadata)
_handshake_reply_decoder = msgspec.msgpack.Decoder(_HandshakeReplyWire)
_ready_response_decoder = msgspec.msgpack.Decoder(EngineReadyResponse)
_start_wave_decoder = msgspec.msgpack.Decoder(tuple[Wave, EngineIndex | None])
_front_publish_decoder = msgspec.msgpack.Decoder(FrontPublish)
# The head is a command name, an engine index or (older front-ends) an engine
# identity; msgspec cannot union str with bytes, so it is checked by hand.
_front_upstream_decoder = msgspec.msgpack.Decoder(tuple[Any, int])
_abort_decoder = msgspec.msgpack.Decoder(list[str])

_HANDSHAKE_STATUSES = frozenset({STATUS_HELLO, STATUS_READY})


def _decode_failure(exc: BaseException, what: str) -> ProtocolError:
    if isinstance(exc, msgspec.ValidationError):
        return ProtocolError(f"bad {what}: {exc}", reason="bad_value")
    if isinstance(exc, RecursionError):
        return ProtocolError(f"bad {what}: nested too deeply", reason="decode")
    return ProtocolError(f"bad {what}: {exc}", reason="decode")


def _check_wave(wave: int) -> None:
    # Encoders validate their own arguments with plain ValueError: a bad value
    # here is a bug in the caller, not bad input from a peer.
    if type(wave) is not int or not 0 <= wave <= MAX_WAVE:
        raise ValueError(f"wave must be an int in [0, {MAX_WAVE}], got {wave!r}")


def _check_engine_index(index: int) -> None:
    if type(index) is not int or not 0 <= index <= MAX_RANK:
        raise ValueError(f"engine index must be an int in [0, {MAX_RANK}], got {index!r}")


# --- engine outputs --------------------------------------------------------


def decode_engine_outputs(buf: BufferLike) -> EngineCoreOutputs:
    """Decode every field of an `EngineCoreOutputs` frame."""
    try:
        return _engine_outputs_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "EngineCoreOutputs") from None


def decode_engine_report(buf: BufferLike) -> EngineReport:
    """Decode an `EngineCoreOutputs` frame for the coordinator (hot path)."""
    try:
        return _engine_report_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "EngineCoreOutputs") from None


def check_coordinator_traffic(msg: EngineCoreOutputs | EngineReport) -> None:
    """Refuse token outputs or utility results sent to the coordinator.

    vLLM's coordinator dies on these; here they are bad input like any other.
    """
    if msg.outputs:
        raise ProtocolError(
            f"engine {msg.engine_index} sent {len(msg.outputs)} request outputs to the "
            f"coordinator; only stats and wave messages belong there",
            reason="not_coordinator_traffic",
        )
    if msg.utility_output is not None:
        raise ProtocolError(
            f"engine {msg.engine_index} sent a utility result to the coordinator; "
            f"only stats and wave messages belong there",
            reason="not_coordinator_traffic",
        )


def encode_engine_outputs(msg: EngineCoreOutputs) -> bytes:
    """Encode as vLLM's engine output thread does: all nine elements."""
    return _encoder.encode(msg)


# --- handshake -------------------------------------------------------------


def decode_handshake(buf: BufferLike) -> HandshakeMessage:
    """Decode an engine's HELLO or READY; any other status is refused."""
    try:
        msg = _handshake_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "handshake message") from None
    if msg.status not in _HANDSHAKE_STATUSES:
        raise ProtocolError(
            f"handshake status must be HELLO or READY, got {msg.status[:64]!r}",
            reason="unknown_status",
        )
    return msg


def encode_handshake(msg: HandshakeMessage) -> bytes:
    """Encode HELLO/READY exactly as vLLM does.

    `status`, `local` and `headless` always appear, in that order; the other
    keys only when set, so a vLLM-shaped message is byte-identical to vLLM's.
    """
    return _encoder.encode(_HandshakeWire(*msgspec.structs.astuple(msg)))


def encode_init(meta: EngineHandshakeMetadata) -> bytes:
    """Encode the INIT reply to HELLO, byte-identical to vLLM's launcher."""
    return _encoder.encode(meta)


def decode_init(buf: BufferLike) -> EngineHandshakeMetadata:
    """Decode an INIT reply as a vLLM engine does (both keys required)."""
    try:
        return _init_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "handshake init message") from None


def encode_handshake_reply(reply: HandshakeReply) -> bytes:
    """Encode any coordinator reply on the handshake socket."""
    return _encoder.encode(reply)


def encode_handshake_error(reason: str) -> bytes:
    """Encode a refusal: `{"status": "ERROR", "reason": reason}`."""
    return _encoder.encode(HandshakeError(reason))


_ACCEPTED_BYTES = _encoder.encode(HandshakeAccepted())


def encode_handshake_accepted() -> bytes:
    """Encode the reply to an accepted READY: `{"status": "ACCEPTED"}`."""
    return _ACCEPTED_BYTES


def decode_handshake_reply(buf: BufferLike) -> HandshakeReply:
    """Decode what the coordinator sent back: INIT, an ERROR or ACCEPTED."""
    try:
        wire = _handshake_reply_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "handshake reply") from None
    if wire.status is None:
        if wire.addresses is None or wire.parallel_config is None:
            raise ProtocolError(
                "handshake reply has no status and is not an INIT message "
                "(needs 'addresses' and 'parallel_config')",
                reason="unexpected_type",
            )
        return EngineHandshakeMetadata(wire.addresses, wire.parallel_config)
    if wire.status == STATUS_ERROR:
        if wire.reason is None:
            raise ProtocolError("handshake ERROR reply has no reason", reason="bad_value")
        return HandshakeError(wire.reason)
    if wire.status == STATUS_ACCEPTED:
        return HandshakeAccepted()
    raise ProtocolError(
        f"handshake reply status must be ERROR or ACCEPTED, got {wire.status[:64]!r}",
        reason="unknown_status",
    )


# --- engine greeting -------------------------------------------------------


def encode_ready_response(resp: EngineReadyResponse) -> bytes:
    """Encode an engine's greeting with all 28 keys, as vLLM engines do."""
    return _encoder.encode(resp)


def decode_ready_response(buf: BufferLike) -> EngineReadyResponse | None:
    """Decode an engine's greeting; an empty frame (older engines) gives None."""
    if len(buf) == 0:
        return None
    try:
        return _ready_response_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "engine ready response") from None


# --- START_DP_WAVE (socket C3, or any engine input socket) -----------------


def encode_start_dp_wave(wave: int, exclude: int | None) -> list[bytes]:
    """The two frames of a START_DP_WAVE: `b"\\x02"` and `[wave, exclude]`.

    `exclude` is the rank that already runs the wave, or None to wake every engine.
    """
    _check_wave(wave)
    if exclude is not None:
        _check_engine_index(exclude)
    return [START_DP_WAVE, _encoder.encode((wave, exclude))]


def decode_start_dp_wave(frames: Sequence[BufferLike]) -> tuple[int, int | None]:
    """Decode START_DP_WAVE frames into `(wave, exclude)`."""
    if len(frames) != 2:
        raise ProtocolError(f"START_DP_WAVE has 2 frames, got {len(frames)}", reason="frame_count")
    type_frame = bytes(frames[0])
    if type_frame != START_DP_WAVE:
        raise ProtocolError(
            f"expected the START_DP_WAVE type byte {START_DP_WAVE!r}, got {type_frame[:16]!r}",
            reason="unexpected_type",
        )
    try:
        return _start_wave_decoder.decode(frames[1])
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "START_DP_WAVE payload") from None


# --- front-end plane -------------------------------------------------------


def encode_front_publish(
    counts: Iterable[tuple[int, int, float]] | None,
    wave: int,
    running: bool,
    *,
    row_width: int = 3,
) -> bytes:
    """Encode `[counts, wave, running]` for the front publish socket.

    `kv_cache_usage` is always written as a float64, as vLLM writes it.
    `row_width=2` drops it, for front-ends older than the 3-element rows.
    """
    _check_wave(wave)
    rows: list[tuple[int, int, float]] | list[tuple[int, int]] | None
    if counts is None:
        rows = None
    elif row_width == 3:
        rows = [(waiting, running_reqs, float(kv)) for waiting, running_reqs, kv in counts]
    elif row_width == 2:
        rows = [(waiting, running_reqs) for waiting, running_reqs, _ in counts]
    else:
        raise ValueError(f"row_width must be 2 or 3, got {row_width!r}")
    return _encoder.encode((rows, wave, bool(running)))


def encode_front_publish_rows(rows: list[tuple[int, int, float]], wave: int,
                              running: bool) -> bytes:
    """`encode_front_publish` for 3-wide rows whose usage is already a float.

    The same bytes without a pass over the rows; the caller vouches for the
    types (the load table keeps its rows so).
    """
    _check_wave(wave)
    return _encoder.encode((rows, wave, bool(running)))


def decode_front_publish(buf: BufferLike) -> FrontPublish:
    """Decode a 0.33 front publish (3-element count rows)."""
    try:
        return _front_publish_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "front publish") from None


def encode_scale_elastic_ep(new_engine_count: int) -> bytes:
    """Encode a front-end's `["SCALE_ELASTIC_EP", n]` request."""
    if type(new_engine_count) is not int or not 1 <= new_engine_count <= MAX_RANK + 1:
        raise ValueError(
            f"engine count must be an int in [1, {MAX_RANK + 1}], got {new_engine_count!r}"
        )
    return _encoder.encode((SCALE_ELASTIC_EP, new_engine_count))


_greeting_version_decoder = msgspec.msgpack.Decoder(GreetingVersion)
VLLM_VERSION_CHARS = 64


def decode_greeting_version(payload: BufferLike) -> str | None:
    """The ``vllm_version`` an engine's ready greeting names (cut to 64 characters),
    or None: no such key, not a string, or not a readable greeting. Never raises."""
    try:
        version = _greeting_version_decoder.decode(payload).vllm_version
    except (msgspec.DecodeError, RecursionError):
        return None
    return version[:VLLM_VERSION_CHARS] if version else None


def decode_front_upstream(buf: BufferLike) -> ScaleElasticEP | LegacyFirstRequest:
    """Decode a non-subscription message from a front-end on the front publish socket.

    Subscription frames (`SUBSCRIBE`/`UNSUBSCRIBE`) must be filtered out first.
    The legacy form names the engine by index or, in some older front-ends,
    by its two-byte identity.
    """
    try:
        head, value = _front_upstream_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "front-end message") from None
    if isinstance(head, str):
        if head != SCALE_ELASTIC_EP:
            raise ProtocolError(
                f"unknown front-end command {head[:64]!r}", reason="unexpected_type"
            )
        if not 1 <= value <= MAX_RANK + 1:
            raise ProtocolError(
                f"SCALE_ELASTIC_EP engine count must be in [1, {MAX_RANK + 1}], got {value}",
                reason="bad_value",
            )
        return ScaleElasticEP(value)
    if isinstance(head, bytes):
        engine_index = identity_to_rank(head)
    elif type(head) is int:
        engine_index = head
    else:
        raise ProtocolError(
            f"front-end message must start with a command name or an engine index, "
            f"got {type(head).__name__}",
            reason="unexpected_type",
        )
    if not 0 <= engine_index <= MAX_RANK:
        raise ProtocolError(
            f"first-request engine index must be in [0, {MAX_RANK}], got {engine_index}",
            reason="bad_value",
        )
    if not 0 <= value <= MAX_WAVE:
        raise ProtocolError(
            f"first-request wave must be in [0, {MAX_WAVE}], got {value}", reason="bad_value"
        )
    return LegacyFirstRequest(engine_index, value, isinstance(head, bytes))


# --- request payloads on engine input sockets ------------------------------


def decode_abort(buf: BufferLike) -> list[str]:
    """Decode an ABORT payload: the request ids to abort."""
    try:
        return _abort_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_failure(exc, "ABORT payload") from None


def encode_abort(request_ids: Iterable[str]) -> bytes:
    """Encode an ABORT payload (the type byte `ABORT` goes in the frame before)."""
    return _encoder.encode(list(request_ids))


# Position of `finish_reason` in vLLM's array-encoded EngineCoreOutput.
_FINISH_REASON_INDEX = 5


def finished_request_ids(message: EngineCoreOutputs) -> list[str]:
    """Request ids an EngineCoreOutputs reports finished, in order, without repeats."""
    seen: dict[str, None] = {}
    for output in message.outputs:
        if (
            isinstance(output, (list, tuple))
            and len(output) > _FINISH_REASON_INDEX
            and output[_FINISH_REASON_INDEX] is not None
            and isinstance(output[0], str)
        ):
            seen[output[0]] = None
    for request_id in message.finished_requests or ():
        seen[request_id] = None
    return list(seen)
