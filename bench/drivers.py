"""Load processes: simulated engines and frontends on raw pyzmq sockets.

Each class here lives in its own process (see `Worker`), talks vLLM 0.33
bytes to whatever target it is pointed at, and answers commands from the
orchestrator over a pipe. Latencies are taken with `time.perf_counter_ns` in
one process (the sender of the trigger also owns every receiving socket);
throughput runs stamp their start and end with the same clock, which on
Linux is CLOCK_MONOTONIC and therefore comparable between processes of one
machine. Sockets are plain synchronous pyzmq driven by `zmq.Poller`, so the
drivers cost as little as Python allows and are the same for every target.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import random
import resource
import threading
import time
import traceback
from collections import deque
from typing import Any

import msgspec
import zmq

import coordinator.protocol.vllm as vllm
from bench import wire

NOBLOCK = zmq.NOBLOCK
Again = zmq.Again
START = vllm.START_DP_WAVE
ADD = vllm.ADD
_any_decoder = msgspec.msgpack.Decoder()


# The open-file limits this process was started with, before `raise_fd_limit`.
ORIGINAL_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_fd_limit() -> None:
    """Use the hard limit on open files: 256 engines need about 1000 sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def new_context() -> zmq.Context[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 16384)
    return ctx


def _socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, addr: str,
            ident: bytes | None = None) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if ident is not None:
        sock.setsockopt(zmq.IDENTITY, ident)
    sock.connect(addr)
    return sock


def _drain(sock: zmq.Socket[bytes]) -> int:
    count = 0
    while True:
        try:
            sock.recv_multipart(NOBLOCK)
        except Again:
            return count
        count += 1


class DriverError(RuntimeError):
    pass


# ---- engines ------------------------------------------------------------------


class Engines:
    """A set of simulated engines (ranks) in this process, with their sockets."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], ranks: list[int],
                 engines: int) -> None:
        self.ctx = ctx
        self.ranks = ranks
        self.engines = engines
        self.xsub: list[zmq.Socket[bytes]] = []
        self.push: list[zmq.Socket[bytes]] = []
        self.dealer: list[zmq.Socket[bytes]] = []
        self.templates = [wire.StatsTemplate(rank) for rank in ranks]
        self.counters = [0] * len(ranks)

    # vLLM's start-up gate, without the handshake (how a peer is driven).
    def connect_gate(self, addresses: dict[str, str]) -> None:
        for rank in self.ranks:
            xsub = _socket(self.ctx, zmq.XSUB, addresses["back_publish"], wire.identity(rank))
            xsub.send(vllm.SUBSCRIBE)
            self.xsub.append(xsub)
            push = _socket(self.ctx, zmq.PUSH, addresses["back_output"])
            self.push.append(push)

    def wait_gate(self, timeout: float) -> None:
        waiting = set(range(len(self.ranks)))
        poller = zmq.Poller()
        for sock in self.xsub:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DriverError(f"{len(waiting)} engines saw no READY on back_publish "
                                  f"within {timeout} s")
            for sock, _ in poller.poll(int(left * 1000) + 1):
                index = self.xsub.index(sock)
                while True:
                    try:
                        frames = sock.recv_multipart(NOBLOCK)
                    except Again:
                        break
                    if frames[0] == vllm.READY:
                        waiting.discard(index)

    def handshake(self, addresses: dict[str, str], timeout: float) -> dict[str, Any]:
        """HELLO -> INIT -> greeting + subscribe -> READY gate -> READY -> ACCEPTED.

        Returns perf_counter_ns stamps of the first HELLO and of each engine's
        READY gate and ACCEPTED, for the handshake-scale scenario.
        """
        count = len(self.ranks)
        hs = [_socket(self.ctx, zmq.DEALER, addresses["handshake"], wire.identity(r))
              for r in self.ranks]
        poller = zmq.Poller()
        for sock in hs:
            poller.register(sock, zmq.POLLIN)
        index_of: dict[zmq.Socket[bytes], tuple[str, int]] = {
            sock: ("hs", i) for i, sock in enumerate(hs)}
        self.xsub = [None] * count  # type: ignore[list-item]
        self.push = [None] * count  # type: ignore[list-item]
        self.dealer = [None] * count  # type: ignore[list-item]
        gate_at: list[int | None] = [None] * count
        accepted_at: list[int | None] = [None] * count
        t_first = time.perf_counter_ns()
        for sock in hs:
            sock.send(wire.HELLO)
        deadline = time.monotonic() + timeout
        done = 0
        refusals: list[str] = []
        while done < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DriverError(f"handshake: {count - done} of {count} engines not accepted "
                                  f"within {timeout} s; refusals: {refusals[:3]}")
            for sock, _ in poller.poll(int(left * 1000) + 1):
                kind, i = index_of[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(NOBLOCK)
                    except Again:
                        break
                    now = time.perf_counter_ns()
                    if kind == "hs":
                        reply = vllm.decode_handshake_reply(frames[-1])
                        if isinstance(reply, vllm.EngineHandshakeMetadata):
                            self._on_init(i, reply, poller, index_of)
                        elif isinstance(reply, vllm.HandshakeAccepted):
                            if accepted_at[i] is None:
                                accepted_at[i] = now
                                done += 1
                        else:
                            refusals.append(reply.reason)
                            done += 1
                    elif kind == "xsub" and frames[0] == vllm.READY and gate_at[i] is None:
                        gate_at[i] = now
                        hs[i].send(wire.READY_HANDSHAKE)
        for sock in hs:
            sock.close(0)
        if refusals:
            raise DriverError(f"handshake refused: {refusals[:3]}")
        return {"t_first_hello_ns": t_first, "gate_ns": gate_at, "accepted_ns": accepted_at}

    def _on_init(self, i: int, init: vllm.EngineHandshakeMetadata, poller: zmq.Poller,
                 index_of: dict[zmq.Socket[bytes], tuple[str, int]]) -> None:
        rank = self.ranks[i]
        ident = wire.identity(rank)
        addrs = init.addresses
        dealer = _socket(self.ctx, zmq.DEALER, addrs.inputs[0], ident)
        dealer.send(wire.greeting(rank, self.engines))
        self.dealer[i] = dealer
        if addrs.coordinator_input is None or addrs.coordinator_output is None:
            raise DriverError("INIT carried no coordinator addresses")
        xsub = _socket(self.ctx, zmq.XSUB, addrs.coordinator_input, ident)
        xsub.send(vllm.SUBSCRIBE)
        self.xsub[i] = xsub
        self.push[i] = _socket(self.ctx, zmq.PUSH, addrs.coordinator_output)
        poller.register(xsub, zmq.POLLIN)
        index_of[xsub] = ("xsub", i)

    def flood(self, rate: float | None, duration: float) -> dict[str, Any]:
        """Send stats round-robin over this set's engines at `rate` msgs/s (None: flat out).

        Each engine's `num_waiting_reqs` carries its cumulative message count,
        so the monitor can read ingestion progress back from the
        coordinator's publishes; `step_counter` is the group step of the
        moment (`wire.lockstep_step`), the same for every rank.
        """
        pushes = self.push
        templates = self.templates
        counters = self.counters
        n = len(pushes)
        base = sum(counters)
        burst_cap = 64
        sent = 0
        i = 0
        clock = time.perf_counter
        t0 = clock()
        t_start_ns = time.perf_counter_ns()
        end = t0 + duration
        while True:
            now = clock()
            if now >= end:
                break
            if rate is None:
                burst = burst_cap
            else:
                burst = int((now - t0) * rate) - sent
                if burst <= 0:
                    time.sleep(max(0.0, min(0.0005, (sent + 1) / rate - (now - t0))))
                    continue
                burst = min(burst, burst_cap)
            step = wire.lockstep_step(time.perf_counter_ns())
            for _ in range(burst):
                counters[i] += 1
                pushes[i].send(templates[i].set_counter(counters[i], step))
                i += 1
                if i == n:
                    i = 0
            sent += burst
        t_end_ns = time.perf_counter_ns()
        return {"sent": sent, "base_sum": base, "final_sum": sum(counters),
                "t_start_ns": t_start_ns, "t_end_ns": t_end_ns}

    def close(self) -> None:
        for group in (self.xsub, self.push, self.dealer):
            for sock in group:
                if sock is not None:
                    sock.close(0)


# ---- scenario drivers (one per worker process) --------------------------------


def wake_triggers(seed: int, engines: int, count: int) -> list[int]:
    """The rank that reports start_wave for each of `count` wakes (shared by all workers)."""
    rng = random.Random(seed)
    return [rng.randrange(engines) for _ in range(count)]


class WakeTrigger:
    """Scenario 1, sending side: engines report start_wave, one every `gap_s`.

    The wakes are open-loop (a fixed schedule, no waiting for receivers), so
    the receiving engines can sit in other processes; `WakeReceivers` stamp
    arrivals with the same clock and the orchestrator pairs them by index.
    """

    def __init__(self, addresses: dict[str, str], engines: int) -> None:
        self.ctx = new_context()
        self.addresses = addresses
        self.engines = engines
        self.push: dict[int, zmq.Socket[bytes]] = {}
        self.wave = 0

    def prepare(self, triggers: list[int]) -> bool:
        for rank in set(triggers):
            if rank not in self.push:
                self.push[rank] = _socket(self.ctx, zmq.PUSH, self.addresses["back_output"])
        time.sleep(0.1)  # connections settle before the first timed send
        return True

    def fire(self, triggers: list[int], gap_s: float, first_wave: int) -> dict[str, Any]:
        clock = time.perf_counter
        sent_ns: list[int] = []
        waves: list[int] = []
        next_at = clock()
        for k, rank in enumerate(triggers):
            wave = first_wave + k
            message = wire.start_wave_report(rank, wave)
            while True:
                left = next_at - clock()
                if left <= 0:
                    break
                time.sleep(left if left > 0.0003 else 0)
            sent_ns.append(time.perf_counter_ns())
            self.push[rank].send(message)
            waves.append(wave)
            next_at += gap_s
        return {"sent_ns": sent_ns, "waves": waves}


class WakeReceivers:
    """Scenario 1, receiving side: a share of the engines, each stamping START_DP_WAVE.

    Sockets are read in turn with blocking receives rather than polled: every
    one of them is about to get the message, and polling hundreds of sockets
    costs more than the hop being measured.
    """

    def __init__(self, addresses: dict[str, str], ranks: list[int], engines: int) -> None:
        self.ctx = new_context()
        self.ranks = ranks
        self.engines = Engines(self.ctx, ranks, engines)
        self.engines.connect_gate(addresses)

    def wait_gate(self, timeout_s: float = 60.0) -> bool:
        self.engines.wait_gate(timeout_s)
        return True

    def record(self, triggers: list[int], first_wave: int, validate: bool,
               timeout_s: float = 2.0) -> dict[str, Any]:
        """Per wake: when this process's first and last non-trigger engine had it."""
        return record_wakes(self.ranks, self.engines.xsub, triggers, first_wave, validate,
                            timeout_s)


def record_wakes(ranks: list[int], xsub: list[zmq.Socket[bytes]], triggers: list[int],
                 first_wave: int, validate: bool, timeout_s: float = 2.0) -> dict[str, Any]:
    """Stamp START_DP_WAVE on each of `xsub` (one per rank, read in turn) for every wake.

    Per wake: when the first and the last engine other than the trigger had it.
    """
    for sock in xsub:
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    clock = time.perf_counter_ns
    first_ns: list[int | None] = []
    last_ns: list[int | None] = []
    bad = 0
    lost = 0
    for k, trigger in enumerate(triggers):
        t_first: int | None = None
        t_last: int | None = None
        payload = b""
        for rank, sock in zip(ranks, xsub, strict=True):
            try:
                frames = sock.recv_multipart()
                while frames[0] != START:  # e.g. a READY repeated for a late subscriber
                    frames = sock.recv_multipart()
            except Again:
                # Lost or very late: give up on this wake and the rest of the run
                # rather than wait out the timeout on every remaining socket.
                lost += 1
                break
            if rank == trigger:
                continue
            t = clock()
            if t_first is None:
                t_first = t
                payload = frames[-1]
            t_last = t
        first_ns.append(t_first)
        last_ns.append(t_last)
        if validate and payload and _wave_of(payload) != first_wave + k:
            bad += 1
        if lost:
            break
    for sock in xsub:
        sock.setsockopt(zmq.RCVTIMEO, -1)
        _drain(sock)
    return {"first_ns": first_ns, "last_ns": last_ns, "bad": bad, "lost": lost}


def _wave_of(payload: bytes) -> int | None:
    """The wave in a START_DP_WAVE payload (or in the report a floor forwarded)."""
    try:
        value = _any_decoder.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(value, list) and len(value) == 2:
        return int(value[0])
    if isinstance(value, list) and len(value) > 7:
        return int(value[7]) if value[7] is not None else None
    return None


class FirstRequestLoad:
    """Scenario 2: a frontend submits while paused; the chosen engine gets ADD, the rest START."""

    def __init__(self, addresses: dict[str, str], engines: int, payload_bytes: int = 1024
                 ) -> None:
        self.ctx = new_context()
        self.engines = Engines(self.ctx, list(range(engines)), engines)
        self.engines.handshake(addresses, 60.0)
        self.frontend = _socket(self.ctx, zmq.DEALER, addresses["frontend"])
        self.front_sub = _socket(self.ctx, zmq.XSUB, addresses["front_publish"])
        self.front_sub.send(vllm.SUBSCRIBE)
        self.payload = b"p" * payload_bytes
        self.wave = 0
        self.call_id = 0
        time.sleep(0.2)  # let the frontend subscription settle before measuring

    def run(self, count: int, sync: str, timeout_s: float = 1.0) -> dict[str, Any]:
        """`count` first requests, each into a paused group.

        The ADD is caught by polling the engines' input DEALERs (whichever
        engine the target chose); the wake is then read from every engine's
        XSUB in turn with blocking receives. Between requests rank 0 reports
        the wave complete and, with `sync="wave"`, the frontend waits for the
        `[nil, wave+1, false]` publish so the next request again meets a paused
        group (`sync="any"`: any publish, for the floor that forwards it raw).
        """
        eng = self.engines
        dealer_poller = zmq.Poller()
        dealer_index: dict[zmq.Socket[bytes], int] = {}
        for i, sock in enumerate(eng.dealer):
            dealer_poller.register(sock, zmq.POLLIN)
            dealer_index[sock] = i
        for sock in eng.xsub:
            sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        all_socks = [*eng.xsub, *eng.dealer, self.frontend, self.front_sub]
        clock = time.perf_counter_ns
        request_ns: list[int] = []
        wake_ns: list[int] = []
        total_ns: list[int] = []
        timeouts = 0
        not_woken = 0
        sync_failures = 0
        for _ in range(count):
            for sock in all_socks:
                _drain(sock)
            wave = self.wave
            self.call_id += 1
            request_id = f"first-{self.call_id}"
            header = wire.submit_header(self.call_id, request_id, wave)
            chosen = -1
            t_add = 0
            t_wake = 0
            ok = True
            t0 = clock()
            self.frontend.send_multipart([header, self.payload])
            for sock, _ in dealer_poller.poll(int(timeout_s * 1000)):
                frames = sock.recv_multipart()
                t_add = clock()
                if frames[0] == ADD:
                    chosen = dealer_index[sock]
                break
            if chosen < 0:
                ok = False
            else:
                for i, sock in enumerate(eng.xsub):
                    try:
                        frames = sock.recv_multipart()
                    except Again:
                        ok = False
                        break
                    if i != chosen:
                        t_wake = clock()
                    if frames[0] != START:
                        ok = False
            if ok:
                request_ns.append(t_add - t0)
                wake_ns.append(t_wake - t0)
                total_ns.append(max(t_add, t_wake) - t0)
            else:
                timeouts += 1
            reply = self._reply(timeout_s)
            if reply is not None and sync == "wave":
                decoded = _any_decoder.decode(reply)
                if not (isinstance(decoded, list) and decoded[0] == "submitted" and decoded[4]):
                    not_woken += 1
            self.frontend.send(wire.finished_header([request_id]))
            # Back to paused: rank 0 reports the wave complete.
            eng.push[0].send(wire.wave_complete_report(0, wave))
            if not self._synced(sync, wave + 1, timeout_s):
                sync_failures += 1
            self.wave = wave + 1
        for sock in eng.xsub:
            sock.setsockopt(zmq.RCVTIMEO, -1)
        return {"request_ns": request_ns, "wake_ns": wake_ns, "total_ns": total_ns,
                "timeouts": timeouts, "not_woken": not_woken, "sync_failures": sync_failures}

    def _reply(self, timeout_s: float) -> bytes | None:
        if self.frontend.poll(int(timeout_s * 1000)):
            return self.frontend.recv()
        return None

    def _synced(self, sync: str, wave: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.front_sub.poll(int(left * 1000) + 1):
                return False
            frame = self.front_sub.recv()
            if sync == "any":
                return True
            publish = vllm.decode_front_publish(frame)
            if publish.counts is None and publish.wave == wave and not publish.running:
                return True


class HandshakeLoad:
    """Scenarios 5 and 7: many engines handshake at once, then report stats."""

    def __init__(self, addresses: dict[str, str], engines: int) -> None:
        self.addresses = addresses
        self.ctx = new_context()
        self.engines = Engines(self.ctx, list(range(engines)), engines)

    def handshake(self, timeout_s: float = 60.0) -> dict[str, Any]:
        stamps = self.engines.handshake(self.addresses, timeout_s)
        t0 = stamps["t_first_hello_ns"]
        accepted = [t - t0 for t in stamps["accepted_ns"] if t is not None]
        gate = [t - t0 for t in stamps["gate_ns"] if t is not None]
        return {"all_ready_ns": max(accepted), "gate_ns": max(gate),
                "accepted_ns": sorted(accepted)}

    def flood(self, rate: float | None, duration: float) -> dict[str, Any]:
        return self.engines.flood(rate, duration)


class RankShare:
    """Scenarios `scale` and `cpu`: one process's share of a large handshaken group.

    Several shares, each in its own process, make one group. `handshake` is
    begun on every share before any is awaited: the READY gate opens only
    once every rank subscribed. Afterwards a share reports stats (`flood`),
    stamps wakes (`record`), or takes its requests in a background thread
    (`start_sink`); the thread owns the input DEALERs and XSUBs while it runs
    and `flood` touches only the PUSH sockets, so no socket is shared between
    threads.
    """

    def __init__(self, addresses: dict[str, str], ranks: list[int], engines: int) -> None:
        self.addresses = addresses
        self.ranks = ranks
        self.ctx = new_context()
        self.engines = Engines(self.ctx, ranks, engines)
        self.sink: threading.Thread | None = None
        self.stopping = False
        self.received = 0
        self.wakes = 0

    def handshake(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """HELLO to ACCEPTED for every rank of this share; perf_counter_ns stamps."""
        stamps = self.engines.handshake(self.addresses, timeout_s)
        return {"t_first_hello_ns": stamps["t_first_hello_ns"],
                "gate_ns": [t for t in stamps["gate_ns"] if t is not None],
                "accepted_ns": [t for t in stamps["accepted_ns"] if t is not None]}

    def flood(self, rate: float | None, duration: float) -> dict[str, Any]:
        return self.engines.flood(rate, duration)

    def record(self, triggers: list[int], first_wave: int, validate: bool,
               timeout_s: float = 2.0) -> dict[str, Any]:
        return record_wakes(self.ranks, self.engines.xsub, triggers, first_wave, validate,
                            timeout_s)

    def report_start_wave(self, index: int, wave: int) -> bool:
        """The share's `index`-th rank reports that it started `wave` (as a woken engine does)."""
        self.engines.push[index].send(wire.start_wave_report(self.ranks[index], wave))
        return True

    def start_sink(self) -> bool:
        self.stopping = False
        self.received = 0
        self.wakes = 0
        self.sink = threading.Thread(target=self._sink_loop, daemon=True)
        self.sink.start()
        return True

    def stop_sink(self) -> dict[str, Any]:
        self.stopping = True
        if self.sink is not None:
            self.sink.join()
            self.sink = None
        return {"received": self.received, "wakes": self.wakes}

    def sink_counts(self) -> dict[str, Any]:
        return {"received": self.received, "wakes": self.wakes}

    def _sink_loop(self) -> None:
        poller = zmq.Poller()
        for sock in (*self.engines.dealer, *self.engines.xsub):
            poller.register(sock, zmq.POLLIN)
        while not self.stopping:
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        frames = sock.recv_multipart(NOBLOCK)
                    except Again:
                        break
                    if frames[0] == ADD:
                        self.received += 1
                    elif frames[0] == START:
                        self.wakes += 1


class StatsLoad:
    """Scenarios 3 and 6: a share of the engines reporting stats, gate first."""

    def __init__(self, addresses: dict[str, str], ranks: list[int], engines: int) -> None:
        self.ctx = new_context()
        self.engines = Engines(self.ctx, ranks, engines)
        self.engines.connect_gate(addresses)

    def wait_gate(self, timeout_s: float = 60.0) -> bool:
        self.engines.wait_gate(timeout_s)
        return True

    def flood(self, rate: float | None, duration: float) -> dict[str, Any]:
        for sock in self.engines.xsub:
            _drain(sock)
        return self.engines.flood(rate, duration)


class Monitor:
    """A frontend's view of front_publish, recorded by a background thread."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.ctx = new_context()
        self.sub = _socket(self.ctx, zmq.XSUB, addresses["front_publish"])
        self.sub.send(vllm.SUBSCRIBE)
        self.records: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stopping = False
        self.thread = threading.Thread(target=self._record, daemon=True)
        self.thread.start()

    def _record(self) -> None:
        sub = self.sub
        while not self.stopping:
            if not sub.poll(100):
                continue
            while True:
                try:
                    frame = sub.recv(NOBLOCK)
                except Again:
                    break
                t = time.perf_counter_ns()
                with self.lock:
                    self.records.append((t, frame))

    def publishes(self, since_ns: int, until_ns: int | None = None) -> list[tuple[int, int]]:
        """`(t_ns, sum of waiting counts)` for each full publish in the window.

        The floor's single row carries its received-message count, and each
        engine's waiting count is its cumulative message count, so the sum is
        "messages ingested so far" for every target.
        """
        with self.lock:
            records = [r for r in self.records
                       if r[0] >= since_ns and (until_ns is None or r[0] <= until_ns)]
        out: list[tuple[int, int]] = []
        for t, frame in records:
            try:
                counts, _wave, _running = _any_decoder.decode(frame)
            except (msgspec.DecodeError, ValueError, TypeError):
                continue
            if counts is None:
                continue
            out.append((t, sum(int(row[0]) for row in counts)))
        return out

    def publish_sizes(self, since_ns: int, until_ns: int | None = None) -> list[list[int]]:
        """`[t_ns, bytes, rows]` of each full publish in the window."""
        with self.lock:
            records = [r for r in self.records
                       if r[0] >= since_ns and (until_ns is None or r[0] <= until_ns)]
        out: list[list[int]] = []
        for t, frame in records:
            try:
                counts, _wave, _running = _any_decoder.decode(frame)
            except (msgspec.DecodeError, ValueError, TypeError):
                continue
            if counts is not None:
                out.append([t, len(frame), len(counts)])
        return out

    def trim(self, before_ns: int) -> int:
        with self.lock:
            self.records = [r for r in self.records if r[0] >= before_ns]
            return len(self.records)

    def now_ns(self) -> int:
        return time.perf_counter_ns()


class EngineSink:
    """Scenario 4's engines: handshake, then take every request sent to them."""

    def __init__(self, addresses: dict[str, str], engines: int) -> None:
        self.ctx = new_context()
        self.engines = Engines(self.ctx, list(range(engines)), engines)
        self.engines.handshake(addresses, 60.0)
        self.stopping = False
        self.received = 0
        self.bytes = 0
        self.thread: threading.Thread | None = None

    def start(self) -> bool:
        self.stopping = False
        self.received = 0
        self.bytes = 0
        self.thread = threading.Thread(target=self._drain_loop, daemon=True)
        self.thread.start()
        return True

    def stop(self) -> dict[str, Any]:
        self.stopping = True
        if self.thread is not None:
            self.thread.join()
        return {"received": self.received, "bytes": self.bytes}

    def _drain_loop(self) -> None:
        poller = zmq.Poller()
        for sock in (*self.engines.dealer, *self.engines.xsub):
            poller.register(sock, zmq.POLLIN)
        while not self.stopping:
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        frames = sock.recv_multipart(NOBLOCK)
                    except Again:
                        break
                    if frames[0] == ADD:
                        self.received += 1
                        self.bytes += len(frames[-1])


class FrontendLoad:
    """Scenario 4's frontends: pipelined submits with 1 KB payloads, finished in batches."""

    def __init__(self, addresses: dict[str, str], frontends: int, tag: str = "fe") -> None:
        self.ctx = new_context()
        self.dealers = [_socket(self.ctx, zmq.DEALER, addresses["frontend"])
                        for _ in range(frontends)]
        self.tag = tag
        self.next_id = 0

    def run(self, duration: float, warmup: float, window: int = 128, payload_bytes: int = 1024,
            finished_batch: int = 256) -> dict[str, Any]:
        payload = b"r" * payload_bytes
        dealers = self.dealers
        poller = zmq.Poller()
        index_of = {}
        for f, sock in enumerate(dealers):
            poller.register(sock, zmq.POLLIN)
            index_of[sock] = f
        outstanding: list[deque[str]] = [deque() for _ in dealers]
        done: list[list[str]] = [[] for _ in dealers]
        tag = self.tag
        submit_header = wire.submit_header
        is_submitted = wire.is_submitted

        def submit(f: int) -> None:
            self.next_id += 1
            rid = f"{tag}{f}-{self.next_id}"
            dealers[f].send_multipart([submit_header(self.next_id, rid, 0), payload])
            outstanding[f].append(rid)

        t_start = time.perf_counter_ns()
        t_measure = t_start + int(warmup * 1e9)
        t_end = t_measure + int(duration * 1e9)
        for f in range(len(dealers)):
            for _ in range(window):
                submit(f)
        ok_window = 0
        errors = 0
        first_error = ""
        replies = 0
        now = time.perf_counter_ns()
        while now < t_end:
            events = poller.poll(100)
            for sock, _ in events:
                f = index_of[sock]
                while True:
                    try:
                        reply = sock.recv(NOBLOCK)
                    except Again:
                        break
                    replies += 1
                    rid = outstanding[f].popleft() if outstanding[f] else ""
                    if is_submitted(reply):
                        if now >= t_measure:
                            ok_window += 1
                        done[f].append(rid)
                        if len(done[f]) >= finished_batch:
                            sock.send(wire.finished_header(done[f]))
                            done[f] = []
                    else:
                        errors += 1
                        if not first_error:
                            first_error = repr(_any_decoder.decode(reply))[:300]
                    submit(f)
            now = time.perf_counter_ns()
        t_stop = now
        # Collect what is still in flight so the next repetition starts clean.
        deadline = time.monotonic() + 5.0
        while any(outstanding) and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                f = index_of[sock]
                while True:
                    try:
                        sock.recv(NOBLOCK)
                    except Again:
                        break
                    if outstanding[f]:
                        done[f].append(outstanding[f].popleft())
        for f, ids in enumerate(done):
            if ids:
                dealers[f].send(wire.finished_header(ids))
        return {"ok": ok_window, "seconds": (t_stop - t_measure) / 1e9, "errors": errors,
                "first_error": first_error, "replies": replies,
                "lost": sum(len(q) for q in outstanding)}


    def paced(self, rate: float, duration: float, payload_bytes: int = 1024,
              finished_batch: int = 256) -> dict[str, Any]:
        """Open-loop submits at `rate` per second over the DEALERs in turn, for `duration` s.

        A fixed schedule, not a window: the offered load stays what a busy API
        frontend sends whatever the coordinator does. Replies are read as
        they come and `finished` goes out for every `finished_batch` of them.
        """
        payload = b"r" * payload_bytes
        dealers = self.dealers
        count = len(dealers)
        poller = zmq.Poller()
        index_of = {}
        for f, sock in enumerate(dealers):
            poller.register(sock, zmq.POLLIN)
            index_of[sock] = f
        outstanding: list[deque[str]] = [deque() for _ in dealers]
        done: list[list[str]] = [[] for _ in dealers]
        ok = errors = 0
        first_error = ""

        def take(sock: zmq.Socket[bytes]) -> None:
            nonlocal ok, errors, first_error
            f = index_of[sock]
            while True:
                try:
                    reply = sock.recv(NOBLOCK)
                except Again:
                    return
                rid = outstanding[f].popleft() if outstanding[f] else ""
                if wire.is_submitted(reply):
                    ok += 1
                    done[f].append(rid)
                    if len(done[f]) >= finished_batch:
                        sock.send(wire.finished_header(done[f]))
                        done[f] = []
                else:
                    errors += 1
                    if not first_error:
                        first_error = repr(_any_decoder.decode(reply))[:300]

        clock = time.perf_counter
        sent = 0
        turn = 0
        t_start_ns = time.perf_counter_ns()
        t0 = clock()
        end = t0 + duration
        while True:
            now = clock()
            if now >= end:
                break
            due = min(64, int((now - t0) * rate) - sent)
            for _ in range(due):
                self.next_id += 1
                rid = f"{self.tag}{turn}-{self.next_id}"
                dealers[turn].send_multipart(
                    [wire.submit_header(self.next_id, rid, 0), payload])
                outstanding[turn].append(rid)
                turn = (turn + 1) % count
                sent += 1
            # At least 1 ms: a busy-polling generator would take a core from the target.
            wait_ms = max(1, min(5, int(((sent + 1) / rate - (clock() - t0)) * 1000)))
            for sock, _ in poller.poll(wait_ms):
                take(sock)
        t_end_ns = time.perf_counter_ns()
        deadline = time.monotonic() + 5.0
        while any(outstanding) and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                take(sock)
        for f, ids in enumerate(done):
            if ids:
                dealers[f].send(wire.finished_header(ids))
        return {"sent": sent, "ok": ok, "errors": errors, "first_error": first_error,
                "t_start_ns": t_start_ns, "t_end_ns": t_end_ns,
                "unanswered": sum(len(q) for q in outstanding)}


DRIVERS: dict[str, type] = {
    cls.__name__: cls
    for cls in (WakeTrigger, WakeReceivers, FirstRequestLoad, HandshakeLoad, RankShare,
                StatsLoad, Monitor, EngineSink, FrontendLoad)
}


# ---- worker processes -----------------------------------------------------------


def _worker_main(conn: multiprocessing.connection.Connection, name: str,
                 kwargs: dict[str, Any]) -> None:
    raise_fd_limit()
    try:
        driver = DRIVERS[name](**kwargs)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "__exit__":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(driver, method)(**args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class Worker:
    """One driver object in its own process; methods are called over a pipe."""

    def __init__(self, name: str, timeout: float = 120.0, **kwargs: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = name
        self.process = ctx.Process(target=_worker_main, args=(child, name, kwargs), daemon=True)
        self.process.start()
        child.close()
        self._busy = False
        self._take(timeout)

    def _take(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            self.kill()
            raise DriverError(f"{self.name}: no answer within {timeout} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise DriverError(f"{self.name}: worker process died") from None
        if status != "ok":
            raise DriverError(f"{self.name} failed:\n{value}")
        return value

    def begin(self, method: str, **args: Any) -> None:
        self.conn.send((method, args))
        self._busy = True

    def answered(self) -> bool:
        """True once the call begun with `begin` has an answer (or the worker died)."""
        return self.conn.poll(0)

    def end(self, timeout: float = 120.0) -> Any:
        self._busy = False
        return self._take(timeout)

    def call(self, method: str, timeout: float = 120.0, **args: Any) -> Any:
        self.begin(method, **args)
        return self.end(timeout)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                if not self._busy:
                    self.conn.send(("__exit__", {}))
                    self.conn.poll(2.0)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(1.0)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
