"""What a simulated engine runs: ADD payloads of two kinds, and the tokens it generates.

An ADD's first payload frame is either

* a `SimRequest` (`encode_sim_request`): this project's own four- or
  five-element array; no prompt, just a number of decode steps; or
* a vLLM 0.33 `EngineCoreRequest` (`encode_vllm_request`): a msgpack array in
  vLLM's field order, as a stock vLLM frontend sends it. The engine reads
  `prompt_token_ids`, `sampling_params.max_tokens` (the decode length),
  `lora_request`, `cache_salt`, `mm_features`, `client_index`,
  `current_wave` and `session_id`; every other field is skipped undecoded.

`decode_add_payload` tells them apart (a `SimRequest`'s second element is an
int, an `EngineCoreRequest`'s a list or nil) and gives one `SimWork` either
way, or raises `ProtocolError`.

Generated tokens. A simulated engine has no model, so what it "generates" is
a pure function of the prompt (`answer_tokens`): the same prompt always gets
the same answer, in any process. A load generator that builds the next turn
of a conversation from the previous prompt and its answer uses the same
function, so the history it sends is exactly what the engine computed and
cached, as with a real chat whose frontend re-tokenizes the answer.
"""

from __future__ import annotations

import random
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from coordinator.protocol.engine_request import (
    MAX_PROMPT_TOKENS,
    MAX_TOKEN_ID,
    LoraRef,
    MultiModalPlaceholder,
)
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.frontend import MAX_CLIENT_INDEX
from coordinator.protocol.vllm import MAX_WAVE

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "SimRequest",
    "SimWork",
    "answer_tokens",
    "decode_add_payload",
    "decode_sim_request",
    "encode_sim_request",
    "encode_vllm_request",
]

MAX_DECODE_STEPS = 10_000_000
#: vLLM's SamplingParams default, used when a request leaves max_tokens unset.
DEFAULT_MAX_TOKENS = 16
#: vLLM's FinishReason.LENGTH: max_tokens was reached.
FINISH_LENGTH = 1
#: vLLM's FinishReason.ERROR: the engine could not run the request.
FINISH_ERROR = 3
# Token ids of generated answers: away from the small ids special tokens use.
_ANSWER_VOCAB = (1000, 32000)
# How many trailing prompt tokens seed an answer.
_ANSWER_SEED_TOKENS = 64

ClientIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_CLIENT_INDEX)]
Wave = Annotated[int, msgspec.Meta(ge=0, le=MAX_WAVE)]
DecodeSteps = Annotated[int, msgspec.Meta(ge=1, le=MAX_DECODE_STEPS)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]


class SimRequest(msgspec.Struct, array_like=True, frozen=True):
    """The ADD payload a simulated engine understands."""

    request_id: RequestId
    client_index: ClientIndex
    current_wave: Wave
    decode_steps: DecodeSteps
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


# ---- vLLM's EngineCoreRequest ----------------------------------------------------------

_NIL = msgspec.Raw(b"\xc0")


class _SamplingHead(msgspec.Struct, gc=False):
    # vLLM's SamplingParams is a map of the fields that differ from their defaults.
    max_tokens: DecodeSteps | None = DEFAULT_MAX_TOKENS


class _VllmRequestHead(msgspec.Struct, array_like=True, gc=False):
    # vLLM 0.33's EngineCoreRequest, positions 0-20; unread ones stay raw msgpack.
    request_id: RequestId
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] | None
    mm_features: list[MultiModalPlaceholder] | None
    sampling_params: _SamplingHead | None
    pooling_params: msgspec.Raw
    arrival_time: msgspec.Raw
    lora_request: LoraRef | None
    cache_salt: Annotated[str, msgspec.Meta(max_length=1 << 16)] | None
    data_parallel_rank: msgspec.Raw
    prompt_embeds: msgspec.Raw = _NIL
    prompt_is_token_ids: msgspec.Raw = _NIL
    client_index: ClientIndex = 0
    current_wave: Wave = 0
    priority: msgspec.Raw = _NIL
    trace_headers: msgspec.Raw = _NIL
    resumable: msgspec.Raw = _NIL
    external_req_id: msgspec.Raw = _NIL
    reasoning_ended: msgspec.Raw = _NIL
    reasoning_parser_kwargs: msgspec.Raw = _NIL
    abort_immediately: msgspec.Raw = _NIL
    session_id: Text | None = None


_vllm_head_decoder = msgspec.msgpack.Decoder(_VllmRequestHead)


class _SamplingWire(msgspec.Struct, omit_defaults=True):
    # vLLM 0.33's SamplingParams: every public field, in order, with vLLM's
    # defaults, so omit_defaults writes the same keys. The field count matters
    # too: msgspec writes a map16 header for a struct of 16 or more fields.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = 0
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    structured_outputs: None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, str] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None


class _LoraWire(msgspec.Struct, array_like=True):
    # vLLM 0.33's LoRARequest (array-like; every field written).
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class _VllmRequestWire(msgspec.Struct, array_like=True):
    # vLLM 0.33's EngineCoreRequest: all 22 fields, in order.
    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: None
    sampling_params: _SamplingWire | None
    pooling_params: None
    arrival_time: float
    lora_request: _LoraWire | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: None = None
    prompt_is_token_ids: None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: None = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: None = None


_vllm_encoder = msgspec.msgpack.Encoder()
# vLLM's RequestOutputKind.DELTA: stream only what is new, as its API server asks.
_OUTPUT_KIND_DELTA = 1


def encode_vllm_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    max_tokens: int,
    client_index: int = 0,
    current_wave: int = 0,
    arrival_time: float = 0.0,
    temperature: float = 0.0,
    lora: tuple[str, int, str] | None = None,
    cache_salt: str | None = None,
    data_parallel_rank: int | None = None,
    session_id: str | None = None,
    external_req_id: str | None = None,
) -> bytes:
    """An ADD payload as vLLM 0.33's frontend encodes an `EngineCoreRequest`.

    `lora` is `(name, id, path)`. The sampling parameters are those of
    `SamplingParams(temperature=..., max_tokens=..., output_kind=DELTA)`.
    """
    if not 1 <= max_tokens <= MAX_DECODE_STEPS:
        raise ValueError(f"max_tokens must be in [1, {MAX_DECODE_STEPS}], got {max_tokens}")
    return _vllm_encoder.encode(
        _VllmRequestWire(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            mm_features=None,
            # What vLLM's SamplingParams constructor makes of these arguments:
            # it turns the unset stop lists and prefix-cache flag into values.
            sampling_params=_SamplingWire(
                temperature=temperature,
                stop=[],
                stop_token_ids=[],
                max_tokens=max_tokens,
                output_kind=_OUTPUT_KIND_DELTA,
                bad_words=[],
                skip_reading_prefix_cache=False,
            ),
            pooling_params=None,
            arrival_time=arrival_time,
            lora_request=None if lora is None else _LoraWire(lora[0], lora[1], lora[2]),
            cache_salt=cache_salt,
            data_parallel_rank=data_parallel_rank,
            client_index=client_index,
            current_wave=current_wave,
            external_req_id=external_req_id,
            session_id=session_id,
        )
    )


# ---- one view of either payload ----------------------------------------------------------


@dataclass(frozen=True)
class SimWork:
    """An ADD as the engine runs it, whichever payload it came in."""

    request_id: str
    client_index: int
    current_wave: int
    decode_steps: int
    prompt_token_ids: tuple[int, ...] | list[int] = ()
    lora: LoraRef | None = None
    mm_features: tuple[MultiModalPlaceholder, ...] = ()
    cache_salt: str | None = None
    session_id: str | None = None
    #: False for prompt embeddings: their blocks hash the embeddings, which the sim lacks.
    cacheable: bool = False
    #: True for vLLM payloads: the engine streams token outputs for them, as vLLM does.
    vllm: bool = False
    submitted_ns: int | None = None


def decode_add_payload(buf: bytes | bytearray | memoryview) -> SimWork:
    """Decode an ADD's first payload frame, a `SimRequest` or a vLLM `EngineCoreRequest`."""
    try:
        sim = _sim_request_decoder.decode(buf)
    except msgspec.ValidationError:
        pass  # well-formed msgpack of another shape: try vLLM's
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable ADD payload: {exc}", reason="decode") from None
    else:
        return SimWork(sim.request_id, sim.client_index, sim.current_wave, sim.decode_steps,
                       submitted_ns=sim.submitted_ns)
    try:
        head = _vllm_head_decoder.decode(buf)
    except msgspec.ValidationError as exc:
        raise ProtocolError(
            f"ADD payload is neither a SimRequest nor a vLLM EngineCoreRequest: {exc}",
            reason="bad_value",
        ) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable ADD payload: {exc}", reason="decode") from None
    if head.sampling_params is None:
        steps = 1  # a pooling request: one output after the prefill
    else:
        steps = head.sampling_params.max_tokens or DEFAULT_MAX_TOKENS
    embeds = bytes(head.prompt_embeds) != bytes(_NIL)
    return SimWork(
        request_id=head.request_id,
        client_index=head.client_index,
        current_wave=head.current_wave,
        decode_steps=steps,
        prompt_token_ids=head.prompt_token_ids or (),
        lora=head.lora_request,
        mm_features=tuple(head.mm_features or ()),
        cache_salt=head.cache_salt,
        session_id=head.session_id,
        cacheable=head.prompt_token_ids is not None and not embeds,
        vllm=True,
    )


def answer_tokens(prompt_token_ids: Sequence[int], count: int) -> list[int]:
    """The `count` tokens a simulated engine generates for this prompt (same everywhere)."""
    tail = array("I", prompt_token_ids[-_ANSWER_SEED_TOKENS:])
    if sys.byteorder != "little":  # pragma: no cover - the same answer on every host
        tail.byteswap()
    rng = random.Random(zlib.crc32(tail.tobytes()) ^ (len(prompt_token_ids) << 32))
    low, high = _ANSWER_VOCAB
    return [rng.randrange(low, high) for _ in range(count)]
