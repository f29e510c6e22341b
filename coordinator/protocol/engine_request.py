"""What a vLLM 0.33 ADD request says about prefix caching, read without decoding the rest.

A frontend's submit carries vLLM's ADD payload untouched: frames
``[payload, *aux]`` where ``payload`` is one msgpack ``EngineCoreRequest``, an
array in field order (``aux`` frames hold large tensors; nothing here needs
them). A prefix-cache hit on an engine depends on:

* ``prompt_token_ids`` (position 1): a msgpack array of ints. vLLM 0.33's
  engine decodes this field as ``list[int]``, so an array-encoded tensor
  here would be refused by the engine itself; it is refused here too.
* ``mm_features`` (2): one map per multimodal item; the hash covers each
  item's ``identifier`` and where its placeholder sits (``mm_position``:
  ``offset``, ``length``). The item's ``data`` is skipped undecoded.
* ``lora_request`` (6): an array ``[lora_name, lora_int_id, lora_path, ...]``;
  the events name the adapter by ``lora_name``.
* ``cache_salt`` (7): mixed into the first block only.
* ``prompt_embeds`` (9): when present, blocks are keyed by digests of the
  embeddings, which the coordinator cannot recompute; such requests never
  match (see ``AddRequestHead.cacheable``).

It also reads ``request_id`` (0), ``data_parallel_rank`` (8, a rank the
frontend pinned) and ``session_id`` (20), for affinity. Every other field,
``sampling_params`` included, is skipped as raw msgpack: no objects are built
for it. Arrays shorter than 22 elements are fine (vLLM leaves trailing
defaults out); longer ones are fine too (later fields are ignored).

Reason tokens on ``ProtocolError``: "decode" (not msgpack) and "bad_value"
(a field of the wrong type or out of range, such as a negative token id).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import MAX_RANK

__all__ = [
    "MAX_MM_FEATURES",
    "MAX_PROMPT_TOKENS",
    "AddRequestHead",
    "LoraRef",
    "MultiModalPlaceholder",
    "PlaceholderRange",
    "decode_add_request",
]

# Far above any model's context length, and still a bound on what one request
# can make the coordinator hold (the socket's message size limit is the other).
MAX_PROMPT_TOKENS = 1 << 22
MAX_MM_FEATURES = 1 << 14
MAX_TOKEN_ID = (1 << 32) - 1

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
DpRank = Annotated[int, Meta(ge=0, le=MAX_RANK)]
Text = Annotated[str, Meta(max_length=4096)]

_NIL = msgspec.Raw(b"\xc0")


class PlaceholderRange(msgspec.Struct, frozen=True, gc=False):
    """Where a multimodal item's placeholder tokens sit in the prompt."""

    offset: Annotated[int, Meta(ge=0)]
    length: Annotated[int, Meta(ge=0)]


class MultiModalPlaceholder(msgspec.Struct, frozen=True, gc=False):
    """The part of vLLM's ``MultiModalFeatureSpec`` map that block hashes cover."""

    identifier: Text
    mm_position: PlaceholderRange


class LoraRef(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The leading fields of vLLM's array-like ``LoRARequest``."""

    lora_name: Text
    lora_int_id: int
    lora_path: str = ""


class AddRequestHead(msgspec.Struct, array_like=True, gc=False):
    """An ``EngineCoreRequest`` with only the prefix-cache fields decoded.

    Positions the coordinator does not read are ``msgspec.Raw``: their bytes
    are checked to be msgpack and skipped, never turned into objects.
    """

    request_id: Annotated[str, Meta(max_length=4096)]
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)] | None
    mm_features: Annotated[list[MultiModalPlaceholder], Meta(max_length=MAX_MM_FEATURES)] | None
    sampling_params: msgspec.Raw
    pooling_params: msgspec.Raw
    arrival_time: msgspec.Raw
    lora_request: LoraRef | None
    cache_salt: Annotated[str, Meta(max_length=1 << 16)] | None
    data_parallel_rank: DpRank | None
    prompt_embeds: msgspec.Raw = _NIL
    prompt_is_token_ids: msgspec.Raw = _NIL
    client_index: msgspec.Raw = _NIL
    current_wave: msgspec.Raw = _NIL
    priority: msgspec.Raw = _NIL
    trace_headers: msgspec.Raw = _NIL
    resumable: msgspec.Raw = _NIL
    external_req_id: msgspec.Raw = _NIL
    reasoning_ended: msgspec.Raw = _NIL
    reasoning_parser_kwargs: msgspec.Raw = _NIL
    abort_immediately: msgspec.Raw = _NIL
    session_id: Text | None = None

    @property
    def has_prompt_embeds(self) -> bool:
        """True if the request carries prompt embeddings (position 9 is not nil)."""
        return bytes(self.prompt_embeds) != b"\xc0"

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def cacheable(self) -> bool:
        """True if the coordinator can key this request's blocks as the engine does.

        Not for requests without token ids (embeddings only) or with prompt
        embeddings (their keys hash the embeddings themselves).
        """
        return self.prompt_token_ids is not None and not self.has_prompt_embeds


_decoder = msgspec.msgpack.Decoder(AddRequestHead)


def decode_add_request(payload: bytes | bytearray | memoryview) -> AddRequestHead:
    """Read the prefix-cache fields of an ADD payload (the first payload frame)."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad ADD request: {exc}", reason="bad_value") from None
    except RecursionError:
        raise ProtocolError("bad ADD request: nested too deeply", reason="decode") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad ADD request: not msgpack ({exc})", reason="decode") from None
