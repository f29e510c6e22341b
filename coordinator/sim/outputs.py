"""What a simulated engine streams back for vLLM requests, and how a frontend reads it.

For a request that came as a vLLM `EngineCoreRequest`, the engine sends vLLM
0.33 `EngineCoreOutput` arrays to the request's frontend, as vLLM does: one
when the prefill yields the first token (carrying vLLM's `PrefillStats`: the
prompt's tokens, how many were computed and how many came from the prefix
cache), and one with the last token and `finish_reason`. The tokens between
are not sent: nothing downstream of a simulated engine reads them, and one
message per token per request would cost the load generator more than the
engine. With vLLM's `log_stats`, a step that looked up the prefix cache also
sends its `SchedulerStats` (with `prefix_cache_stats`) to one frontend, as
vLLM's scheduler does.

`read_token_outputs` is the frontend side: it picks these out of a decoded
`EngineCoreOutputs.outputs` list without trusting their shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["PrefillStats", "TokenOutput", "TokenReport", "prefill_stats_for",
           "read_token_outputs", "token_output"]

# Positions in vLLM's array-encoded EngineCoreOutput.
_REQUEST_ID, _NEW_TOKENS, _FINISH_REASON, _PREFILL_STATS = 0, 1, 5, 11


class PrefillStats(msgspec.Struct):
    """vLLM 0.33's `PrefillStats` (a dataclass: a map of its six fields)."""

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0


class TokenOutput(msgspec.Struct, array_like=True):
    """vLLM 0.33's `EngineCoreOutput`: all 19 fields, in order."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: None = None
    new_prompt_logprobs_tensors: None = None
    pooling_output: None = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    trace_headers: None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: None = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: None = None
    new_sampling_mask: None = None
    spec_decode_metrics: None = None
    prompt_token_id_logprobs: None = None
    error: None = None


def token_output(request_id: str, tokens: list[int], *, finish_reason: int | None = None,
                 prefill_stats: PrefillStats | None = None) -> TokenOutput:
    return TokenOutput(request_id, tokens, finish_reason=finish_reason,
                       prefill_stats=prefill_stats)


def prefill_stats_for(prompt_tokens: int, cached_tokens: int, newly_cached: int) -> PrefillStats:
    """vLLM's figures for one prefill: ``cached_tokens`` came from the local prefix cache."""
    return PrefillStats(
        num_prompt_tokens=prompt_tokens,
        num_computed_tokens=prompt_tokens - cached_tokens,
        num_cached_tokens=cached_tokens,
        num_local_cached_tokens=cached_tokens,
        num_external_cached_tokens=0,
        num_cache_creation_tokens=newly_cached,
    )


@dataclass(frozen=True)
class TokenReport:
    """One `EngineCoreOutput` as a frontend reads it."""

    request_id: str
    num_new_tokens: int
    finished: bool
    #: From the output that carried the first token, else None.
    prompt_tokens: int | None
    cached_tokens: int | None


def read_token_outputs(outputs: Sequence[Any]) -> list[TokenReport]:
    """The outputs in a decoded `EngineCoreOutputs.outputs` list; malformed ones are skipped."""
    reports: list[TokenReport] = []
    for item in outputs:
        if not isinstance(item, (list, tuple)) or len(item) <= _FINISH_REASON:
            continue
        request_id, tokens = item[_REQUEST_ID], item[_NEW_TOKENS]
        if not isinstance(request_id, str) or not isinstance(tokens, list):
            continue
        prompt = cached = None
        stats = item[_PREFILL_STATS] if len(item) > _PREFILL_STATS else None
        if isinstance(stats, dict):
            got_prompt = stats.get("num_prompt_tokens")
            got_cached = stats.get("num_cached_tokens")
            if type(got_prompt) is int and type(got_cached) is int:
                prompt, cached = got_prompt, got_cached
        reports.append(TokenReport(request_id, len(tokens), item[_FINISH_REASON] is not None,
                                   prompt, cached))
    return reports
