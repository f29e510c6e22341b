"""Simulated lockstep data-parallel engines, for the demo, tests and benchmarks.

Each `SimEngine` is an `EngineAgent` plus a step loop that behaves like vLLM
0.33's `DPEngineCoreProc` wherever the coordinator can tell the difference:

* a waiting queue and a running set capped at `max_batch`; a request runs for
  its `decode_steps` steps, then the frontend that sent it gets an
  `EngineCoreOutputs` with `finished_requests=[request_id]` on its output socket;
* a KV cache of `kv_blocks` blocks of `block_size` tokens with prefix caching
  (`prefix_cache`, `scheduler`): a request sent as a vLLM `EngineCoreRequest`
  has a prompt whose KV takes blocks; full blocks stay cached after it
  finishes (LRU), keyed by content as vLLM keys them (parent-chained hashes,
  LoRA and cache salt included), and a later prompt with the same prefix skips
  computing it. Every step computes at most `max_num_batched_tokens` tokens
  and lasts `step_time_s` plus `prefill_s_per_token` per prompt token it
  computed, so a hit shortens the request's time to first token and, in
  lockstep, the step the whole group waits for. Such requests get vLLM's
  first-token and final `EngineCoreOutput`s (with `PrefillStats`), and one
  frontend gets vLLM's `prefix_cache_stats`; `kv_cache_usage` counts blocks in
  use. `SimRequest`s have no prompt and run exactly as before;
* with `kv_events_endpoint`, vLLM's KV cache events (`kv_publisher`):
  `BlockStored`, `BlockRemoved`, `AllBlocksCleared` batches on vLLM's endpoint
  convention with a replay socket, and a ready greeting that carries the block
  size and the publisher's `kv_events_config` as a vLLM engine's does; vLLM's
  `reset_prefix_cache` utility call (or `SimEngine.reset_prefix_cache`, or
  SIGUSR2 to `python -m coordinator.sim`) clears the cache;
* each loop iteration drains the input, publishes stats, runs one step and
  publishes stats again; stats go out only when `(running, waiting)` changed;
* while the group is running, an engine with no local work runs dummy steps;
* waves: an engine that gets a request adopts a newer stamped wave, and if it
  was idle it marks itself running *before* it sends `start_wave(current)`;
  `START_DP_WAVE [w, exclude]` wakes an engine that is not `exclude` when
  `w >= current`; when the global "anything unfinished" flag turns false, rank 0
  sends `wave_complete(current)` and every rank moves to the next wave with its
  step counter reset; rank 0 also reports `start_wave` when it starts running
  without having received a request itself (the "mirror" edge).

The collective
--------------
Real lockstep engines meet in collectives (the MoE all-to-all, and vLLM's
all-reduce of "has unfinished requests") on every step. Here every running rank
sends `(seq, has_unfinished)` to a `CollectiveHub` (a ZMQ ROUTER that a rank or
the group runner binds) after each step, real or dummy, and waits for the sum.
`seq` counts the collectives a rank has entered, so ranks that stepped the same
number of times meet in the same collective. An engine that never woke up never
enters it, and its peers block there, exactly as GPUs would. The wait is
bounded (`collective_timeout_s`): when it runs out, the waiting rank asks the hub
which ranks have arrived, and records a `CollectiveHang` naming the missing
ones (in `SimEngine.hangs`, and at ERROR in the log). With `on_hang="fail"` the
engine then dies like a vLLM engine whose collective timed out (frontends get
ENGINE_CORE_DEAD); with `on_hang="wait"` it records one hang per timeout period
and keeps waiting, so a late wake still completes the collective.

vLLM only honours the reduced flag on step 1 and then every `dp_sync_interval`
steps (16); between those steps the group keeps running. The same rule applies
here (`SimConfig.dp_sync_interval`).

Fault injection: `SimEngine.freeze()` stops the step loop (peers then block in
the collective); `ignore_start_wave = True` makes an engine drop START_DP_WAVE,
which plants the classic never-woken-peer hang.

Requests: the ADD payload is one frame holding a `SimRequest` (`encode_sim_request`)
or a vLLM 0.33 `EngineCoreRequest` (`encode_vllm_request`); see `request`.

Command line: `python -m coordinator.sim --help`.

Modules: `request` (the ADD payloads), `prefix_cache` (the KV cache),
`scheduler` (admission, token budget, progress), `outputs` (what vLLM
requests get back), `kv_publisher` (KV events), `collective` (the hub and its
clients), `engine` (one rank), `group` (every rank in one process), `cli` (the
command line); and the traffic that exercises them: `workload` (multi-turn
chat and shared documents, the ideal reuse) and `traffic` (the load
generator's config, records, summary and command line). Everything public in
the engine's modules is importable from `coordinator.sim` itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.sim.cli import main
    from coordinator.sim.collective import CollectiveClient, CollectiveHang, CollectiveHub
    from coordinator.sim.engine import (
        HangPolicy,
        SimConfig,
        SimCounters,
        SimEngine,
        sim_config_hash,
    )
    from coordinator.sim.group import SimEngineGroup
    from coordinator.sim.kv_publisher import KVEventPublisher
    from coordinator.sim.prefix_cache import BlockPool, CacheRequest
    from coordinator.sim.request import (
        SimRequest,
        SimWork,
        answer_tokens,
        decode_add_payload,
        decode_sim_request,
        encode_sim_request,
        encode_vllm_request,
    )
    from coordinator.sim.scheduler import SimScheduler

# Each public name and the module that defines it. They are imported on first use,
# so a user of one part (the load generator needs only the request codec) does not
# load the engine model and the command line with it.
_HOMES = {
    "BlockPool": "prefix_cache",
    "CacheRequest": "prefix_cache",
    "CollectiveClient": "collective",
    "CollectiveHang": "collective",
    "CollectiveHub": "collective",
    "HangPolicy": "engine",
    "KVEventPublisher": "kv_publisher",
    "SimConfig": "engine",
    "SimCounters": "engine",
    "SimEngine": "engine",
    "SimEngineGroup": "group",
    "SimRequest": "request",
    "SimScheduler": "scheduler",
    "SimWork": "request",
    "answer_tokens": "request",
    "decode_add_payload": "request",
    "decode_sim_request": "request",
    "encode_sim_request": "request",
    "encode_vllm_request": "request",
    "main": "cli",
    "sim_config_hash": "engine",
}

__all__ = [
    "BlockPool",
    "CacheRequest",
    "CollectiveClient",
    "CollectiveHang",
    "CollectiveHub",
    "HangPolicy",
    "KVEventPublisher",
    "SimConfig",
    "SimCounters",
    "SimEngine",
    "SimEngineGroup",
    "SimRequest",
    "SimScheduler",
    "SimWork",
    "answer_tokens",
    "decode_add_payload",
    "decode_sim_request",
    "encode_sim_request",
    "encode_vllm_request",
    "main",
    "sim_config_hash",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
