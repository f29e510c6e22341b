"""vLLM 0.33 messages as the load processes send them, built once and patched in place.

Everything the drivers put on a socket comes from `coordinator.protocol.vllm`
(or `coordinator.protocol.frontend`) so that a peer coordinator sees exactly
vLLM's shapes. The one liberty: the stats template writes `num_waiting_reqs`
and `step_counter` as 4-byte msgpack ints (`0xce`), which msgpack permits and
every decoder accepts, so a sender can patch a counter into a prebuilt frame
without re-encoding 500 bytes per message.
"""

from __future__ import annotations

import struct

import coordinator.protocol.vllm as vllm
from coordinator.protocol import frontend as fp
from coordinator.protocol.version import PROTOCOL_VERSION

# Any value >= 2**16 and < 2**32 makes msgspec use the 4-byte form 0xce.
_WIDE = 0x10000000
_WAITING_KEY = b"\xb0num_waiting_reqs"
_STEP_KEY = b"\xacstep_counter"
_U32 = struct.Struct(">I")


def _u32_offset(frame: bytes, key: bytes) -> int:
    at = frame.index(key) + len(key)
    if frame[at] != 0xCE:
        raise RuntimeError(f"expected a 4-byte int after {key!r}")
    return at + 1


class StatsTemplate:
    """One engine's full 18-key `SchedulerStats` report with patchable counters.

    `num_waiting_reqs` carries the engine's cumulative message count (the
    monitor reads it back from the coordinator's publishes to see how far
    ingestion got). `step_counter` is the group's step: senders pass a step
    shared by every rank (see `lockstep_step`), so steps only go forward
    across the whole group, as in a lockstep group; without one it is the
    message count.
    """

    def __init__(self, rank: int, *, running: int = 3, kv_cache_usage: float = 0.25) -> None:
        stats = vllm.SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=_WIDE,
            step_counter=_WIDE,
            current_wave=0,
            kv_cache_usage=kv_cache_usage,
        )
        frame = vllm.encode_engine_outputs(
            vllm.EngineCoreOutputs(engine_index=rank, scheduler_stats=stats, timestamp=1.0)
        )
        self.rank = rank
        self.buffer = bytearray(frame)
        self._waiting_at = _u32_offset(frame, _WAITING_KEY)
        self._step_at = _u32_offset(frame, _STEP_KEY)

    def set_counter(self, value: int, step: int | None = None) -> bytearray:
        """Write `value` as the waiting count and `step` (default: `value`) as the step."""
        value &= 0x7FFFFFFF
        _U32.pack_into(self.buffer, self._waiting_at, value)
        _U32.pack_into(self.buffer, self._step_at, value if step is None else step & 0x7FFFFFFF)
        return self.buffer


# A lockstep group's steps, as every sender process sees them: one step per
# STEP_NS of CLOCK_MONOTONIC (shared by the processes of one machine).
STEP_NS = 10_000_000


def lockstep_step(now_ns: int) -> int:
    """The group step at `now_ns` (`time.perf_counter_ns()`), the same in every process.

    If every rank counted its own messages as steps, senders in different
    processes would drift apart and a coordinator comparing steps across
    ranks (vLLM's does) would see half the reports as out of order.
    """
    return now_ns // STEP_NS


def start_wave_report(rank: int, wave: int) -> bytes:
    """An engine telling the coordinator it started `wave` (vLLM's `start_wave`)."""
    return vllm.encode_engine_outputs(
        vllm.EngineCoreOutputs(engine_index=rank, start_wave=wave, timestamp=1.0)
    )


def wave_complete_report(rank: int, wave: int) -> bytes:
    """Rank 0 telling the coordinator that `wave` finished and engines paused."""
    return vllm.encode_engine_outputs(
        vllm.EngineCoreOutputs(engine_index=rank, wave_complete=wave, timestamp=1.0)
    )


def identity(rank: int) -> bytes:
    return rank.to_bytes(2, "little")


# The engine SDK's HELLO: it carries the protocol version, so READY is answered with
# ACCEPTED, which the handshake scenarios time (a vLLM engine gets no reply to READY).
HELLO = vllm.encode_handshake(vllm.HandshakeMessage(
    status="HELLO", local=True, headless=True, protocol_version=PROTOCOL_VERSION))
READY_HANDSHAKE = vllm.encode_handshake(
    vllm.HandshakeMessage(
        status="READY", local=True, headless=True, parallel_config_hash="bench-hash"
    )
)


def greeting(rank: int, engines: int) -> bytes:
    """The engine's first message on its input DEALER (vLLM's ready response)."""
    return vllm.encode_ready_response(
        vllm.EngineReadyResponse(
            max_model_len=4096,
            num_gpu_blocks=1024,
            dtype="bfloat16",
            vllm_version="0.33.0",
            data_parallel_size=engines,
            data_parallel_rank=rank,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            instance_id="bench",
        )
    )


def submit_header(call_id: int, request_id: str, wave: int) -> bytes:
    """`["submit", call_id, request_id, wave, None]` on the frontend DEALER."""
    return fp.encode(fp.Submit(call_id=call_id, request_id=request_id, wave=wave, dp_rank=None))


def finished_header(request_ids: list[str]) -> bytes:
    return fp.encode(fp.Finished(request_ids=request_ids))


# The reply kind is the msgpack string right after the array header.
SUBMITTED_TAG = b"\xa9submitted"


def is_submitted(reply: bytes) -> bool:
    return reply[1:11] == SUBMITTED_TAG


# What the floor answers on the frontend socket: a fixed, well-formed Submitted.
FLOOR_SUBMITTED = fp.encode(fp.Submitted(call_id=0, request_id="floor", rank=0, woke=False))
