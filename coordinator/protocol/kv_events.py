"""vLLM 0.33 KV cache events: the publisher's frames, its batches, replay and endpoints.

A vLLM engine started with ``--kv-events-config`` publishes what its prefix
cache holds. Each DP rank runs its own publisher; this module is the wire
format of one publisher, bytes in and values out (and back, for the simulated
engines). No sockets, no clocks.

Live stream (publisher PUB, subscriber SUB)
    Three frames per message: ``[topic, seq, payload]``. ``topic`` is the
    configured topic (empty by default), ``seq`` the batch number as 8 bytes
    big-endian, counting from 0 per publisher process (so a restarted engine
    starts again at 0), and ``payload`` one msgpack ``KVEventBatch``.

Batch
    ``[ts, events, data_parallel_rank]``: an array. ``events`` is a list of
    maps, each tagged by its ``"type"`` key: ``BlockStored``, ``BlockRemoved``
    or ``AllBlocksCleared``. Fields a publisher leaves at their default are
    left out of the map; the first seven fields of ``BlockStored`` and the
    first two of ``BlockRemoved`` have no default and are always present.
    Block hashes are ``bytes`` (vLLM's default sha256 hashes) or ``int`` (with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); both decode here. They are
    seeded per process unless ``PYTHONHASHSEED`` is set, so a consumer may use
    them only to link a block to its parent and to apply removals.

Replay (publisher ROUTER, subscriber DEALER)
    The subscriber sends ``[b"", start_seq]`` (8 bytes big-endian). The
    publisher answers with ``[b"", topic, seq, payload]`` for every batch it
    still buffers with ``seq >= start_seq`` (it keeps the last
    ``buffer_steps``), then the end marker ``[b"", b"", END_SEQ, b""]`` with
    ``END_SEQ`` = -1 as 8 signed bytes (all ones). A batch that fell out of the
    buffer is simply not sent: the first replayed ``seq`` says what was lost.

What decoding tolerates, and what it refuses
    Unknown keys in an event map are ignored, so a newer engine that adds a
    field does not break decoding. An event whose ``"type"`` is not one of
    the three known tags is skipped and counted (``unknown_events``), and the
    rest of the batch decodes normally. An event with a known tag but a
    missing or mistyped field, a non-map event, or a batch that is not the
    array above is bad input: the whole batch is refused with
    ``ProtocolError``, since applying part of a batch from a publisher that
    speaks another format would leave the index silently wrong. The caller
    treats a refused batch like a lost one.

Endpoints (``offset_endpoint``, ``subscription_for``)
    Every rank's publisher takes the same configured endpoint and offsets it
    by its DP rank exactly as vLLM does: for rank 0 nothing changes; ``inproc``
    endpoints get a ``_dp<rank>`` suffix; ``tcp`` endpoints get ``rank`` added
    to the port unless the port is 0 (the OS picks one). Any other endpoint
    is refused for ranks above 0. The publisher binds when the endpoint has a
    wildcard host (``*``, or contains ``::``) or is ``ipc``/``inproc``, and
    connects otherwise; the replay endpoint is always bound. A subscriber
    connects where the publisher binds (with a wildcard host replaced by the
    host the rank's engine connected from, or loopback), and binds where the
    publisher connects.

The engine's greeting (``decode_greeting_kv``)
    A vLLM 0.33 engine's first message on each of its input sockets (its
    ``EngineCoreReadyResponse``, a msgpack map) carries ``block_size`` and,
    when it publishes events, ``kv_events_config``: the publisher's resolved
    settings, with ``endpoint`` and ``replay_endpoint`` already offset for
    its rank (and a ``tcp://*:0`` endpoint already turned into the node's
    address and the port it got). Only those keys are read here.

Reason tokens on ``ProtocolError``: "decode", "bad_value", "frame_count" and
"unexpected_type" (a non-map event, a replay reply without its delimiter).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Annotated, Any, NamedTuple, TypeAlias

import msgspec
from msgspec import Meta

from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import MAX_RANK

__all__ = [
    "END_SEQ",
    "KV_EVENT_TAGS",
    "MAX_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedKVBatch",
    "GreetingKV",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventMessage",
    "KVSubscription",
    "PublisherSettings",
    "ReplayBatch",
    "ReplayEnd",
    "decode_greeting_kv",
    "decode_kv_batch",
    "decode_kv_frames",
    "decode_replay_frames",
    "decode_replay_request",
    "decode_seq",
    "encode_kv_batch",
    "encode_kv_frames",
    "encode_replay_batch",
    "encode_replay_end",
    "encode_replay_request",
    "encode_seq",
    "offset_endpoint",
    "publisher_binds",
    "subscription_for",
]

SEQ_BYTES = 8
# -1 as 8 signed big-endian bytes: the replay end marker's sequence frame.
END_SEQ = b"\xff" * SEQ_BYTES
# Every real sequence number is below the end marker's unsigned value.
MAX_SEQ = (1 << 64) - 2

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

# --- bounded value types ---------------------------------------------------

# vLLM's sha256 block hashes are 32 bytes; leave room for longer digests.
MAX_BLOCK_HASH_BYTES = 64
BlockHash: TypeAlias = Annotated[bytes, Meta(max_length=MAX_BLOCK_HASH_BYTES)] | int
# Token ids index a vocabulary; every real vocabulary fits in 32 bits.
MAX_TOKEN_ID = (1 << 32) - 1
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
GroupIndex = Annotated[int, Meta(ge=0, le=1 << 16)]
DpRank = Annotated[int, Meta(ge=0, le=MAX_RANK)]


# --- events ------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three event kinds: a map tagged by its ``"type"`` key (the class name)."""


class BlockStored(KVCacheEvent):
    """Blocks that entered the publisher's prefix cache, in chain order.

    ``token_ids`` holds the tokens of all ``block_hashes`` back to back,
    ``block_size`` tokens each (groups that skip blocks, such as sliding
    windows, may publish fewer hashes than the tokens cover).
    ``parent_block_hash`` names the block before the first one, or None at
    the start of a sequence. ``extra_keys`` has one entry per block (None for
    a block without any): the LoRA name when ``lora_name`` is set, then
    ``[mm_identifier, offset]`` pairs, then the cache salt (first block only),
    then prompt-embedding digests. The last eight fields are metadata this
    project does not need for routing but decodes, so encoding is lossless.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: BlockSize
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: GroupIndex | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[TokenId]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks that left the publisher's prefix cache (evicted or overwritten)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: GroupIndex | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher's whole prefix cache was reset."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
KV_EVENT_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]``: one publish of one rank's events.

    ``ts`` is the publisher's wall clock (seconds); the coordinator never
    compares it with its own clock. vLLM's publisher always fills
    ``data_parallel_rank`` with its rank.
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: DpRank | None = None


class DecodedKVBatch(NamedTuple):
    """A decoded batch and how many events with unknown tags were skipped in it."""

    batch: KVEventBatch
    unknown_events: int


class KVEventMessage(NamedTuple):
    """One live-stream message: ``[topic, seq, payload]`` decoded."""

    topic: bytes
    seq: int
    batch: KVEventBatch
    unknown_events: int


class ReplayBatch(NamedTuple):
    """One replayed batch: ``[b"", topic, seq, payload]`` decoded."""

    topic: bytes
    seq: int
    batch: KVEventBatch
    unknown_events: int


class ReplayEnd(NamedTuple):
    """The replay end marker ``[b"", b"", END_SEQ, b""]``: nothing more for this request."""


# --- codecs ------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class _LooseBatch(msgspec.Struct, array_like=True, gc=False):
    # The batch with its events left undecoded, so each one can be looked at alone.
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: DpRank | None = None


class _EventTag(msgspec.Struct, gc=False):
    # Only the tag of an event map; every other key is skipped.
    type: str


_loose_batch_decoder = msgspec.msgpack.Decoder(_LooseBatch)
_event_decoder: msgspec.msgpack.Decoder[KVEvent] = msgspec.msgpack.Decoder(KVEvent)
_event_tag_decoder = msgspec.msgpack.Decoder(_EventTag)

BufferLike = bytes | bytearray | memoryview


def _failure(exc: BaseException, what: str) -> ProtocolError:
    if isinstance(exc, msgspec.ValidationError):
        return ProtocolError(f"bad {what}: {exc}", reason="bad_value")
    if isinstance(exc, RecursionError):
        return ProtocolError(f"bad {what}: nested too deeply", reason="decode")
    return ProtocolError(f"bad {what}: not msgpack ({exc})", reason="decode")


def decode_kv_batch(payload: BufferLike) -> DecodedKVBatch:
    """Decode one ``KVEventBatch`` payload, skipping (and counting) unknown event tags.

    The common case is one typed pass. Only a batch that fails it is looked
    at event by event, to tell an unknown tag (skipped) from bad input
    (``ProtocolError``).
    """
    try:
        return DecodedKVBatch(_batch_decoder.decode(payload), 0)
    except msgspec.ValidationError:
        pass
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _failure(exc, "KV event batch") from None
    try:
        loose = _loose_batch_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _failure(exc, "KV event batch") from None
    events: list[KVEvent] = []
    unknown = 0
    for index, raw in enumerate(loose.events):
        try:
            events.append(_event_decoder.decode(raw))
            continue
        except msgspec.ValidationError as exc:
            problem: BaseException = exc
        except (msgspec.DecodeError, RecursionError) as exc:  # pragma: no cover
            # Unreachable: the loose pass already checked each event's msgpack.
            raise _failure(exc, f"KV event {index}") from None
        try:
            tag = _event_tag_decoder.decode(raw).type
        except msgspec.ValidationError:
            raise ProtocolError(
                f"bad KV event {index}: expected a map with a 'type' string ({problem})",
                reason="unexpected_type",
            ) from None
        except (msgspec.DecodeError, RecursionError) as exc:  # pragma: no cover - decoded above
            raise _failure(exc, f"KV event {index}") from None
        if tag in KV_EVENT_TAGS:
            raise _failure(problem, f"KV event {index} ({tag})")
        unknown += 1
    return DecodedKVBatch(KVEventBatch(loose.ts, events, loose.data_parallel_rank), unknown)


def encode_kv_batch(batch: KVEventBatch) -> bytes:
    """Encode a batch byte-identically to vLLM's publisher."""
    return _encoder.encode(batch)


def encode_seq(seq: int) -> bytes:
    """A sequence number as the 8 big-endian bytes of the ``seq`` frame."""
    if type(seq) is not int or not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"sequence number must be an int in [0, {MAX_SEQ}], got {seq!r}")
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: BufferLike) -> int:
    """The ``seq`` frame of a batch: exactly 8 bytes, never the end marker."""
    data = bytes(frame)
    if len(data) != SEQ_BYTES:
        raise ProtocolError(
            f"KV event sequence frame must be {SEQ_BYTES} bytes, got {len(data)}",
            reason="bad_value",
        )
    if data == END_SEQ:
        raise ProtocolError(
            "KV event batch carries the replay end marker as its sequence number",
            reason="bad_value",
        )
    return int.from_bytes(data, "big")


def decode_kv_frames(frames: Sequence[BufferLike]) -> KVEventMessage:
    """Decode one live-stream message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise ProtocolError(
            f"KV event message has 3 frames (topic, seq, payload), got {len(frames)}",
            reason="frame_count",
        )
    topic, seq_frame, payload = frames
    seq = decode_seq(seq_frame)
    decoded = decode_kv_batch(payload)
    return KVEventMessage(bytes(topic), seq, decoded.batch, decoded.unknown_events)


def encode_kv_frames(seq: int, batch: KVEventBatch, topic: bytes = b"") -> list[bytes]:
    """The three live-stream frames for ``batch`` numbered ``seq``."""
    return [topic, encode_seq(seq), encode_kv_batch(batch)]


# --- replay --------------------------------------------------------------------


def encode_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a publisher's replay ROUTER: ``[b"", start_seq]``."""
    return [b"", encode_seq(start_seq)]


def decode_replay_request(frames: Sequence[BufferLike]) -> tuple[bytes, int]:
    """A replay request as the publisher's ROUTER receives it: ``(identity, b"", start_seq)``.

    Returns the identity to answer and the first sequence number wanted.
    """
    if len(frames) != 3:
        raise ProtocolError(
            f"replay request has 3 frames (identity, empty, start_seq), got {len(frames)}",
            reason="frame_count",
        )
    identity, delimiter, start = frames
    if len(delimiter) != 0:
        raise ProtocolError(
            "replay request must have an empty delimiter frame", reason="unexpected_type"
        )
    data = bytes(start)
    if len(data) != SEQ_BYTES:
        raise ProtocolError(
            f"replay start_seq must be {SEQ_BYTES} bytes, got {len(data)}", reason="bad_value"
        )
    return bytes(identity), int.from_bytes(data, "big")


def encode_replay_batch(seq: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
    """One replayed batch as the publisher sends it, after the identity frame."""
    return [b"", topic, encode_seq(seq), payload]


_REPLAY_END = (b"", b"", END_SEQ, b"")


def encode_replay_end() -> list[bytes]:
    """The end marker that closes every replay answer, after the identity frame."""
    return list(_REPLAY_END)


def decode_replay_frames(frames: Sequence[BufferLike]) -> ReplayBatch | ReplayEnd:
    """One message from a publisher's replay ROUTER, as a DEALER receives it."""
    if len(frames) != 4:
        raise ProtocolError(
            f"replay reply has 4 frames (empty, topic, seq, payload), got {len(frames)}",
            reason="frame_count",
        )
    delimiter, topic, seq_frame, payload = frames
    if len(delimiter) != 0:
        raise ProtocolError(
            "replay reply must start with an empty delimiter frame", reason="unexpected_type"
        )
    if bytes(seq_frame) == END_SEQ:
        return ReplayEnd()
    seq = decode_seq(seq_frame)
    decoded = decode_kv_batch(payload)
    return ReplayBatch(bytes(topic), seq, decoded.batch, decoded.unknown_events)


# --- the engine's greeting -------------------------------------------------------

Endpoint = Annotated[str, Meta(max_length=1024)]


class PublisherSettings(msgspec.Struct, gc=False):
    """The part of vLLM's ``KVEventsConfig`` (a map in the greeting) a subscriber needs."""

    enable_kv_cache_events: bool = False
    publisher: Annotated[str, Meta(max_length=64)] | None = None
    endpoint: Endpoint = ""
    replay_endpoint: Endpoint | None = None
    topic: Annotated[str, Meta(max_length=1024)] = ""

    @property
    def publishes(self) -> bool:
        """True if the engine runs a ZeroMQ publisher at ``endpoint``."""
        return self.enable_kv_cache_events and self.publisher == "zmq" and bool(self.endpoint)


class GreetingKV(msgspec.Struct, gc=False):
    """What an engine's ready greeting says about its prefix cache and its publisher."""

    block_size: BlockSize | None = None
    kv_events_config: PublisherSettings | None = None
    data_parallel_rank: DpRank | None = None


_greeting_decoder = msgspec.msgpack.Decoder(GreetingKV)


def decode_greeting_kv(payload: BufferLike) -> GreetingKV | None:
    """Read an engine's ready greeting; None for the empty greeting older engines send."""
    if len(payload) == 0:
        return None
    try:
        return _greeting_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _failure(exc, "engine greeting") from None


# --- endpoints -----------------------------------------------------------------


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint DP rank ``rank``'s publisher uses, given the configured one.

    The same rule as vLLM 0.33's publisher, quirks included (it looks for the
    substrings ``inproc`` and ``tcp`` anywhere, and takes the port after the
    last colon), so the two always agree.
    """
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" not in endpoint:
        raise ValueError(
            f"cannot offset KV events endpoint {endpoint!r} for DP rank {rank}: "
            f"vLLM offsets only tcp and inproc endpoints per rank"
        )
    head, colon, port_text = endpoint.rpartition(":")
    if not colon:
        return endpoint
    port = int(port_text)
    if port == 0:
        return endpoint
    return f"{head}:{port + rank}"


def publisher_binds(endpoint: str) -> bool:
    """True if vLLM's publisher binds ``endpoint`` (else it connects to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVSubscription(NamedTuple):
    """Where the coordinator reaches one rank's publisher, and whether it binds there."""

    address: str
    bind: bool


_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})


def _tcp_host_port(endpoint: str) -> tuple[str, int]:
    rest = endpoint[len("tcp://") :]
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host or not port_text.isdigit():
        raise ValueError(f"KV events endpoint {endpoint!r} is not tcp://HOST:PORT")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"KV events endpoint {endpoint!r} has a port outside 0..65535")
    return host, port


def _host_for_uri(host: str) -> str:
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        if ipaddress.ip_address(bare).version == 6:
            return f"[{bare}]"
    except ValueError:
        pass
    return bare


def subscription_for(
    endpoint: str, rank: int, engine_host: str | None = None, *, replay: bool = False
) -> KVSubscription:
    """How the coordinator reaches DP rank ``rank``'s publisher configured with ``endpoint``.

    ``engine_host`` is the host the rank's engine connected from (None when
    unknown: loopback is used). ``replay=True`` is for the replay endpoint,
    which the publisher always binds. Raises ValueError for endpoints the
    coordinator cannot reach: ``inproc`` (private to the engine's process), a
    tcp port of 0 (the OS chose it; use the endpoint the engine reports), or
    an endpoint vLLM itself would refuse for this rank.
    """
    if type(rank) is not int or not 0 <= rank <= MAX_RANK:
        raise ValueError(f"DP rank must be an int in [0, {MAX_RANK}], got {rank!r}")
    if not endpoint:
        raise ValueError("KV events endpoint is empty")
    if "inproc" in endpoint:
        raise ValueError(
            f"KV events endpoint {endpoint!r} is inproc, private to the engine's process"
        )
    address = offset_endpoint(endpoint, rank)
    bind = not replay and not publisher_binds(address)
    if address.startswith("ipc://"):
        return KVSubscription(address, bind)
    if not address.startswith("tcp://"):
        raise ValueError(f"KV events endpoint {endpoint!r} must be tcp:// or ipc://")
    host, port = _tcp_host_port(address)
    if port == 0:
        raise ValueError(
            f"KV events endpoint {endpoint!r} has port 0, chosen by the engine's OS; "
            f"configure a fixed port or use the endpoint the engine reports"
        )
    # A wildcard host names no machine to connect to: the publisher is on the
    # rank's engine host. Where the publisher connects instead (0.0.0.0 has no
    # "*" or "::"), the coordinator binds the address as given.
    if host in _WILDCARD_HOSTS and not bind:
        host = engine_host if engine_host else "127.0.0.1"
    return KVSubscription(f"tcp://{_host_for_uri(host)}:{port}", bind)
