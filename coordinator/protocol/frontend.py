"""The frontend protocol: this project's own, on the coordinator's `frontend` ROUTER.

A frontend connects a DEALER. Every message it sends is `[header, *payload]`:
`header` is one msgpack array whose first element names the message (a msgspec
tagged, array-like struct); `payload` frames follow only for `Submit` and are
passed to the engine untouched. Each reply is one frame of the same style and
echoes the request's `call_id`, so a frontend may pipeline. The coordinator also
sends unsolicited notices (`RequestsFailed`, `RankDrained`) with no call id.

See docs/PROTOCOL.md for the prose version, with examples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

import msgspec

from coordinator.protocol.engine_request import MAX_MM_FEATURES, MAX_PROMPT_TOKENS, TokenId
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import MAX_RANK
from coordinator.protocol.version import PROTOCOL_VERSION
from coordinator.protocol.vllm import MAX_WAVE

#: The largest call id: a signed 64-bit integer.
MAX_CALL_ID: Final = 2**63 - 1
#: A client index addresses one of a rank's output sockets; it fits two bytes like a rank.
MAX_CLIENT_INDEX: Final = 65535

# Bounds enforced at decode time: anything outside is bad input, not a bug.
CallId = Annotated[int, msgspec.Meta(ge=0, le=MAX_CALL_ID)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]
Wave = Annotated[int, msgspec.Meta(ge=0, le=MAX_WAVE)]
ClientIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_CLIENT_INDEX)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Address = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
AdminCommand = Literal["cordon", "uncordon", "drain", "stop", "graceful_stop"]
#: Admin commands on the whole process, not on one rank (their ``rank`` is ignored).
PROCESS_COMMANDS: Final = ("stop", "graceful_stop")
Text = Annotated[str, msgspec.Meta(max_length=4096)]

MAX_ABORT_IDS = 4096


class _Message(msgspec.Struct, array_like=True, tag_field="kind"):
    """Base of every frontend-protocol message (array with the tag first)."""


# ---- frontend -> coordinator -------------------------------------------------


class Register(_Message, tag="register"):
    """Announce a frontend: its client index and where engines push its outputs."""

    call_id: CallId
    client_index: ClientIndex
    output_address: Address
    input_address: Address | None = None
    protocol_version: int = PROTOCOL_VERSION


class MultiModalItem(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """``[identifier, offset, length]``: one multimodal item and where its placeholder sits."""

    identifier: Text
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(ge=0)]


class PromptKeys(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What decides a prefix-cache hit, for prompts the coordinator cannot read itself.

    A vLLM ADD payload carries all of this and needs no ``PromptKeys``. Any
    other payload (the simulated engines', a proxy's own) can say here which
    tokens it carries, with the keys vLLM mixes into a block's hash: the LoRA
    adapter's name, the cache salt and the multimodal items. ``session_id``
    names a conversation, for affinity among equally good ranks.
    """

    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
    lora_name: Text | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=1 << 16)] | None = None
    mm_items: Annotated[list[MultiModalItem], msgspec.Meta(max_length=MAX_MM_FEATURES)] | None = (
        None
    )
    session_id: Text | None = None


class Submit(_Message, tag="submit"):
    """Send one request to an engine; payload frames follow the header."""

    call_id: CallId
    request_id: RequestId
    wave: Wave
    dp_rank: Rank | None = None
    prompt: PromptKeys | None = None


class _SubmitWithoutPrompt(_Message, tag="submit"):
    # A submit without prompt keys keeps the five elements it always had on the wire.
    call_id: int
    request_id: str
    wave: int
    dp_rank: int | None


class Route(_Message, tag="route"):
    """Ask which rank should take a request the frontend sends itself (no payload).

    ``ranks`` limits the choice to the ranks the frontend can reach (None: any
    rank of the group).
    """

    call_id: CallId
    request_id: RequestId
    ranks: Annotated[list[Rank], msgspec.Meta(max_length=MAX_RANK + 1)] | None = None
    prompt: PromptKeys | None = None


class Abort(_Message, tag="abort"):
    """Abort requests; each goes to the engine that holds it."""

    call_id: CallId
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=MAX_ABORT_IDS)]


class Finished(_Message, tag="finished"):
    """Requests the frontend saw finish; frees their routing entries. No reply."""

    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=MAX_ABORT_IDS)]


class QueryState(_Message, tag="state"):
    """Ask for membership, loads, wave and running."""

    call_id: CallId


class Admin(_Message, tag="admin"):
    """Operator command on one rank (cordon, uncordon or drain), or on the process:
    stop, or graceful_stop (refuse new submits, let those in flight finish, then
    stop); those two ignore ``rank``."""

    call_id: CallId
    command: AdminCommand
    rank: Rank


class Heartbeat(_Message, tag="heartbeat"):
    """Keeps this connection's registration of ``client_index`` alive (it is a lease).

    ``progress`` lists the ranks whose outputs reached this frontend since its last
    heartbeat: evidence that they are stepping, which engines' own reports may lack
    (they report only when their request counts change).
    """

    call_id: CallId
    client_index: ClientIndex
    progress: Annotated[list[Rank], msgspec.Meta(max_length=MAX_ABORT_IDS)] = []


FrontendRequest = Register | Submit | Route | Abort | Finished | QueryState | Admin | Heartbeat


# ---- coordinator -> frontend -------------------------------------------------


class EngineStatus(msgspec.Struct, array_like=True, frozen=True):
    """One rank as the coordinator sees it (``vllm_version`` is a tenth element, added
    last: decoders of the older nine elements ignore it)."""

    rank: int
    state: str
    engine_id: str | None
    waiting: int
    running: int
    kv_cache_usage: float
    dispatched_since_report: int
    in_flight: int
    last_seen_age_s: float | None
    vllm_version: str | None = None


class GroupState(msgspec.Struct, frozen=True):
    """A snapshot of the whole group (a map, so tools can read it by name)."""

    wave: int
    running: bool
    lockstep: bool
    rank_start: int
    rank_count: int
    frontends: int
    in_flight: int
    engines: list[EngineStatus]
    counters: dict[str, int]
    shutting_down: bool = False
    version: str = ""
    """The coordinator's dp-coordinator version ("" from those before it said)."""


class Registered(_Message, tag="registered"):
    call_id: int
    client_index: int
    rank_start: int
    rank_count: int
    wave: int
    running: bool
    lockstep: bool
    undeliverable_ranks: list[int] = []
    """Ranks whose INIT went out before this index registered, without its output
    address: they cannot deliver its outputs, so its requests never go there (empty
    when every rank can; older decoders ignore the element)."""


class Submitted(_Message, tag="submitted"):
    call_id: int
    request_id: str
    rank: int
    woke: bool


class Routed(_Message, tag="routed"):
    """The rank chosen for a ``route`` call, and what decided it."""

    call_id: int
    request_id: str
    rank: int
    reason: str


class Aborted(_Message, tag="aborted"):
    call_id: int
    request_ids: list[str]


class StateReply(_Message, tag="state"):
    call_id: int
    state: GroupState


class AdminDone(_Message, tag="admin_done"):
    call_id: int
    rank: int
    state: str


class Alive(_Message, tag="alive"):
    """The answer to a heartbeat: the registration is renewed for ``lease_ttl_s``; send
    the next heartbeat within ``interval_s``."""

    call_id: int
    lease_ttl_s: float
    interval_s: float


class ErrorReply(_Message, tag="error"):
    call_id: int
    code: str
    message: str
    request_id: str | None = None


class RequestsFailed(_Message, tag="failed"):
    """Unsolicited: these requests were on a rank that died; they will not finish."""

    request_ids: list[str]
    rank: int
    reason: str


class RankDrained(_Message, tag="drained"):
    """Unsolicited: a draining rank has no requests in flight any more."""

    rank: int


class RankLost(_Message, tag="rank_lost"):
    """Unsolicited, to every registered frontend: the engine holding ``rank`` died or was
    replaced. Requests this frontend sent there and has not seen finish will not finish,
    including any the coordinator no longer knows of (sent before it restarted)."""

    rank: int
    reason: str


class ShuttingDown(_Message, tag="shutdown"):
    """Unsolicited: the coordinator stops taking work and is about to close."""

    reason: str


FrontendReply = (
    Registered
    | Submitted
    | Routed
    | Aborted
    | StateReply
    | AdminDone
    | ErrorReply
    | RequestsFailed
    | RankDrained
    | ShuttingDown
    | Alive
    | RankLost
)

# Error codes carried in ErrorReply.code.
ERR_BAD_FRAME = "bad_frame"
ERR_UNKNOWN_RANK = "unknown_rank"
ERR_RANK_NOT_READY = "rank_not_ready"
ERR_NO_READY_ENGINE = "no_ready_engine"
ERR_DUPLICATE_REQUEST = "duplicate_request_id"
ERR_ENGINE_UNREACHABLE = "engine_unreachable"
ERR_TOO_MANY_IN_FLIGHT = "too_many_in_flight"
ERR_ADMIN_REFUSED = "admin_refused"
ERR_SHUTTING_DOWN = "shutting_down"
ERR_BAD_CLIENT_INDEX = "bad_client_index"
ERR_TOO_LARGE = "too_large"
ERR_NOT_AUTHORIZED = "not_authorized"
ERR_NOT_REGISTERED = "not_registered"
ERR_UNDELIVERABLE = "undeliverable"

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(FrontendRequest)
_reply_decoder = msgspec.msgpack.Decoder(FrontendReply)


def encode(message: FrontendRequest | FrontendReply) -> bytes:
    if type(message) is Submit and message.prompt is None:
        return _encoder.encode(_SubmitWithoutPrompt(
            message.call_id, message.request_id, message.wave, message.dp_rank))
    return _encoder.encode(message)


def decode_request(frames: Sequence[bytes]) -> tuple[FrontendRequest, list[bytes]]:
    """Split `[header, *payload]` into the typed header and the payload frames."""
    if not frames:
        raise ProtocolError("empty frontend message", reason="frame_count")
    payload = list(frames[1:])
    return decode_header(frames[0], len(payload)), payload


def decode_header(header: bytes | bytearray | memoryview, payload_frames: int) -> FrontendRequest:
    """The typed header of a message with ``payload_frames`` frames after it (any buffer:
    a reader may decode straight from a received frame)."""
    try:
        message = _request_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad frontend header: {exc}", reason="decode") from None
    if type(message) is Submit:
        if not payload_frames:
            raise ProtocolError("submit carries no payload frames", reason="frame_count")
    elif payload_frames:
        tag = type(message).__struct_config__.tag
        raise ProtocolError(
            f"'{tag}' takes no payload frames, got {payload_frames}", reason="frame_count"
        )
    return message


def salvage_call_id(header: bytes) -> int:
    """The call id of a header that failed to decode, if its first two elements are
    readable as [tag, call_id]; else 0. Lets a client match the error to its call."""
    try:
        loose = msgspec.msgpack.decode(header)
    except (msgspec.DecodeError, RecursionError):
        return 0
    if (
        isinstance(loose, list)
        and len(loose) >= 2
        and isinstance(loose[1], int)
        and not isinstance(loose[1], bool)
        and 0 <= loose[1] <= MAX_CALL_ID
    ):
        return loose[1]
    return 0


def decode_reply(frame: bytes) -> FrontendReply:
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad coordinator reply: {exc}", reason="decode") from None


def call_id_of(message: FrontendRequest) -> int:
    """The call id to echo in a reply (0 for messages that carry none)."""
    return getattr(message, "call_id", 0)


def group_state_to_builtins(state: GroupState) -> dict[str, Any]:
    """The state as plain JSON-ready data, engines as maps keyed by field name."""
    data: dict[str, Any] = msgspec.to_builtins(state)
    fields = EngineStatus.__struct_fields__
    data["engines"] = [dict(zip(fields, row, strict=True)) for row in data["engines"]]
    return data
