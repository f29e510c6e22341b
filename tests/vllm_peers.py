"""Raw vLLM 0.33-shaped peers: plain pyzmq sockets and msgpack built from dicts and lists.

Nothing here imports `coordinator.protocol`. Every message is built with
`msgspec.msgpack.encode` from plain Python values laid out the way vLLM 0.33
lays them out (map keys in dataclass field order, array structs in field
order), so a bug in the project's codecs cannot hide itself in a test that
talks through these helpers.

Socket roles, as a stock engine or front-end uses them:

* `RawEngine`: DEALER on `handshake` (identity = rank as 2 little-endian
  bytes), DEALER on `dispatch` (same identity), XSUB on `back_publish`, PUSH
  on `back_output`.
* `RawFrontend`: DEALER on `frontend` (this project's protocol: one msgpack
  array per message, tag first) and XSUB on `front_publish`.

Every wait is bounded: receive helpers take a timeout and return None (or
raise `AssertionError` for the `expect_*` variants) instead of blocking.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import zmq

pack = msgspec.msgpack.encode


def unpack(buf: bytes) -> Any:
    return msgspec.msgpack.decode(buf)


# ---- fixed bytes -----------------------------------------------------------

ADD = b"\x00"
ABORT = b"\x01"
START_DP_WAVE = b"\x02"
UTILITY = b"\x03"
READY = b"READY"
SUBSCRIBE = b"\x01"
UNSUBSCRIBE = b"\x00"

IDENTITY_ERROR_PREFIX = "coordinator requires a Python-compatible two-byte engine id, got "


def identity(rank: int) -> bytes:
    """A vLLM engine's ZMQ identity: its global DP rank as two little-endian bytes."""
    return rank.to_bytes(2, "little")


# ---- handshake (H1) --------------------------------------------------------


def hello_payload(*, local: bool = True, headless: bool = False, **extra: Any) -> bytes:
    """vLLM's HELLO: a plain dict, keys status, local, headless (then any extras)."""
    return pack({"status": "HELLO", "local": local, "headless": headless, **extra})


def ready_payload(
    *,
    local: bool = True,
    headless: bool = False,
    parallel_config_hash: str | None = None,
    **extra: Any,
) -> bytes:
    """vLLM's handshake READY; `parallel_config_hash` is present only when dp > 1."""
    msg: dict[str, Any] = {"status": "READY", "local": local, "headless": headless}
    if parallel_config_hash is not None:
        msg["parallel_config_hash"] = parallel_config_hash
    msg.update(extra)
    return pack(msg)


def error_reply(reason: str) -> bytes:
    return pack({"status": "ERROR", "reason": reason})


ACCEPTED_REPLY = pack({"status": "ACCEPTED"})


def init_payload(addresses: dict[str, Any], parallel_config: dict[str, Any]) -> bytes:
    """INIT as vLLM's launcher encodes `EngineHandshakeMetadata` (dataclass -> map)."""
    ordered = {
        "inputs": addresses["inputs"],
        "outputs": addresses["outputs"],
        "coordinator_input": addresses.get("coordinator_input"),
        "coordinator_output": addresses.get("coordinator_output"),
        "frontend_stats_publish_address": addresses.get("frontend_stats_publish_address"),
    }
    return pack({"addresses": ordered, "parallel_config": parallel_config})


# ---- engine greeting (F1) --------------------------------------------------


def ready_response(
    rank: int,
    dp_size: int,
    *,
    dp_stats_address: str | None = None,
    coordinator_input_address: str | None = None,
    coordinator_output_address: str | None = None,
) -> dict[str, Any]:
    """vLLM 0.33 `EngineCoreReadyResponse` as a map: 28 keys in field order."""
    return {
        "max_model_len": 4096,
        "num_gpu_blocks": 8192,
        "block_size": 16,
        "dp_stats_address": dp_stats_address,
        "dtype": "bfloat16",
        "vllm_version": "0.33.0",
        "world_size": 1,
        "data_parallel_size": dp_size,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": rank,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "instance_id": f"raw-engine-{rank}",
        "supports_lora": False,
        "max_loras": 0,
        "mamba_block_size": None,
        "kv_cache_size_tokens": 131072,
        "kv_cache_max_concurrency": 32.0,
        "kv_events_config": None,
        "weight_transfer_backend": None,
        "enable_sleep_mode": False,
        "supports_draft_weight_updates": False,
        "effective_attention_block_size": 16,
        "coord_store_port": 0,
        "coordinator_input_address": coordinator_input_address,
        "coordinator_output_address": coordinator_output_address,
    }


# ---- engine outputs (C2) ---------------------------------------------------


def prefix_cache_stats() -> dict[str, Any]:
    """vLLM 0.33 `PrefixCacheStats` defaults: 8 keys in field order."""
    return {
        "reset": False,
        "requests": 0,
        "queries": 0,
        "hits": 0,
        "preempted_requests": 0,
        "preempted_queries": 0,
        "preempted_hits": 0,
        "hits_by_source": {},
    }


def scheduler_stats(
    *,
    running: int = 0,
    waiting: int = 0,
    kv_cache_usage: float = 0.0,
    step: int = 0,
    wave: int = 0,
) -> dict[str, Any]:
    """vLLM 0.33 `SchedulerStats` as an engine publishes it: 18 keys in field order."""
    return {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": {},
        "step_counter": step,
        "current_wave": wave,
        "kv_cache_usage": kv_cache_usage,
        "iteration_details": None,
        "prefix_cache_stats": prefix_cache_stats(),
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        "waiting_lora_adapters": {},
        "running_lora_adapters": {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


def engine_outputs_list(
    engine_index: int,
    *,
    stats: dict[str, Any] | None = None,
    timestamp: float = 0.0,
    wave_complete: int | None = None,
    start_wave: int | None = None,
    outputs: Sequence[Any] = (),
    utility_output: Any = None,
    finished_requests: Any = None,
    weight_version: str | None = None,
) -> list[Any]:
    """vLLM 0.33 `EngineCoreOutputs` as a 9-element array, in field order."""
    return [
        engine_index,
        list(outputs),
        stats,
        timestamp,
        utility_output,
        finished_requests,
        wave_complete,
        start_wave,
        weight_version,
    ]


def engine_outputs(engine_index: int, **fields: Any) -> bytes:
    return pack(engine_outputs_list(engine_index, **fields))


def stats_report(
    engine_index: int,
    *,
    waiting: int = 0,
    running: int = 0,
    kv_cache_usage: float = 0.0,
    step: int = 0,
    wave: int = 0,
    timestamp: float = 1234.5,
) -> bytes:
    """One stats message as vLLM's `_maybe_publish_request_counts` sends it."""
    stats = scheduler_stats(
        running=running, waiting=waiting, kv_cache_usage=kv_cache_usage, step=step, wave=wave
    )
    return engine_outputs(engine_index, stats=stats, timestamp=timestamp)


# ---- coordinator -> engines (C3) and -> front-ends (C1) --------------------


def start_dp_wave_frames(wave: int, exclude: int | None) -> list[bytes]:
    return [START_DP_WAVE, pack([wave, exclude])]


def wave_publish(wave: int, running: bool) -> bytes:
    """`[nil, wave, running]`: the publish sent at once on a wave change."""
    return pack([None, wave, running])


def full_publish(rows: Iterable[tuple[int, int, float]], wave: int, running: bool) -> bytes:
    """`[counts, wave, running]` with 3-wide rows, kv as float64."""
    return pack([[[w, r, float(kv)] for w, r, kv in rows], wave, running])


def is_wave_publish(buf: bytes) -> bool:
    # [nil, wave, running]: fixarray(3) then nil.
    return buf[:2] == b"\x93\xc0"


def scale_elastic_ep(n: int) -> bytes:
    return pack(["SCALE_ELASTIC_EP", n])


# ---- socket helpers ----------------------------------------------------------


def recv_frames(sock: zmq.Socket[bytes], timeout: float) -> list[bytes] | None:
    """One multipart message within `timeout` seconds, or None."""
    if sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
        return sock.recv_multipart()
    return None


def is_lease_probe(frames: Sequence[bytes]) -> bool:
    """The coordinator's liveness probe on `dispatch`: an ABORT of no request ids.

    A vLLM engine aborts nothing on it; for the coordinator, a send that fails
    means the rank's connection is gone.
    """
    return len(frames) == 2 and frames[0] == ABORT and frames[1] == pack([])


def drain(sock: zmq.Socket[bytes], duration: float) -> list[list[bytes]]:
    """Everything that arrives on `sock` during `duration` seconds."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + duration
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return got
        frames = recv_frames(sock, left)
        if frames is not None:
            got.append(frames)


def wait_until(
    predicate: Callable[[], Any], *, timeout: float = 5.0, interval: float = 0.01, what: str = ""
) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


def _socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    address: str,
    *,
    ident: bytes | None = None,
    linger: int = 0,
) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger)
    if ident is not None:
        sock.setsockopt(zmq.IDENTITY, ident)
    sock.connect(address)
    return sock


class RawEngine:
    """One vLLM-shaped engine made of raw sockets; each step is explicit.

    `ident` overrides the DEALER identity (None keeps vLLM's two-byte rank;
    pass `RawEngine.NO_IDENTITY` to leave it unset so libzmq's ROUTER makes one up).
    """

    NO_IDENTITY = b""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        addresses: dict[str, str],
        rank: int,
        *,
        ident: bytes | None = None,
        dp_size: int = 1,
        handshake: bool = True,
    ) -> None:
        self.ctx = ctx
        self.addresses = addresses
        self.rank = rank
        self.dp_size = dp_size
        self.identity = identity(rank) if ident is None else ident
        self._ident_opt = None if self.identity == self.NO_IDENTITY else self.identity
        self.handshake: zmq.Socket[bytes] | None = None
        if handshake:
            self.handshake = _socket(ctx, zmq.DEALER, addresses["handshake"], ident=self._ident_opt)
        self.dispatch: zmq.Socket[bytes] | None = None
        self.sub: zmq.Socket[bytes] | None = None
        self.push: zmq.Socket[bytes] | None = None
        self.init: dict[str, Any] | None = None

    # -- handshake socket --

    def send_handshake(self, *frames: bytes) -> None:
        assert self.handshake is not None
        self.handshake.send_multipart(list(frames))

    def recv_handshake(self, timeout: float = 5.0) -> bytes | None:
        assert self.handshake is not None
        frames = recv_frames(self.handshake, timeout)
        if frames is None:
            return None
        assert len(frames) == 1, f"handshake reply must be one frame, got {frames!r}"
        return frames[0]

    def expect_handshake(self, timeout: float = 5.0) -> bytes:
        reply = self.recv_handshake(timeout)
        assert reply is not None, f"rank {self.rank}: no handshake reply within {timeout} s"
        return reply

    def hello(self, *, local: bool = True, headless: bool = False, **extra: Any) -> dict[str, Any]:
        """Send HELLO and return the decoded INIT (asserting it is one)."""
        self.send_handshake(hello_payload(local=local, headless=headless, **extra))
        raw = self.expect_handshake()
        init = unpack(raw)
        assert isinstance(init, dict) and "addresses" in init, f"not an INIT: {init!r}"
        self.init = init
        return init

    def send_ready(self, parallel_config_hash: str | None = None, **extra: Any) -> None:
        self.send_handshake(ready_payload(parallel_config_hash=parallel_config_hash, **extra))

    def ready(self, parallel_config_hash: str | None = None, **extra: Any) -> bytes:
        self.send_ready(parallel_config_hash, **extra)
        return self.expect_handshake()

    def close_handshake(self) -> None:
        """As a vLLM engine does after READY: the handshake socket goes away."""
        if self.handshake is not None:
            self.handshake.close(0)
            self.handshake = None

    # -- data plane --

    def connect_plane(self) -> None:
        """Connect dispatch, back_publish and back_output as INIT (or the address file) says."""
        if self.init is not None:
            addrs = self.init["addresses"]
            dispatch = addrs["inputs"][0]
            coord_in = addrs["coordinator_input"]
            coord_out = addrs["coordinator_output"]
        else:
            dispatch = self.addresses["dispatch"]
            coord_in = self.addresses["back_publish"]
            coord_out = self.addresses["back_output"]
        self.dispatch = _socket(self.ctx, zmq.DEALER, dispatch, ident=self._ident_opt)
        self.sub = _socket(self.ctx, zmq.XSUB, coord_in, ident=self._ident_opt)
        self.push = _socket(self.ctx, zmq.PUSH, coord_out)

    def subscribe(self) -> None:
        assert self.sub is not None
        self.sub.send(SUBSCRIBE)

    def greet(self, payload: bytes | None = None) -> None:
        assert self.dispatch is not None
        if payload is None:
            payload = pack(ready_response(self.rank, self.dp_size))
        self.dispatch.send(payload)

    def recv_publish(self, timeout: float) -> list[bytes] | None:
        assert self.sub is not None
        return recv_frames(self.sub, timeout)

    def expect_publish(self, timeout: float = 5.0) -> list[bytes]:
        frames = self.recv_publish(timeout)
        assert frames is not None, f"rank {self.rank}: nothing on back_publish in {timeout} s"
        return frames

    def recv_dispatch(self, timeout: float, *, skip_probes: bool = True) -> list[bytes] | None:
        """The next message on `dispatch` within `timeout` seconds, or None.

        The coordinator probes a quiet rank's connection with an empty ABORT
        (`is_lease_probe`) whenever its lease timer says so, which can be just
        before the message a test waits for; those are skipped unless
        `skip_probes` is False.
        """
        assert self.dispatch is not None
        deadline = time.monotonic() + timeout
        while True:
            frames = recv_frames(self.dispatch, max(0.0, deadline - time.monotonic()))
            if frames is None or not skip_probes or not is_lease_probe(frames):
                return frames

    def report(self, payload: bytes) -> None:
        assert self.push is not None
        self.push.send(payload)

    def close(self) -> None:
        for sock in (self.handshake, self.dispatch, self.sub, self.push):
            if sock is not None:
                sock.close(0)
        self.handshake = self.dispatch = self.sub = self.push = None


class RawFrontend:
    """This project's frontend protocol on a raw DEALER, plus an XSUB on front_publish."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], addresses: dict[str, str]) -> None:
        self.ctx = ctx
        self.addresses = addresses
        self.dealer = _socket(ctx, zmq.DEALER, addresses["frontend"])
        self.sub: zmq.Socket[bytes] | None = None
        self._call_id = 0

    def next_call_id(self) -> int:
        self._call_id += 1
        return self._call_id

    def send(self, *frames: bytes) -> None:
        self.dealer.send_multipart(list(frames))

    def recv(self, timeout: float = 5.0) -> list[Any]:
        frames = recv_frames(self.dealer, timeout)
        assert frames is not None, f"no reply on frontend within {timeout} s"
        assert len(frames) == 1, f"frontend reply must be one frame, got {frames!r}"
        reply = unpack(frames[0])
        assert isinstance(reply, list)
        return reply

    def call(self, header: list[Any], *payload: bytes, timeout: float = 5.0) -> list[Any]:
        """Send one request and return the reply that echoes its call id."""
        self.send(pack(header), *payload)
        call_id = header[1]
        deadline = time.monotonic() + timeout
        while True:
            reply = self.recv(max(0.0, deadline - time.monotonic()))
            if len(reply) > 1 and reply[1] == call_id:
                return reply

    def state(self) -> dict[str, Any]:
        """The coordinator's group state: send ["state", id], get ["state", id, {...}]."""
        reply = self.call(["state", self.next_call_id()])
        assert reply[0] == "state", reply
        state = reply[2]
        assert isinstance(state, dict)
        return state

    def counters(self) -> dict[str, int]:
        counters = self.state()["counters"]
        assert isinstance(counters, dict)
        return counters

    def register(
        self, client_index: int, output_address: str, input_address: str | None = None
    ) -> list[Any]:
        header: list[Any] = ["register", self.next_call_id(), client_index, output_address]
        if input_address is not None:
            header.append(input_address)
        return self.call(header)

    def submit(self, request_id: str, payload: bytes, *, wave: int = 0,
               dp_rank: int | None = None) -> list[Any]:
        return self.call(["submit", self.next_call_id(), request_id, wave, dp_rank], payload)

    # -- front_publish (C1) --

    def subscribe_publishes(self) -> None:
        self.sub = _socket(self.ctx, zmq.XSUB, self.addresses["front_publish"])
        self.sub.send(SUBSCRIBE)

    def recv_publish(self, timeout: float) -> bytes | None:
        assert self.sub is not None
        frames = recv_frames(self.sub, timeout)
        if frames is None:
            return None
        assert len(frames) == 1, f"publishes are one frame (Rust front-end rule), got {frames!r}"
        return frames[0]

    def next_full_publish(self, timeout: float = 3.0) -> bytes:
        """Skip wave-only publishes; return the next `[counts, wave, running]`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            buf = self.recv_publish(max(0.0, left))
            assert buf is not None, f"no full publish within {timeout} s"
            if not is_wave_publish(buf):
                return buf

    def drain_publishes(self, duration: float) -> list[tuple[float, bytes]]:
        """(arrival time, bytes) of every publish during `duration` seconds."""
        got: list[tuple[float, bytes]] = []
        deadline = time.monotonic() + duration
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return got
            buf = self.recv_publish(left)
            if buf is not None:
                got.append((time.monotonic(), buf))

    def send_upstream(self, *frames: bytes) -> None:
        """Raw bytes up the XSUB (how a vLLM front-end sends SCALE_ELASTIC_EP)."""
        assert self.sub is not None
        self.sub.send_multipart(list(frames))

    def close(self) -> None:
        self.dealer.close(0)
        if self.sub is not None:
            self.sub.close(0)


# ---- whole flows ---------------------------------------------------------------


def open_gate(
    ctx: zmq.Context[zmq.Socket[bytes]], addresses: dict[str, str], count: int,
    *, timeout: float = 5.0
) -> list[RawEngine]:
    """Subscribe `count` engines on back_publish (no handshake) and wait for READY on each.

    For wave-plane tests: as in vLLM, the gate counts subscriptions only.
    """
    engines = []
    for rank in range(count):
        engine = RawEngine(ctx, addresses, rank, dp_size=count, handshake=False)
        engine.connect_plane()
        engines.append(engine)
    for engine in engines:
        engine.subscribe()
    for engine in engines:
        assert engine.expect_publish(timeout) == [READY]
    return engines


def handshake_group(
    ctx: zmq.Context[zmq.Socket[bytes]],
    addresses: dict[str, str],
    ranks: Sequence[int],
    *,
    dp_size: int,
    parallel_config_hash: str | None = "cfg-hash-1",
    rng: random.Random | None = None,
    engine_ids: dict[int, str] | None = None,
) -> list[RawEngine]:
    """Run the full vLLM startup for `ranks` (in a shuffled order if `rng` is given)."""
    order = list(ranks)
    if rng is not None:
        rng.shuffle(order)
    engines = {rank: RawEngine(ctx, addresses, rank, dp_size=dp_size) for rank in ranks}
    for rank in order:
        extra = {"engine_id": engine_ids[rank]} if engine_ids and rank in engine_ids else {}
        engines[rank].hello(**extra)
        engines[rank].connect_plane()
    if rng is not None:
        rng.shuffle(order)
    for rank in order:
        engines[rank].subscribe()
        engines[rank].greet()
    for rank in order:
        assert engines[rank].expect_publish() == [READY]
    for rank in order:
        assert engines[rank].ready(parallel_config_hash) == ACCEPTED_REPLY
    return [engines[rank] for rank in ranks]


def flood_stats(address: str, engine_index: int, duration: float, sent: Any) -> None:
    """Send changing stats reports as fast as possible for `duration` seconds.

    Runs in a child process (multiprocessing, spawn) so the flood cannot steal
    the test process's time; `sent` is a shared `multiprocessing.Value` that
    receives the number of messages sent.
    """
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(address)
    count = 0
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline:
            for _ in range(64):
                count += 1
                push.send(stats_report(engine_index, waiting=count % 7, running=count % 5,
                                       kv_cache_usage=(count % 4) / 4, step=count))
    finally:
        sent.value = count
        push.close(0)
        ctx.term()
