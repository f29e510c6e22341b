"""Fuzz every socket of a running coordinator process with hypothesis.

    python -m tools.fuzz --seconds 300 [--seed 1] [--atheris SECONDS]

One coordinator process is started and never restarted: surviving a stream of
bad input is the point. Before fuzzing, a clean vLLM-shaped engine group (raw
sockets, `tests/vllm_peers.py`) completes the handshake and runs a wave, and a
raw frontend registers; the coordinator's state is recorded. Then each of the
six sockets gets hypothesis-generated input:

* random frames: 0..8 of them (0 is sent as one empty frame: ZeroMQ has no
  empty message), each 0 B .. 64 KiB, plus one explicit 1 MiB message;
* msgpack that looks right and is not: the real messages of that socket (vLLM
  HELLO/READY maps, `EngineCoreOutputs` arrays with full stats, the engine
  greeting, START_DP_WAVE, SCALE_ELASTIC_EP, this project's frontend headers)
  decoded to plain values and mutated: types swapped, ints at and beyond
  their bounds (negative, 2**32, 2**64-1), NaN and infinite floats,
  elements added and removed, deep nesting, huge declared lengths, truncated
  and padded encodings; and the real messages of other sockets;
* on the DEALER-facing sockets (handshake, dispatch, frontend) a random ZMQ
  identity of 1..8 bytes per message.

Identities stay off the coordinator's managed ranks (so the clean group's
ranks are never claimed) and off the `\\x00`-prefixed ids libzmq makes up for
peers without one (on the frontend socket those belong to real frontends). A
message that the coordinator's own decoders accept as a valid state change
(an in-range stats or wave report, a frontend register or submit) is skipped
and counted as `skipped_valid`: valid input may change state, and the check
after fuzzing is that *bad* input did not. `SCALE_ELASTIC_EP` and admin
commands are sent, valid or not: the coordinator keeps its size fixed by
default and takes no admin command from a frontend connection, so they must
change nothing either. Every report the decoder accepts is also checked against the protocol's
bounds independently of the decoder (`findings`). Up an XSUB, a multipart
message whose first frame starts with 0x00/0x01 reaches the coordinator as two
messages (libzmq takes the first frame as a subscription), so both are judged.

After each socket's pass: the process is alive, no handler raised
(`internal_error.*` counters), the wave and membership state equals the
recorded one (counters and lease ages aside), every socket still reads (one
known-bad probe per socket must be answered or counted: a reader that stopped
would pass every other check) and the socket's drop or refusal counters grew.
After all of them, the same engine group runs another wave, is replaced by a
fresh group (new incarnations on the same ranks) that completes the handshake,
and that group runs a wave too.

With `--atheris SECONDS` (only if atheris is installed; it is not a project
dependency) the handlers are also fuzzed in-process with coverage guidance:
an in-process `CoordinatorServer` is bound on private ipc paths and libFuzzer's
bytes are split into (socket, frames) and fed straight to the handler, where
any exception is a finding.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import itertools
import json
import math
import random
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from tests import vllm_peers as peers

Ctx = zmq.Context[zmq.Socket[bytes]]

SOCKETS = ("handshake", "dispatch", "back_output", "back_publish", "front_publish", "frontend")
DEALER_SOCKETS = frozenset({"handshake", "dispatch", "frontend"})
XSUB_SOCKETS = frozenset({"back_publish", "front_publish"})

MAX_FRAMES = 8
MAX_FRAME_BYTES = 64 * 1024
# Well under the server's 16 MiB MAXMSGSIZE; big enough to cross every batching path.
LARGE_MESSAGE_BYTES = 1 << 20
# How long a replaced engine group stays away before its new incarnation connects.
RESTART_GAP_S = 0.5
# Counters that move without any input (timers), left out of "did it settle".
_TIMER_COUNTER_PREFIXES = ("lease.", "publish.")

# Counters whose growth shows that a socket's bad input was seen and dropped.
DROP_PREFIXES: dict[str, tuple[str, ...]] = {
    "handshake": ("dropped.handshake.", "refused.handshake."),
    "dispatch": ("dropped.dispatch.", "dispatch.unregistered_greeting"),
    "back_output": ("dropped.back_output.",),
    "back_publish": ("dropped.back_publish.",),
    "front_publish": ("dropped.front_publish.",),
    "frontend": ("dropped.frontend.",),
}


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class FuzzMessage:
    """One multipart message for one coordinator socket."""

    socket: str
    frames: tuple[bytes, ...]
    identity: bytes | None = None
    label: str = "explicit"

    def wire_frames(self) -> list[bytes]:
        # A ZeroMQ message has at least one frame; "no frames" goes out as one empty frame.
        return list(self.frames) if self.frames else [b""]

    def describe(self) -> str:
        parts = [f"{len(f)}B:{f[:24].hex()}{'..' if len(f) > 24 else ''}" for f in self.frames]
        ident = "" if self.identity is None else f" identity={self.identity!r}"
        return f"{self.socket}{ident} [{self.label}] frames={parts}"


def seed_corpus(rank_start: int, rank_count: int) -> dict[str, list[tuple[str, list[bytes]]]]:
    """The real messages of each socket, built from plain values as vLLM lays them out."""
    pack = peers.pack
    r0 = rank_start
    dp_size = rank_start + rank_count
    return {
        "handshake": [
            ("hello", [peers.hello_payload()]),
            ("hello_sdk", [peers.hello_payload(local=False, headless=True, engine_id="e-1",
                                               protocol_version=1)]),
            ("ready", [peers.ready_payload(parallel_config_hash="cfg-hash-1")]),
            ("ready_elastic", [peers.ready_payload(
                parallel_config_hash="cfg-hash-1", coord_store_port=1234,
                elastic_ep_max_dp_size=8, num_redundant_experts=0)]),
        ],
        "dispatch": [
            ("greeting", [pack(peers.ready_response(r0, dp_size))]),
            ("add", [peers.ADD, b"payload"]),
            ("start_dp_wave", peers.start_dp_wave_frames(3, r0)),
            ("abort", [peers.ABORT, pack(["req-1", "req-2"])]),
            ("utility", [peers.UTILITY, pack([0, 1, "method", [1, 2]])]),
        ],
        "back_output": [
            ("stats", [peers.stats_report(r0, waiting=3, running=2, kv_cache_usage=0.25,
                                          step=7, wave=4)]),
            ("wave_complete", [peers.engine_outputs(r0, wave_complete=4)]),
            ("start_wave", [peers.engine_outputs(r0, start_wave=5)]),
            ("finished", [peers.engine_outputs(r0, finished_requests=["req-1"])]),
            ("outputs", [peers.engine_outputs(
                r0, outputs=[["req-1", [1, 2], None, None, None, "stop"]])]),
            ("utility", [peers.engine_outputs(r0, utility_output=[1, None, None])]),
            ("heartbeat", [peers.engine_outputs(r0, timestamp=12.5)]),
        ],
        "back_publish": [
            ("subscribe", [peers.SUBSCRIBE]),
            ("unsubscribe", [peers.UNSUBSCRIBE]),
            ("ready", [peers.READY]),
            ("start_dp_wave", peers.start_dp_wave_frames(2, None)),
            ("topic", [b"\x01topic"]),
        ],
        "front_publish": [
            ("scale", [peers.scale_elastic_ep(dp_size + 1)]),
            ("legacy_first_request", [pack([r0, 3])]),
            ("legacy_identity", [pack([peers.identity(r0), 3])]),
            ("full_publish", [peers.full_publish([(1, 2, 0.5)] * rank_count, 3, True)]),
            ("wave_publish", [peers.wave_publish(3, False)]),
            ("subscribe", [peers.SUBSCRIBE]),
        ],
        "frontend": [
            ("register", [pack(["register", 1, 0, "ipc:///tmp/fuzz-out", None, 1])]),
            ("submit", [pack(["submit", 2, "req-1", 0, None]), b"payload"]),
            ("submit_rank", [pack(["submit", 3, "req-2", 0, r0]), b"payload"]),
            ("abort", [pack(["abort", 4, ["req-1"]])]),
            ("finished", [pack(["finished", ["req-1"]])]),
            ("state", [pack(["state", 5])]),
            ("admin", [pack(["admin", 6, "cordon", r0])]),
        ],
    }


# ---------------------------------------------------------------- generators

INT_EDGES: tuple[int, ...] = (
    0, 1, -1, 127, 128, 255, 256, 65535, 65536, -32768, 2**31 - 1, 2**31, -(2**31),
    2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1,
)
FLOAT_EDGES: tuple[float, ...] = (
    math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 0.5, 1.0000001, -1.0, 2.0,
)
WEIRD_VALUES: tuple[Any, ...] = (
    *INT_EDGES, *FLOAT_EDGES, None, True, False, "", "HELLO", "READY", "SCALE_ELASTIC_EP",
    "register", "submit", "x" * 300, "\u00ff\u4e2d", b"", b"\x00\x00",
    b"\xff" * 9, [], {}, [None], {"": None}, [[[]]],
)
# Encodings no valid message starts with, or that promise more than they carry.
RAW_GARBAGE: tuple[bytes, ...] = (
    b"\xc1",  # the one byte msgpack never uses
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G elements, no body
    b"\xdf\xff\xff\xff\xff",  # map32 of 4G pairs
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xd4\x00\x00",  # fixext1
    b"\xd6\xff\xff\xff\xff\xff",  # timestamp32 ext
    b"\xc7\xff\x01",  # ext8 claiming 255 bytes
    b"\x93\xc0",  # array of 3 holding one element
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # float64 NaN
    b"\xca\x7f\x80\x00\x00",  # float32 inf
)
TOKENS: tuple[bytes, ...] = (
    b"", b"\x00", b"\x01", b"\x02", b"\x03", b"\x04", b"\xff", b"READY", b"ENGINE_CORE_DEAD",
    b"\x00\x00", b"\x01\x00", b"\xff\xff",
)


@st.composite
def blobs(draw: st.DrawFn) -> bytes:
    """Random bytes, 0 B .. 64 KiB, made cheaply from a drawn size and seed."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=64))
    size = draw(st.one_of(
        st.integers(0, 1024),
        st.integers(0, MAX_FRAME_BYTES),
        st.sampled_from([0, 1, 2, 255, 256, 4095, 4096, 65535, MAX_FRAME_BYTES]),
    ))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    if kind == 1:
        return rng.randbytes(size)
    if kind == 2:
        return bytes([seed & 0xFF]) * size
    if kind == 3:
        return draw(st.sampled_from(RAW_GARBAGE)) + rng.randbytes(min(size, 256))
    return draw(st.sampled_from(TOKENS))


@st.composite
def deep_nesting(draw: st.DrawFn, envelope: bytes = b"") -> bytes:
    """Arrays or maps nested thousands deep (msgpack allows it; a decoder must not recurse)."""
    depth = draw(st.one_of(st.integers(1, 2000),
                           st.sampled_from([64, 512, 1000, 10_000, MAX_FRAME_BYTES // 3])))
    opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k", b"\x81\x00", b"\x92\x00"]))
    leaf = draw(st.sampled_from([b"\xc0", b"\x00", b"\x90", b"\x80"]))
    return envelope + opener * depth + leaf


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _replace(root: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    parent = _get(root, path[:-1])
    parent[path[-1]] = new
    return root


def _swap_type(value: Any, pick: int) -> Any:
    """A value of another msgpack type that a careless decoder might still take."""
    if isinstance(value, bool):
        return [int(value), str(value).lower(), None][pick % 3]
    if isinstance(value, int):
        raw = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
        return [str(value), float(value) if abs(value) < 2**60 else 1e30, bool(value & 1),
                [value], raw][pick % 5]
    if isinstance(value, float):
        return [int(value) if math.isfinite(value) else 0, str(value), [value]][pick % 3]
    if isinstance(value, str):
        return [len(value), value.encode(), [value], {value: value}, None][pick % 5]
    if isinstance(value, bytes):
        return [value.hex(), list(value[:16]), len(value)][pick % 3]
    if isinstance(value, list):
        return [{str(i): v for i, v in enumerate(value)}, tuple(value) and value[0], len(value),
                "list"][pick % 4]
    if isinstance(value, dict):
        return [list(value.values()), list(value.keys()), [[k, v] for k, v in value.items()],
                len(value)][pick % 4]
    return [0, "", [], {}][pick % 4]


MUTATIONS = ("weird", "swap_type", "int_edge", "float_edge", "extend", "shrink", "nest",
             "repeat", "long_string")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of plain values, counted without recursion, up to `limit`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if deepest >= limit:
            return limit
        if isinstance(node, list):
            stack += [(item, level + 1) for item in node]
        elif isinstance(node, dict):
            stack += [(item, level + 1) for item in node.values()]
    return deepest


@st.composite
def mutated_value(draw: st.DrawFn, value: Any) -> Any:
    """`value` (plain msgpack values, changed in place) after one to three mutations."""
    for _ in range(draw(st.integers(1, 3))):
        # A value grown by earlier mutations can be huge; pick among its first nodes.
        paths = list(itertools.islice(_paths(value), 4096))
        path = draw(st.sampled_from(paths))
        node = _get(value, path)
        op = draw(st.sampled_from(MUTATIONS))
        if op == "weird":
            new = copy.deepcopy(draw(st.sampled_from(WEIRD_VALUES)))
        elif op == "swap_type":
            new = _swap_type(node, draw(st.integers(0, 4)))
        elif op == "int_edge":
            new = draw(st.one_of(st.sampled_from(INT_EDGES),
                                 st.integers(-(2**63), 2**64 - 1)))
        elif op == "float_edge":
            new = draw(st.one_of(st.sampled_from(FLOAT_EDGES), st.floats()))
        elif op == "extend":
            extra = copy.deepcopy(draw(st.sampled_from(WEIRD_VALUES)))
            if isinstance(node, list):
                new = [*node, *([extra] * draw(st.integers(1, 12)))]
            elif isinstance(node, dict):
                key = draw(st.one_of(st.text(max_size=12), st.sampled_from(list(node) or [""]),
                                     st.integers(-5, 5)))
                new = {**node, key: extra}
            else:
                new = [node, extra]
        elif op == "shrink":
            if isinstance(node, list) and node:
                cut = draw(st.integers(0, len(node) - 1))
                new = node[:cut] if draw(st.booleans()) else node[:cut] + node[cut + 1:]
            elif isinstance(node, dict) and node:
                drop = draw(st.sampled_from(list(node)))
                new = {k: v for k, v in node.items() if k != drop}
            else:
                new = None
        elif op == "nest":
            new = node
            for _ in range(draw(st.integers(1, 60))):
                new = [new]
        elif op == "repeat":
            new = [node] * draw(st.integers(2, 200))
        else:
            new = "\u00e9" * draw(st.integers(0, 20_000))
        value = _replace(value, path, new)
    return value


def _encode(value: Any) -> bytes | None:
    try:
        encoded = msgspec.msgpack.encode(value)
    except (TypeError, OverflowError, ValueError, RecursionError):
        return None
    # Repeats of repeats grow fast; past this size the tail adds nothing new.
    return encoded[: 4 * MAX_FRAME_BYTES]


@st.composite
def mutated_frame(draw: st.DrawFn, frame: bytes) -> bytes:
    """One frame of a real message, mutated as msgpack values and then as bytes."""
    try:
        decoded = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        decoded = None
    encoded: bytes | None = None
    if (decoded is not None or frame[:1] == b"\xc0") and _depth(decoded, 64) < 64:
        encoded = _encode(draw(mutated_value(decoded)))
    if encoded is None:
        encoded = frame
    op = draw(st.sampled_from(["none", "none", "none", "truncate", "flip", "append", "prepend",
                               "float32", "nest_inside"]))
    if op == "truncate" and encoded:
        return encoded[: draw(st.integers(0, len(encoded) - 1))]
    if op == "flip" and encoded:
        at = draw(st.integers(0, len(encoded) - 1))
        return encoded[:at] + bytes([encoded[at] ^ draw(st.integers(1, 255))]) + encoded[at + 1:]
    if op == "append":
        return encoded + draw(st.one_of(st.sampled_from(RAW_GARBAGE), st.binary(max_size=32)))
    if op == "prepend":
        return draw(st.sampled_from([b"\x91", b"\x92\x00", b"\xc0", b"\x81\xa1k"])) + encoded
    if op == "float32":
        # The same number, narrower: vLLM only ever writes float64.
        return encoded.replace(b"\xcb", b"\xca", 1)
    if op == "nest_inside" and encoded[:1] and 0x91 <= encoded[0] <= 0x9F:
        # Keep the head of an array, bury the rest: "valid-looking" to the first field.
        return encoded[:1] + encoded[1:2] + draw(deep_nesting())
    return encoded


def is_allowed_identity(socket: str, identity: bytes, managed: range) -> bool:
    """Keep fuzz identities off the clean group's ranks and libzmq's generated ids."""
    if socket in ("handshake", "dispatch") and len(identity) == 2:
        return int.from_bytes(identity, "little") not in managed
    if socket == "frontend":
        return not identity.startswith(b"\x00")
    return True


def identities(socket: str, managed: range) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=1, max_size=8).filter(
        lambda ident: is_allowed_identity(socket, ident, managed)
    )


@st.composite
def frames_for(
    draw: st.DrawFn, socket: str, corpus: Mapping[str, Sequence[tuple[str, Sequence[bytes]]]]
) -> tuple[str, tuple[bytes, ...]]:
    """(label, frames) for one message to `socket`."""
    own = list(corpus[socket])
    others = [item for key, items in corpus.items() if key != socket for item in items]
    kind = draw(st.sampled_from(["random", "mutated", "mutated", "mutated", "reframed",
                                 "foreign", "deep"]))
    if kind == "random":
        count = draw(st.integers(0, MAX_FRAMES))
        return "random", tuple(draw(blobs()) for _ in range(count))
    if kind == "deep":
        name, frames = draw(st.sampled_from(own))
        envelope = draw(st.sampled_from([b"", frames[-1][:3], frames[-1][:6]]))
        out = list(frames)
        out[-1] = draw(deep_nesting(envelope))
        return f"deep:{name}", tuple(out)
    if kind == "foreign":
        name, frames = draw(st.sampled_from(others))
        out = [draw(mutated_frame(f)) if draw(st.booleans()) else f for f in frames]
        return f"foreign:{name}", tuple(out)
    name, frames = draw(st.sampled_from(own))
    out = list(frames)
    if kind == "mutated":
        index = draw(st.integers(0, len(out) - 1))
        out[index] = draw(mutated_frame(out[index]))
        if draw(st.integers(0, 3)) == 0:
            index = draw(st.integers(0, len(out) - 1))
            out[index] = draw(mutated_frame(out[index]))
        return f"mutated:{name}", tuple(out)
    # reframed: the right bytes in the wrong number of frames
    count = draw(st.integers(0, MAX_FRAMES))
    pool = [*out, b"", *TOKENS[:5]]
    return f"reframed:{name}", tuple(draw(st.sampled_from(pool)) for _ in range(count))


def messages(
    socket: str,
    corpus: Mapping[str, Sequence[tuple[str, Sequence[bytes]]]],
    managed: range,
) -> st.SearchStrategy[FuzzMessage]:
    ident: st.SearchStrategy[bytes | None] = (
        identities(socket, managed) if socket in DEALER_SOCKETS else st.none()
    )

    @st.composite
    def build(draw: st.DrawFn) -> FuzzMessage:
        label, frames = draw(frames_for(socket, corpus))
        return FuzzMessage(socket, frames, draw(ident), label)

    return build()


def explicit_messages(socket: str, managed: range) -> list[FuzzMessage]:
    """Cases every pass sends: a large message, deep nesting, huge declared lengths."""
    rng = random.Random(len(socket))
    ident = None
    if socket in DEALER_SOCKETS:
        ident = b"fuzz-big" if socket != "dispatch" else b"\xfe\xff"
    large = rng.randbytes(LARGE_MESSAGE_BYTES)
    quarter = LARGE_MESSAGE_BYTES // 4
    return [
        FuzzMessage(socket, (large,), ident, "large"),
        FuzzMessage(socket, tuple(large[i * quarter:(i + 1) * quarter] for i in range(4)),
                    ident, "large4"),
        FuzzMessage(socket, (b"\x91" * (MAX_FRAME_BYTES - 1) + b"\xc0",), ident, "deep"),
        FuzzMessage(socket, (b"\xdd\xff\xff\xff\xff",), ident, "huge_array_header"),
        FuzzMessage(socket, (b"",) * MAX_FRAMES, ident, "empty_frames"),
    ]


# ---------------------------------------------------------------- what is valid


def accepted_engine_report(frame: bytes) -> vllm.EngineReport | None:
    try:
        report = vllm.decode_engine_report(frame)
        vllm.check_coordinator_traffic(report)
    except ProtocolError:
        return None
    return report


def report_findings(report: vllm.EngineReport) -> list[str]:
    """Bounds the protocol promises, checked here without its decoder's help."""
    found = []

    def bad_int(value: object, low: int, high: int) -> bool:
        return type(value) is not int or not low <= value <= high

    if bad_int(report.engine_index, 0, 65535):
        found.append(f"engine_index {report.engine_index!r}")
    for name in ("wave_complete", "start_wave"):
        value = getattr(report, name)
        if value is not None and bad_int(value, 0, vllm.MAX_WAVE):
            found.append(f"{name} {value!r}")
    stats = report.scheduler_stats
    if stats is not None:
        for name in ("num_running_reqs", "num_waiting_reqs", "step_counter"):
            if bad_int(getattr(stats, name), 0, 2**64 - 1):
                found.append(f"{name} {getattr(stats, name)!r}")
        if bad_int(stats.current_wave, 0, vllm.MAX_WAVE):
            found.append(f"current_wave {stats.current_wave!r}")
        kv = stats.kv_cache_usage
        if not isinstance(kv, float) or not (math.isfinite(kv) and 0.0 <= kv <= 1.0):
            found.append(f"kv_cache_usage {kv!r}")
    return found


def as_received(message: FuzzMessage) -> list[tuple[bytes, ...]]:
    """The message(s) the coordinator reads for what the fuzzer sends.

    An XPUB takes a first frame starting with 0x00/0x01 as an (un)subscription
    and hands the frames after it to the application as a message of their own,
    so one multipart send up an XSUB can arrive as two messages.
    """
    frames = tuple(message.wire_frames())
    if message.socket in XSUB_SOCKETS and len(frames) > 1 and frames[0][:1] in (
        vllm.SUBSCRIBE, vllm.UNSUBSCRIBE
    ):
        return [frames[:1], frames[1:]]
    return [frames]


def classify(message: FuzzMessage, managed: range) -> tuple[bool, list[str]]:
    """(is a valid state change that must not be sent, findings about the decoder)."""
    skip = False
    findings: list[str] = []
    for frames in as_received(message):
        valid, found = _classify_received(message.socket, frames, managed)
        skip = skip or valid
        findings += found
    return skip, findings


def _classify_received(socket: str, frames: tuple[bytes, ...],
                       managed: range) -> tuple[bool, list[str]]:
    if socket == "back_output" and len(frames) == 1:
        report = accepted_engine_report(frames[0])
        if report is None:
            return False, []
        return report.engine_index in managed, report_findings(report)
    if socket == "front_publish" and len(frames) == 1 and frames[0][:1] not in (
        vllm.SUBSCRIBE, vllm.UNSUBSCRIBE
    ):
        try:
            upstream = vllm.decode_front_upstream(frames[0])
        except ProtocolError:
            return False, []
        # A pre-0.33 wake for a managed rank is honoured (it may start a wave): valid
        # input, not sent. SCALE_ELASTIC_EP is sent: the coordinator under test keeps its
        # size fixed (no --min-engines/--max-engines), so any resize must be refused.
        if isinstance(upstream, vllm.LegacyFirstRequest):
            return upstream.engine_index in managed, []
        return False, []
    if socket == "frontend":
        try:
            request, _ = fp.decode_request(frames)
        except ProtocolError:
            return False, []
        # Admin commands are sent too: the fuzzer is no operator, so they must be refused.
        return isinstance(request, (fp.Register, fp.Submit)), []
    return False, []


# ---------------------------------------------------------------- sending


@dataclass
class SocketStats:
    examples: int = 0
    sent: int = 0
    frames: int = 0
    size: int = 0
    max_frame: int = 0
    skipped_valid: int = 0
    replies: int = 0
    frame_counts: Counter[int] = field(default_factory=Counter)
    labels: Counter[str] = field(default_factory=Counter)
    identities: set[bytes] = field(default_factory=set)
    findings: list[str] = field(default_factory=list)

    def line(self, name: str) -> str:
        kinds = Counter(label.split(":", 1)[0] for label in self.labels.elements())
        counts = " ".join(f"{n}f:{c}" for n, c in sorted(self.frame_counts.items()))
        ident = f" identities={len(self.identities)}" if self.identities else ""
        return (f"{name:<13} examples={self.examples} sent={self.sent} "
                f"skipped_valid={self.skipped_valid} frames={self.frames} "
                f"bytes={self.size} max_frame={self.max_frame} replies={self.replies}{ident} "
                f"kinds={dict(sorted(kinds.items()))} frame_counts=[{counts}]")


class SocketFuzzer:
    """Sends FuzzMessages to a coordinator's sockets and drains whatever comes back.

    DEALER sockets are kept per identity (the newest `max_dealers` per socket);
    sends never block (a full queue drops the message, counted as not sent).
    """

    def __init__(self, ctx: Ctx, addresses: Mapping[str, str], managed: range, *,
                 max_dealers: int = 24, history: int = 8) -> None:
        self.ctx = ctx
        self.addresses = dict(addresses)
        self.managed = managed
        self.max_dealers = max_dealers
        self.stats: dict[str, SocketStats] = {key: SocketStats() for key in SOCKETS}
        self.recent: deque[FuzzMessage] = deque(maxlen=history)
        self._dealers: dict[str, dict[bytes, zmq.Socket[bytes]]] = {
            key: {} for key in DEALER_SOCKETS
        }
        self._others: dict[str, zmq.Socket[bytes]] = {}

    def _socket(self, message: FuzzMessage) -> zmq.Socket[bytes]:
        key = message.socket
        if key in DEALER_SOCKETS:
            pool = self._dealers[key]
            ident = message.identity or b"fuzz"
            sock = pool.get(ident)
            if sock is None:
                if len(pool) >= self.max_dealers:
                    evicted = pool.pop(next(iter(pool)))
                    self._drain(evicted, key)
                    evicted.close(200)
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.IDENTITY, ident)
                sock.setsockopt(zmq.SNDHWM, 10_000)
                sock.connect(self.addresses[key])
                pool[ident] = sock
            return sock
        sock = self._others.get(key)
        if sock is None:
            kind = zmq.XSUB if key in XSUB_SOCKETS else zmq.PUSH
            sock = self.ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(self.addresses[key])
            self._others[key] = sock
        return sock

    def send(self, message: FuzzMessage) -> bool:
        """Send unless the message is a valid state change; True if it went out."""
        stats = self.stats[message.socket]
        stats.examples += 1
        skip, findings = classify(message, self.managed)
        stats.findings += [f"{message.describe()[:200]}: {f}" for f in findings]
        if skip:
            stats.skipped_valid += 1
            return False
        sock = self._socket(message)
        frames = message.wire_frames()
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.recent.append(message)
        stats.sent += 1
        stats.frames += len(frames)
        stats.size += sum(len(f) for f in frames)
        stats.max_frame = max(stats.max_frame, *(len(f) for f in frames))
        stats.frame_counts[len(message.frames)] += 1
        stats.labels[message.label] += 1
        if message.identity is not None and len(stats.identities) < 100_000:
            stats.identities.add(message.identity)
        if stats.sent % 32 == 0:
            self.drain()
        return True

    def _drain(self, sock: zmq.Socket[bytes], key: str) -> None:
        while True:
            try:
                sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats[key].replies += 1

    def drain(self) -> None:
        """Read every reply or publish that reached the fuzzing sockets."""
        for key, pool in self._dealers.items():
            for sock in pool.values():
                self._drain(sock, key)
        for key, sock in self._others.items():
            if key in XSUB_SOCKETS:
                self._drain(sock, key)

    def close(self) -> None:
        self.drain()
        for pool in self._dealers.values():
            for sock in pool.values():
                sock.close(200)
            pool.clear()
        for sock in self._others.values():
            sock.close(200)
        self._others.clear()


# ---------------------------------------------------------------- the rig

# The counter each socket's probe (FuzzRig.probe) must move; None: a reply is expected.
PROBE_COUNTERS: dict[str, str | None] = {
    "handshake": None,
    "dispatch": "dropped.dispatch.identity_length",
    "back_output": "dropped.back_output.frame_count",
    "back_publish": "dropped.back_publish.unexpected_frame",
    "front_publish": "dropped.front_publish.frame_count",
    "frontend": None,
}


def comparable_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """What bad input must not change: wave, membership, loads, frontends, in flight."""
    engines = []
    for row in state["engines"]:
        # EngineStatus array: rank, state, engine_id, waiting, running, kv, dispatched,
        # in_flight, last_seen_age_s. The age moves with the clock.
        engines.append(list(row[:8]))
    keep = ("wave", "running", "lockstep", "rank_start", "rank_count", "frontends",
            "in_flight", "shutting_down")
    return {**{key: state.get(key) for key in keep}, "engines": engines}


def input_counters(counters: Mapping[str, int]) -> dict[str, int]:
    return {k: v for k, v in counters.items() if not k.startswith(_TIMER_COUNTER_PREFIXES)}


def counter_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] != before.get(k, 0)}


class FuzzRig:
    """A coordinator process with a clean raw engine group and a raw frontend."""

    CONFIG_HASH = "cfg-hash-1"

    def __init__(self, ctx: Ctx, addresses: Mapping[str, str], *, engines: int,
                 rank_start: int = 0, alive: Callable[[], bool]) -> None:
        self.ctx = ctx
        self.addresses = dict(addresses)
        self.engines = engines
        self.managed = range(rank_start, rank_start + engines)
        self.alive = alive
        self.group: list[peers.RawEngine] = []
        self.front = peers.RawFrontend(ctx, self.addresses)
        self.waves_run = 0
        self._request_seq = 0

    # -- setup

    def bring_up(self) -> None:
        """Register the frontend, run the engines' handshake, wait until all are ready."""
        reply = self.front.register(0, "ipc:///tmp/dp-coordinator-fuzz-outputs-0")
        if reply[0] != "registered":
            raise AssertionError(f"frontend registration refused: {reply!r}")
        self.front.subscribe_publishes()
        self.group = peers.handshake_group(
            self.ctx, self.addresses, list(self.managed), dp_size=self.managed.stop,
            parallel_config_hash=self.CONFIG_HASH, rng=random.Random(7),
        )
        self.wait_all_ready()

    def replace_group(self) -> None:
        """Close the engines and start new incarnations on the same ranks (vLLM restart)."""
        for engine in self.group:
            engine.close()
        # A restarted process needs a moment; an immediate reconnect under the same
        # identity can reach the handshake ROUTER (no ROUTER_HANDOVER there) before it
        # has seen the old connection go, and libzmq then ignores the new peer.
        time.sleep(RESTART_GAP_S)
        self.group = peers.handshake_group(
            self.ctx, self.addresses, list(self.managed), dp_size=self.managed.stop,
            parallel_config_hash=self.CONFIG_HASH, rng=random.Random(8),
        )
        self.wait_all_ready()

    def wait_all_ready(self, timeout: float = 10.0) -> None:
        peers.wait_until(
            lambda: all(row[1] == "ready" for row in self.front.state()["engines"]),
            timeout=timeout, what="every rank to be ready",
        )

    def close(self) -> None:
        for engine in self.group:
            engine.close()
        self.group = []
        self.front.close()

    # -- observations

    def state(self) -> dict[str, Any]:
        return self.front.state()

    def counters(self) -> dict[str, int]:
        return dict(self.state()["counters"])

    def settle(self, timeout: float = 10.0, quiet: float = 0.3) -> dict[str, int]:
        """Wait until the input counters stop moving (all sent input was read)."""
        deadline = time.monotonic() + timeout
        last = input_counters(self.counters())
        stable_since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = input_counters(self.counters())
            if now != last:
                last, stable_since = now, time.monotonic()
            elif time.monotonic() - stable_since >= quiet:
                break
        return self.counters()

    def _drain_publishes(self) -> None:
        socks = [self.front.sub] + [e.sub for e in self.group] + [e.dispatch for e in self.group]
        for sock in socks:
            while sock is not None:
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    # -- is each socket still read?

    def probe(self, socket: str, timeout: float = 3.0) -> str | None:
        """Send one known-bad message on a fresh connection and wait for its trace.

        Returns None when the coordinator answered (handshake, frontend) or counted
        it, else what is missing: a reader that stopped would pass every other
        check, since counters and state only ever show what was read.
        """
        sock: zmq.Socket[bytes]
        if socket in ("handshake", "frontend"):
            sock = self.ctx.socket(zmq.DEALER)
            if socket == "handshake":
                sock.setsockopt(zmq.IDENTITY, (0xFEFE).to_bytes(2, "little"))
            payload = [peers.hello_payload()] if socket == "handshake" else [
                peers.pack(["state", 77])]
        else:
            sock = self.ctx.socket(
                zmq.XSUB if socket in XSUB_SOCKETS else zmq.PUSH if socket == "back_output"
                else zmq.DEALER)
            if socket == "dispatch":
                sock.setsockopt(zmq.IDENTITY, b"probe")
                payload = [b"probe"]
            elif socket == "back_publish":
                payload = [b"probe"]
            else:
                payload = [b"probe", b"two frames"]
        key = PROBE_COUNTERS.get(socket)
        before = self.counters().get(key, 0) if key else 0
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.addresses[socket])
            sock.send_multipart(payload)
            if key is None:
                if not sock.poll(int(timeout * 1000)):
                    return f"{socket}: no reply to a probe within {timeout} s"
                return None
            deadline = time.monotonic() + timeout
            while self.counters().get(key, 0) <= before:
                if time.monotonic() > deadline:
                    return f"{socket}: a probe was not counted ({key}) within {timeout} s"
                time.sleep(0.02)
            return None
        finally:
            sock.close(0)

    # -- a wave

    def run_wave(self, timeout: float = 5.0) -> int:
        """Submit one request to the paused group and carry the wave to its end.

        Checks what an engine would see: the ADD on the chosen rank's dispatch
        socket, START_DP_WAVE for the current wave on every other rank, the
        wave published as running and then, after rank 0's wave_complete, as
        paused at the next wave. Returns the new wave.
        """
        self._drain_publishes()
        state = self.state()
        wave = int(state["wave"])
        if state["running"]:
            raise AssertionError(f"the group should be paused before a wave, state {state}")
        self._request_seq += 1
        request_id = f"fuzz-rig-{self._request_seq}"
        reply = self.front.submit(request_id, b"payload", wave=wave)
        if reply[0] != "submitted":
            raise AssertionError(f"submit refused: {reply!r}")
        chosen = int(reply[3])
        by_rank = {engine.rank: engine for engine in self.group}
        add = _expect_frames(by_rank[chosen].dispatch, lambda f: f[:1] == [peers.ADD], timeout,
                             f"ADD on rank {chosen}")
        if add[1:] != [b"payload"]:
            raise AssertionError(f"ADD carried {add!r}")
        for engine in self.group:
            if engine.rank == chosen:
                continue
            frames = _expect_frames(engine.sub, lambda f: f[:1] == [peers.START_DP_WAVE],
                                    timeout, f"START_DP_WAVE on rank {engine.rank}")
            got_wave, _exclude = peers.unpack(frames[1])
            if got_wave != wave:
                raise AssertionError(f"rank {engine.rank} woken for wave {got_wave}, not {wave}")
        by_rank[chosen].report(peers.engine_outputs(chosen, start_wave=wave))
        self._expect_wave_publish(wave, True, timeout)
        by_rank[self.managed.start].report(
            peers.engine_outputs(self.managed.start, wave_complete=wave))
        self._expect_wave_publish(wave + 1, False, timeout)
        self.front.send(peers.pack(["finished", [request_id]]))
        peers.wait_until(lambda: (s := self.state())["wave"] == wave + 1
                         and not s["running"] and s["in_flight"] == 0,
                         timeout=timeout, what=f"paused at wave {wave + 1}, nothing in flight")
        self.waves_run += 1
        return wave + 1

    def _expect_wave_publish(self, wave: int, running: bool, timeout: float) -> None:
        expected = peers.wave_publish(wave, running)
        deadline = time.monotonic() + timeout
        while True:
            buf = self.front.recv_publish(max(0.0, deadline - time.monotonic()))
            if buf is None:
                raise AssertionError(f"no [nil, {wave}, {running}] publish within {timeout} s")
            if buf == expected:
                return


def _expect_frames(sock: zmq.Socket[bytes] | None, match: Callable[[list[bytes]], bool],
                   timeout: float, what: str) -> list[bytes]:
    if sock is None:
        raise AssertionError(f"no socket for {what}")
    deadline = time.monotonic() + timeout
    while True:
        frames = peers.recv_frames(sock, max(0.0, deadline - time.monotonic()))
        if frames is None:
            raise AssertionError(f"{what}: nothing within {timeout} s")
        if match(frames):
            return frames


@dataclass
class PassResult:
    socket: str
    seconds: float
    stats: SocketStats
    delta: dict[str, int]
    problems: list[str]


def fuzz_socket(
    rig: FuzzRig,
    fuzzer: SocketFuzzer,
    socket: str,
    *,
    seconds: float,
    max_examples: int,
    seed: int | None = None,
    chunk: int = 100,
) -> PassResult:
    """One hypothesis pass over `socket`, bounded in examples and time, then the checks."""
    corpus = seed_corpus(rig.managed.start, rig.engines)
    before_state = comparable_state(rig.state())
    before = rig.settle()
    started = time.monotonic()
    deadline = started + seconds

    def send_one(message: FuzzMessage) -> None:
        if time.monotonic() > deadline:
            return
        fuzzer.send(message)
        if not rig.alive():
            recent = "\n  ".join(m.describe()[:300] for m in fuzzer.recent)
            raise AssertionError(f"the coordinator died; last messages:\n  {recent}")

    # Hypothesis has no time budget: run it in chunks until either bound is reached.
    # derandomize makes a chunk repeat the previous one, so with a seed each chunk
    # gets its own (seed + chunk index), which keeps a whole run repeatable.
    strategy = messages(socket, corpus, rig.managed)
    done = 0
    chunk_index = 0
    while done < max_examples and time.monotonic() < deadline:
        size = min(chunk, max_examples - done)
        test = given(strategy)(send_one)
        if chunk_index == 0:
            for message in explicit_messages(socket, rig.managed):
                test = example(message)(test)
        test = settings(
            max_examples=size,
            deadline=None,
            database=None,
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )(test)
        if seed is not None:
            test = hypothesis_seed(seed * 100_003 + chunk_index)(test)
        test()
        done += size
        chunk_index += 1
    fuzzer.drain()
    after = rig.settle()
    fuzzer.drain()
    elapsed = time.monotonic() - started
    problems = check_after_pass(rig, socket, before_state, before, after)
    stats = fuzzer.stats[socket]
    problems += [f"decoder accepted out-of-bounds value: {f}" for f in stats.findings[:5]]
    return PassResult(socket, elapsed, stats, counter_delta(before, after), problems)


def check_after_pass(rig: FuzzRig, socket: str, before_state: dict[str, Any],
                     before: Mapping[str, int], after: Mapping[str, int]) -> list[str]:
    problems = []
    if not rig.alive():
        return ["the coordinator process died"]
    errors = {k: v for k, v in after.items() if k.startswith("internal_error")}
    if errors:
        problems.append(f"handlers raised: {errors}")
    after_state = comparable_state(rig.state())
    if after_state != before_state:
        problems.append(f"state changed:\n    before {before_state}\n    after  {after_state}")
    for key in SOCKETS:
        missing = rig.probe(key)
        if missing is not None:
            problems.append(f"socket no longer read: {missing}")
    grown = sum(after.get(k, 0) - before.get(k, 0) for k in after
                if k.startswith(DROP_PREFIXES[socket]))
    if grown <= 0:
        problems.append(f"no drop/refusal counter for {socket} grew "
                        f"(prefixes {DROP_PREFIXES[socket]})")
    return problems


def check_service(rig: FuzzRig) -> list[str]:
    """After fuzzing: a wave on the old group, a new incarnation's handshake, a wave on it."""
    problems = []
    try:
        first = rig.run_wave()
        rig.replace_group()
        second = rig.run_wave()
        if second != first + 1:
            problems.append(f"wave went from {first} to {second}")
        state = rig.state()
        states = [row[1] for row in state["engines"]]
        if states != ["ready"] * rig.engines:
            problems.append(f"ranks not ready after the new handshake: {states}")
    except AssertionError as exc:
        problems.append(f"service after fuzzing: {exc}")
    if not rig.alive():
        problems.append("the coordinator process died")
    return problems


# ---------------------------------------------------------------- atheris (optional)


def run_atheris(seconds: float, managed_count: int) -> int:
    """Coverage-guided fuzzing of the handlers, in this process. Needs atheris."""
    try:
        atheris: Any = importlib.import_module("atheris")
    except ImportError:
        print("atheris is not installed (pip install atheris); skipping the in-process pass")
        return 0
    from coordinator.server.app import CoordinatorServer
    from coordinator.server.config import ServerConfig

    # The coordinator's modules are already imported; instrument what is loaded.
    atheris.instrument_all()

    ipc_dir = tempfile.mkdtemp(prefix="dpc-atheris-")
    server = CoordinatorServer(ServerConfig(engines=managed_count, ipc_dir=ipc_dir))
    server.bind()
    handlers: list[Callable[[list[bytes]], None]] = [
        server.frame_handlers[socket] for socket in SOCKETS
    ]
    managed = range(0, managed_count)
    corpus = seed_corpus(0, managed_count)
    core = server.core
    before = (core.waves.snapshot(), [(lease.rank, lease.state) for lease in
                                      core.membership.leases()])

    def one_input(data: bytes) -> None:
        provider = atheris.FuzzedDataProvider(data)
        which = provider.ConsumeIntInRange(0, len(handlers) - 1)
        socket = SOCKETS[which]
        ident: bytes | None = None
        if socket in DEALER_SOCKETS:
            ident = provider.ConsumeBytes(provider.ConsumeIntInRange(1, 8)) or b"\x7f"
            if not is_allowed_identity(socket, ident, managed):
                return
        payload: list[bytes] = []
        if provider.ConsumeBool():
            _, seed_frames = corpus[socket][provider.ConsumeIntInRange(0, len(corpus[socket]) - 1)]
            payload += list(seed_frames)
            at = provider.ConsumeIntInRange(0, len(payload) - 1)
            payload[at] = provider.ConsumeBytes(provider.ConsumeIntInRange(0, 64)) + payload[at]
        for _ in range(provider.ConsumeIntInRange(0, MAX_FRAMES)):
            payload.append(provider.ConsumeBytes(provider.ConsumeIntInRange(0, 4096)))
        message = FuzzMessage(socket, tuple(payload), ident, "atheris")
        frames = message.wire_frames() if ident is None else [ident, *message.wire_frames()]
        if classify(message, managed)[0]:
            return
        handlers[which](frames)
        after = (core.waves.snapshot(), [(lease.rank, lease.state) for lease in
                                         core.membership.leases()])
        if after != before:
            raise AssertionError(f"state changed by {message.describe()}: {before} -> {after}")

    artifacts = tempfile.mkdtemp(prefix="dpc-atheris-found-")
    print(f"atheris: findings (if any) go to {artifacts}", flush=True)
    try:
        # libFuzzer ends the process itself: 0 when the time is up, non-zero on a finding.
        atheris.Setup([sys.argv[0], "-rss_limit_mb=4096", f"-artifact_prefix={artifacts}/",
                       f"-max_total_time={max(1, int(seconds))}"], one_input)
        atheris.Fuzz()
    finally:
        server.close()
    return 0


def run_atheris_child(seconds: float, engines: int, log: Callable[[str], None]) -> list[str]:
    """Run the atheris pass in a child process (libFuzzer exits the process it runs in)."""
    import subprocess

    if importlib.util.find_spec("atheris") is None:
        log("atheris is not installed (pip install atheris); no in-process pass")
        return []
    child = subprocess.run(
        [sys.executable, "-m", "tools.fuzz", "--atheris-child", str(seconds),
         "--engines", str(engines)],
        capture_output=True, text=True, timeout=seconds + 120, check=False,
    )
    tail = (child.stdout + child.stderr).strip().splitlines()[-12:]
    log("atheris: " + "\n    ".join(line for line in tail if "dropped bad input" not in line))
    return [] if child.returncode == 0 else [f"atheris pass exit code {child.returncode}"]


# ---------------------------------------------------------------- command line


def run(seconds: float, *, engines: int = 2, seed: int | None = None,
        atheris_seconds: float = 0.0, log: Callable[[str], None] = print) -> int:
    """Start a coordinator, fuzz each socket in turn for `seconds` in all, check service."""
    from coordinator.launch import launch

    workdir = tempfile.mkdtemp(prefix="dpc-fuzz-")
    handle = launch(engines=engines, addr_file=f"{workdir}/addresses.json",
                    extra_args=["--ipc-dir", f"{workdir}/ipc", "--log-level", "error"],
                    timeout=30.0)
    ctx: Ctx = zmq.Context()
    failures: list[str] = []
    try:
        rig = FuzzRig(ctx, handle.addresses, engines=engines, alive=handle.is_alive)
        rig.bring_up()
        rig.run_wave()
        fuzzer = SocketFuzzer(ctx, handle.addresses, rig.managed)
        rounds = max(1, int(seconds // (len(SOCKETS) * 20)))
        per_pass = seconds / (rounds * len(SOCKETS))
        for round_index in range(rounds):
            for socket in SOCKETS:
                result = fuzz_socket(rig, fuzzer, socket, seconds=per_pass,
                                     max_examples=1_000_000,
                                     seed=None if seed is None else seed + round_index)
                log(f"round {round_index + 1}/{rounds} {result.stats.line(socket)} "
                    f"in {result.seconds:.1f} s")
                log(f"    coordinator counters: {json.dumps(result.delta)}")
                failures += [f"{socket}: {p}" for p in result.problems]
                if not handle.is_alive():
                    break
        fuzzer.close()
        failures += check_service(rig)
        log(f"after fuzzing: waves run by the clean groups: {rig.waves_run}, "
            f"coordinator alive: {handle.is_alive()}")
        rig.close()
    finally:
        ctx.destroy(linger=0)
        code = handle.shutdown(timeout=5.0)
        if code != 0:
            failures.append(f"coordinator exit code {code}:\n{handle.stderr_text()[-3000:]}")
    if atheris_seconds > 0:
        failures += run_atheris_child(atheris_seconds, engines, log)
    for failure in failures:
        log(f"FAIL {failure}")
    log("fuzz: OK" if not failures else f"fuzz: {len(failures)} problem(s)")
    return 0 if not failures else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fuzz",
        description="Fuzz all six sockets of one coordinator process, then check that a "
        "clean engine group still completes the handshake and runs waves.",
    )
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="total fuzzing time over all sockets (default 120)")
    parser.add_argument("--engines", type=int, default=2, help="ranks of the clean group")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (repeatable)")
    parser.add_argument("--atheris", type=float, default=0.0, metavar="SECONDS",
                        help="also run the in-process atheris pass this long (if installed)")
    parser.add_argument("--atheris-child", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # A SIGTERM (e.g. from `timeout`) unwinds like an exception, so every child
    # process this run started is still killed in its `finally`.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.atheris_child is not None:
        return run_atheris(args.atheris_child, args.engines)
    with contextlib.suppress(KeyboardInterrupt):
        return run(args.seconds, engines=args.engines, seed=args.seed,
                   atheris_seconds=args.atheris)
    return 130


if __name__ == "__main__":
    raise SystemExit(main())
