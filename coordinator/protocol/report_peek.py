"""Cheap looks at an `EngineCoreOutputs` frame, for reading stats in batches.

Only each engine's newest load report matters for balancing and publishing,
while every `wave_complete` and `start_wave` must be acted on. A reader that
drains `back_output` in batches can therefore skip an engine's stats report
when a later report of the same engine in the batch carries stats too, if it
can tell cheaply, without decoding the statistics, what a frame is:

* `peek_engine_index` reads the array header and the first element in
  Python: a few byte lookups. It answers only for the shape vLLM writes (a
  msgpack fixarray whose first element is a non-negative int of at most two
  bytes); anything else gives -1 and is simply decoded in full.
* `stats_only_wave` decodes the envelope with msgspec, skipping the
  statistics map without building it (only its `current_wave` is read), and
  says whether the frame is a stats report and nothing else: the given
  engine index, no request outputs, no utility result, no `wave_complete`,
  no `start_wave`, and a statistics map. It returns that map's
  `current_wave` (which a reader needs, since a report naming a wave newer
  than the coordinator's moves the coordinator's wave), or -1.

Both are conservative: whenever `decode_engine_report` accepts a frame,
`peek_engine_index` gives its engine index or -1, and `stats_only_wave` is
not -1 only if the report has statistics naming that wave, no wave field,
and passes `check_coordinator_traffic`. A frame they cannot vouch for is
decoded in full, as it would have been without them
(tests/unit/test_report_peek.py checks both promises against the full
decoder with hypothesis). Neither looks at the rest of the statistics, so a
report whose other statistics are malformed is still "stats only" here; that
is what a skipping reader has to say about the ones it skips.
"""

from __future__ import annotations

import msgspec

from coordinator.protocol.vllm import BufferLike, Wave

__all__ = ["peek_engine_index", "stats_only_mark", "stats_only_wave"]

_EMPTY_ARRAY = msgspec.Raw(b"\x90")
_NIL = msgspec.Raw(b"\xc0")


class _StatsWave(msgspec.Struct, gc=False):
    """A statistics map with string keys: its ``current_wave``; every other value is skipped."""

    current_wave: Wave = 0
    step_counter: int = 0


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    # The positions of `EngineReport`, with the same defaults for short arrays;
    # extra trailing elements are ignored as they are there.
    engine_index: int = 0
    outputs: msgspec.Raw = _EMPTY_ARRAY
    scheduler_stats: _StatsWave | None = None
    timestamp: msgspec.Raw = _NIL
    utility_output: msgspec.Raw = _NIL
    finished_requests: msgspec.Raw = _NIL
    wave_complete: msgspec.Raw = _NIL
    start_wave: msgspec.Raw = _NIL


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def peek_engine_index(buf: bytes) -> int:
    """The engine index of an `EngineCoreOutputs` frame, or -1 if it is not the usual shape."""
    if len(buf) < 3 or not 0x91 <= buf[0] <= 0x9F:
        return -1
    first = buf[1]
    if first < 0x80:  # positive fixint
        return first
    if first == 0xCC:  # uint 8
        return buf[2]
    if first == 0xCD and len(buf) >= 4:  # uint 16
        return (buf[2] << 8) | buf[3]
    return -1


def stats_only_wave(buf: BufferLike, engine_index: int) -> int:
    """The reported wave if `buf` is a stats report of `engine_index` and nothing else, else -1."""
    mark = stats_only_mark(buf, engine_index)
    return -1 if mark is None else mark[0]


def stats_only_mark(buf: BufferLike, engine_index: int) -> tuple[int, int] | None:
    """`(current_wave, step_counter)` if `buf` is a stats report of `engine_index` and
    nothing else, else None (the step is read as any int; bounds are the decoder's)."""
    try:
        envelope = _envelope_decoder.decode(buf)
    except (msgspec.DecodeError, RecursionError):
        return None
    stats = envelope.scheduler_stats
    if (
        stats is None
        or envelope.engine_index != engine_index
        or envelope.outputs != _EMPTY_ARRAY
        or envelope.utility_output != _NIL
        or envelope.wave_complete != _NIL
        or envelope.start_wave != _NIL
    ):
        return None
    return stats.current_wave, stats.step_counter
