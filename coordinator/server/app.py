"""The coordinator process: six sockets around the sans-IO core.

Each socket has one handler that turns frames into core events and core actions
back into frames. Rules (waves, membership, balancing, publish cadence) live in
`coordinator.core`; this module only decodes, asks the core, and sends. Every
send is NOBLOCK and every handler is synchronous, so nothing a peer does can
stall the loop, and a handler's exception is logged and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import random
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

import coordinator.protocol.vllm as vllm
from coordinator.core.balancer import BalancePolicy, LoadTable, make_policy
from coordinator.core.membership import (
    Accepted,
    EngineLease,
    Membership,
    RankChanged,
    RankState,
    Refused,
)
from coordinator.core.persisted import SavedFrontend, SavedLease, SavedState
from coordinator.core.publishing import PublishSchedule
from coordinator.core.recorder import (
    KIND_MEMBERSHIP,
    KIND_REFUSAL,
    KIND_WAKE,
    KIND_WATCHDOG,
    KIND_WAVE,
    FlightRecorder,
    WaveTimeline,
)
from coordinator.core.watchdog import HangWatchdog
from coordinator.core.waves import BroadcastStartWave, PublishWave, WaveAction, WaveState
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import identity_to_rank, rank_to_identity
from coordinator.security import CurveServer
from coordinator.server.config import ServerConfig
from coordinator.server.http import HttpEndpoints, ObservedState, RankView
from coordinator.server.statefile import load_state, save_state
from coordinator.server.transport import (
    FrameReader,
    RateLimitedLog,
    bind_socket,
    make_endpoint,
    new_ipc_dir,
    write_address_file,
)

log = logging.getLogger("coordinator.server")


@dataclass
class FrontendPeer:
    identity: bytes
    client_index: int
    output_address: str
    input_address: str | None


@dataclass(slots=True)
class InFlight:
    rank: int
    frontend: bytes


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc
    return trim


_malloc_trim = _load_malloc_trim()


def release_free_memory() -> None:
    """Give memory freed after a burst back to the OS (glibc keeps it otherwise:
    a backlog of stats messages can leave the process at twice its working size)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def free_tcp_ports(host: str, count: int) -> list[int]:
    """Ports free on `host` right now (for the torch DP meeting point in INIT)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class CoordinatorServer:
    """Owns the sockets and the core state of one coordinator process."""

    def __init__(self, config: ServerConfig, *, clock: Callable[[], float] = time.monotonic):
        config.validate()
        self.config = config
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.membership = Membership(
            rank_start=config.rank_start,
            rank_count=config.engines,
            lease_ttl_s=config.lease_ttl_s,
            handshake_ttl_s=config.handshake_timeout_s,
        )
        self.waves = WaveState(lockstep=config.lockstep)
        self.loads = LoadTable(config.rank_start + config.engines)
        self.policy: BalancePolicy = make_policy(config.policy, random.Random())
        self.schedule = PublishSchedule(
            min_interval_s=config.publish_interval_s,
            heartbeat_s=config.heartbeat_s,
            first_publish_delay_s=config.first_publish_delay_s,
        )
        self.frontends: dict[int, FrontendPeer] = {}
        self.in_flight: dict[str, InFlight] = {}
        self.in_flight_by_rank: Counter[int] = Counter()
        self.pending_inits: dict[int, bytes] = {}
        self.gate_subscriptions = 0
        self.gate_open = False
        self.shutting_down = False
        self.addresses: dict[str, str] = {}
        self._ipc_dir: str | None = None
        self._owns_ipc_dir = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._stats_dirty = asyncio.Event()
        self._ratelog = RateLimitedLog(log, interval_s=config.log_interval_s, clock=clock)
        self._parallel_config: dict[str, int | str | list[int]] = {}
        self._publish_requested = False
        self._inits_sent = False
        now = clock()
        self.recorder = FlightRecorder(config.recorder_size)
        self.watchdog = HangWatchdog(stall_after_s=config.watchdog_stall_s or 30.0)
        self.timeline = WaveTimeline(now=now)
        self.dispatched_by_rank: Counter[int] = Counter()
        self.http: HttpEndpoints | None = None
        self.curve: CurveServer | None = None
        self._recorder_json: tuple[int, list[dict[str, object]]] = (0, [])
        self._state_dirty = False
        self._serving = False
        self._held_wake: list[bytes] | None = None
        self._readers: dict[str, FrameReader] = {}
        self._last_http_update = 0.0
        self._http_push_scheduled = False
        self._row_width = 2 if config.vllm_compat == "legacy" else 3

    # ---- setup and teardown -------------------------------------------------

    def bind(self) -> dict[str, str]:
        """Bind all six sockets, then write the address file; return the endpoints."""
        cfg = self.config
        if cfg.host is None:
            if cfg.ipc_dir is not None:
                os.makedirs(cfg.ipc_dir, exist_ok=True)
                self._ipc_dir = cfg.ipc_dir
            else:
                self._ipc_dir = new_ipc_dir()
                self._owns_ipc_dir = True
        ipc_dir = self._ipc_dir or ""
        self._ctx = zmq.Context()
        limit = cfg.max_message_bytes
        configure = None
        if cfg.curve_secret_key is not None and cfg.curve_clients_dir is not None:
            self.curve = CurveServer(self._ctx, cfg.curve_secret_key, cfg.curve_clients_dir)
            self.curve.start()
            configure = self.curve.configure_socket
        specs: list[tuple[str, int, list[tuple[int, int]]]] = [
            # No ROUTER_HANDOVER here: it would cut off an engine mid-handshake whenever a
            # second process claims its rank, losing the first one's READY. The second is
            # then refused by libzmq itself, silently (see docs/vllm.md).
            # Heartbeats drop a half-open tcp connection (a host that died mid-handshake)
            # that would otherwise keep the rank's identity and turn its restart away.
            ("handshake", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), *self._heartbeat_options()]),
            ("dispatch", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1),
                                      (zmq.SNDHWM, 0), *self._heartbeat_options()]),
            ("back_output", zmq.PULL, [(zmq.RCVHWM, 0)]),
            ("back_publish", zmq.XPUB, [(zmq.XPUB_VERBOSE, 1)]),
            ("front_publish", zmq.XPUB, [(zmq.XPUB_VERBOSE, 1)]),
            ("frontend", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1)]),
        ]
        try:
            for index, (key, kind, options) in enumerate(specs):
                port = cfg.port_base + index if cfg.port_base is not None else 0
                endpoint = cfg.bind_overrides.get(key) or make_endpoint(
                    key, host=cfg.host, ipc_dir=ipc_dir, port=port
                )
                sock, resolved = bind_socket(
                    self._ctx, kind, endpoint, max_message_bytes=limit, options=options,
                    configure=configure if endpoint.startswith("tcp://") else None,
                )
                self._sockets[key] = sock
                self.addresses[key] = resolved
        except zmq.ZMQError:
            self.close()
            raise
        self._parallel_config = self._build_parallel_config()
        if cfg.state_file is not None:
            self._restore_state(cfg.state_file)
        if cfg.metrics_port is not None:
            self.http = HttpEndpoints(cfg.metrics_host, cfg.metrics_port, clock=self.clock)
            port = self.http.start()
            log.info("metrics and health endpoints on http://%s:%d/", cfg.metrics_host, port)
        if cfg.addr_file:
            write_address_file(cfg.addr_file, self.addresses)
        return dict(self.addresses)

    def _heartbeat_options(self) -> list[tuple[int, int]]:
        """ZMTP heartbeats: a tcp peer that stops answering is disconnected, which
        turns a silent network failure into a failed probe within the lease TTL."""
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        return [(zmq.HEARTBEAT_IVL, max(100, ttl_ms // 4)), (zmq.HEARTBEAT_TIMEOUT, ttl_ms)]

    def _build_parallel_config(self) -> dict[str, int | str | list[int]]:
        """The torch DP meeting point every rank must share (lockstep mode only).

        By default rank 0 is assumed to run on the coordinator's host, as with vLLM's
        rank-0 launcher: free ports are found there. With --master-ip the meeting
        point is elsewhere, so its port must be given, and the spare ports are the
        five above it (the same list for every rank).
        """
        cfg = self.config
        if not cfg.lockstep:
            return {}
        if cfg.master_ip is not None:
            host = cfg.master_ip
            master_port = cfg.master_port if cfg.master_port is not None else 0
            # Every rank must get the same spare ports; left empty, a rank could pick
            # its own local ones.
            ports = list(cfg.master_port_list) or [master_port + i for i in range(1, 6)]
        else:
            host = cfg.host if cfg.host not in (None, "0.0.0.0", "::") else "127.0.0.1"
            found = free_tcp_ports(host, 6)
            master_port = cfg.master_port if cfg.master_port is not None else found[0]
            ports = list(cfg.master_port_list) or found[1:]
        payload: dict[str, int | str | list[int]] = {
            "data_parallel_master_ip": host,
            "data_parallel_master_port": master_port,
            "_data_parallel_master_port_list": ports,
            "data_parallel_size": cfg.rank_start + cfg.engines,
        }
        if cfg.coord_store_port is not None:
            payload["_coord_store_port"] = cfg.coord_store_port
        return payload

    def close(self) -> None:
        if self.config.state_file is not None and self._serving:
            self.save_state(durable=True)  # only a process that served may speak for it
        if self.http is not None:
            self.http.stop()
            self.http = None
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
        if self.curve is not None:
            self.curve.stop()  # before term(): the ZAP thread holds a socket
            self.curve = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for endpoint in self.addresses.values():
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint[len("ipc://"):])
        if self._ipc_dir is not None and self._owns_ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self.config.addr_file:
            with contextlib.suppress(OSError):
                os.unlink(self.config.addr_file)

    def sock(self, key: str) -> zmq.Socket[bytes]:
        return self._sockets[key]

    # ---- the loop -----------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set. Call `bind()` first."""
        self._serving = True
        # Everything allocated so far lives for the whole process: keep it out of the
        # collector's way, or each full collection costs milliseconds on the wake path.
        gc.collect()
        gc.freeze()
        if self._state_dirty:
            self.save_state()
        self._push_observed(self.clock(), force=True)
        handlers: dict[str, Callable[[list[bytes]], None]] = {
            "handshake": self.on_handshake,
            "dispatch": self.on_dispatch,
            "back_output": self.on_back_output,
            "back_publish": self.on_back_publish,
            "front_publish": self.on_front_upstream,
            "frontend": self.on_frontend,
        }
        self._readers = {
            key: FrameReader(self._sockets[key], handler, name=key,
                             on_error=self._handler_failed)
            for key, handler in handlers.items()
        }
        tasks = [asyncio.ensure_future(reader.run()) for reader in self._readers.values()]
        tasks.append(asyncio.ensure_future(self._publish_loop()))
        tasks.append(asyncio.ensure_future(self._lease_loop()))
        tasks.append(asyncio.ensure_future(self._observe_loop()))
        if self.config.state_file is not None:
            tasks.append(asyncio.ensure_future(self._state_loop()))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in [*tasks, stopper]:
                task.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)
        self.begin_shutdown("the coordinator received a stop signal")

    def begin_shutdown(self, reason: str) -> None:
        """Stop taking work and tell everyone, before the sockets close."""
        if self.shutting_down or not self._sockets:
            return
        self.shutting_down = True
        notice = fp.encode(fp.ShuttingDown(reason))
        for peer in list(self.frontends.values()):
            self._send_router("frontend", peer.identity, notice)
        if self.gate_open:
            self.publish_full(self.clock())
        # Give the goodbye messages a moment to leave; close() would drop them.
        for key in ("frontend", "front_publish"):
            self._sockets[key].setsockopt(zmq.LINGER, 500)

    def _handler_failed(self, socket_name: str, exc: BaseException) -> None:
        self.counters[f"internal_error.{socket_name}"] += 1
        log.error("internal error while handling a %s message", socket_name, exc_info=exc)

    def _drop(self, socket_name: str, reason: str, detail: str, peer: str = "") -> None:
        """Count and (rate-limited) log one piece of bad input; state is untouched."""
        self.counters[f"dropped.{socket_name}.{reason}"] += 1
        self._ratelog.log(
            logging.WARNING,
            f"{socket_name}:{reason}:{peer}",
            "dropped bad input on %s%s (%s): %s",
            socket_name,
            f" from {peer}" if peer else "",
            reason,
            detail,
        )

    # ---- handshake (ROUTER, vLLM H1) ----------------------------------------

    def on_handshake(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._drop("handshake", "frame_count", f"expected [identity, payload], got "
                       f"{len(frames)} frames")
            if len(frames) > 2:
                self._handshake_error(frames[0], "expected exactly one payload frame")
            return
        identity, payload = frames
        now = self.clock()
        try:
            rank = identity_to_rank(identity)
        except ProtocolError as exc:
            self._refuse_handshake(identity, exc.reason, exc.message)
            return
        try:
            message = vllm.decode_handshake(payload)
        except ProtocolError as exc:
            self._refuse_handshake(identity, exc.reason, f"bad handshake payload from dp_rank="
                                   f"{rank}: {exc.message}")
            return
        if message.status == "HELLO":
            self._on_hello(identity, rank, message, now)
        elif message.status == "READY":
            self._on_ready(identity, rank, message, now)
        else:
            self._refuse_handshake(identity, "bad_status", f"dp_rank={rank} sent status "
                                   f"{message.status!r}; expected HELLO or READY")

    def _refuse_handshake(self, identity: bytes, reason: str, message: str) -> None:
        self.counters[f"refused.handshake.{reason}"] += 1
        rank = int.from_bytes(identity, "little") if len(identity) == 2 else None
        self._record(KIND_REFUSAL, reason, rank=rank, identity=identity.hex(), message=message)
        # One line per reason per interval (with a count of the rest): a flood of
        # bad peers, each with its own identity, must not flood the log too.
        self._ratelog.log(logging.ERROR, f"refuse:{reason}",
                          "refused engine %r: %s", identity, message)
        self._handshake_error(identity, message)

    def _handshake_error(self, identity: bytes, reason: str) -> None:
        reply = vllm.encode_handshake_reply(vllm.HandshakeError(reason=reason))
        self._send_router("handshake", identity, reply)

    def _on_hello(self, identity: bytes, rank: int, message: vllm.HandshakeMessage,
                  now: float) -> None:
        result = self.membership.hello(
            rank, engine_id=message.engine_id, local=message.local,
            headless=message.headless, now=now,
        )
        if isinstance(result, Refused) and self._holder_is_gone(rank, now):
            result = self.membership.hello(
                rank, engine_id=message.engine_id, local=message.local,
                headless=message.headless, now=now,
            )
        if not isinstance(result, Accepted):
            assert isinstance(result, Refused)  # the default holder_reachable never probes
            self._refuse_handshake(identity, result.reason.name.lower(), result.message)
            return
        self._note_accepted("hello", result)
        if self.config.frontends and len(self.frontends) < self.config.frontends:
            log.info("dp_rank=%d said HELLO; INIT waits until %d frontends registered "
                     "(%d so far)", rank, self.config.frontends, len(self.frontends))
            self.pending_inits[rank] = identity
            return
        self._send_init(rank, identity)

    def _holder_is_gone(self, rank: int, now: float) -> bool:
        """Probe the engine holding `rank`; if its connection is gone, free the rank."""
        lease = self.membership.lease(rank)
        if lease is None or lease.state is RankState.DEAD or not lease.dispatch_connected:
            return False
        probe = vllm.encode_abort([])
        if self._send_router("dispatch", rank_to_identity(rank), vllm.ABORT, probe, quiet=True):
            return False
        for change in self.membership.disconnected(rank, now):
            self._on_rank_changed(change)
        return True

    def _note_accepted(self, step: str, result: Accepted) -> None:
        lease = result.lease
        self.counters[f"handshake.{step}.accepted"] += 1
        self._record(KIND_MEMBERSHIP, f"{step} accepted", rank=lease.rank,
                     engine_id=lease.engine_id, incarnation=lease.incarnation)
        self._push_observed(self.clock())
        self._state_changed()
        if result.replaced is not None:
            self.counters["handshake.replaced"] += 1
            log.warning("dp_rank=%d: engine %s replaces %s (previous registration %s)",
                        lease.rank, lease.engine_id, result.replaced.engine_id,
                        result.replaced.state.value)
            self._fail_rank_requests(lease.rank, "the engine was replaced by a new incarnation")
            self._apply_wave_actions(self.waves.on_group_changed(),
                                     cause=f"dp_rank={lease.rank} has a new incarnation",
                                     rank=lease.rank)

    def _send_init(self, rank: int, identity: bytes) -> None:
        meta = vllm.EngineHandshakeMetadata(
            addresses=self._engine_addresses(), parallel_config=self._parallel_config
        )
        if self._send_router("handshake", identity, vllm.encode_init(meta)):
            self._inits_sent = True
            log.info("dp_rank=%d: sent INIT", rank)

    def _engine_addresses(self) -> vllm.EngineZmqAddresses:
        inputs = [self.addresses["dispatch"]]
        inputs += [f.input_address for _, f in sorted(self.frontends.items()) if f.input_address]
        outputs = [f.output_address for _, f in sorted(self.frontends.items())]
        return vllm.EngineZmqAddresses(
            inputs=inputs,
            outputs=outputs,
            coordinator_input=self.addresses["back_publish"],
            coordinator_output=self.addresses["back_output"],
            frontend_stats_publish_address=self.addresses["front_publish"],
        )

    def _on_ready(self, identity: bytes, rank: int, message: vllm.HandshakeMessage,
                  now: float) -> None:
        result = self.membership.ready(
            rank, parallel_config_hash=message.parallel_config_hash, now=now
        )
        if isinstance(result, Refused):
            self._refuse_handshake(identity, result.reason.name.lower(), result.message)
            return
        self._note_accepted("ready", result)
        reply = vllm.encode_handshake_reply(vllm.HandshakeAccepted())
        self._send_router("handshake", identity, reply)
        log.info("dp_rank=%d ready (engine_id=%s)", rank, result.lease.engine_id)

    # ---- dispatch (ROUTER, vLLM F1): engine greetings -----------------------

    def on_dispatch(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drop("dispatch", "frame_count", f"got {len(frames)} frames")
            return
        identity = frames[0]
        try:
            rank = identity_to_rank(identity)
        except ProtocolError as exc:
            self._drop("dispatch", exc.reason, exc.message)
            return
        if self.membership.check_rank(rank) is not None:
            self._drop("dispatch", "rank_out_of_range", f"dp_rank={rank}")
            return
        now = self.clock()
        if self.membership.greeted(rank, now):
            log.info("dp_rank=%d connected on dispatch", rank)
            self.counters["dispatch.greetings"] += 1
        else:
            # Handshook with someone else (vLLM's launcher) or not at all: it can still
            # take part in waves and stats, but we route nothing to an unknown incarnation.
            self.counters["dispatch.unregistered_greeting"] += 1
            self._ratelog.log(logging.INFO, f"greet:{rank}", "dp_rank=%d greeted on dispatch "
                              "without a handshake here; it is not used for dispatch", rank)

    # ---- back_output (PULL, vLLM C2): stats and wave reports ----------------

    def on_back_output(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._drop("back_output", "frame_count", f"expected 1 frame, got {len(frames)}")
            return
        try:
            msg = vllm.decode_engine_report(frames[0])
            vllm.check_coordinator_traffic(msg)
        except ProtocolError as exc:
            self._drop("back_output", exc.reason, exc.message)
            return
        rank = msg.engine_index
        if self.membership.check_rank(rank) is not None:
            self._drop("back_output", "rank_out_of_range", f"engine_index={rank}")
            return
        now = self.clock()
        self.membership.touch(rank, now)
        if msg.wave_complete is not None or msg.start_wave is not None:
            if msg.wave_complete is not None:
                cause = f"wave_complete({msg.wave_complete}) from rank {rank}"
            else:
                cause = f"start_wave({msg.start_wave}) from rank {rank}"
            self._apply_wave_actions(
                self.waves.on_engine_output(rank, msg.wave_complete, msg.start_wave, now=now),
                cause=cause, rank=rank,
            )
        stats = msg.scheduler_stats
        if stats is not None:
            was_changed = self.loads.changed
            outcome = self.loads.apply_stats(
                rank,
                waiting=stats.num_waiting_reqs,
                running=stats.num_running_reqs,
                kv_cache_usage=stats.kv_cache_usage,
                wave=stats.current_wave,
                step=stats.step_counter,
                lockstep=self.config.lockstep,
            )
            if outcome.stale:
                self.counters["stats.stale"] += 1
                self._ratelog.log(logging.INFO, f"stale:{rank}", "dp_rank=%d reported "
                                  "(wave %d, step %d), behind its previous report; counters "
                                  "restarted?", rank, stats.current_wave, stats.step_counter)
            self.counters["stats.reports"] += 1
            self.watchdog.observe_stats(
                rank, wave=stats.current_wave, step=stats.step_counter, now=now
            )
            if not was_changed and self.loads.changed:
                self._stats_dirty.set()
            reported = self.waves.on_reported_wave(rank, stats.current_wave)
            if reported:
                self._apply_wave_actions(
                    reported, cause=f"stats from rank {rank} report wave {stats.current_wave}",
                    rank=rank,
                )

    def _apply_wave_actions(
        self, actions: Sequence[WaveAction], *, cause: str, rank: int | None,
        coordinator_wake: bool = False,
    ) -> None:
        now = self.clock()
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                frames = vllm.encode_start_dp_wave(action.wave, action.exclude)
                if self.gate_open:
                    self._send_pub("back_publish", frames)
                else:
                    # An engine's first frame on back_publish must be READY (vLLM asserts
                    # it); the latest wake goes out right after READY instead.
                    self._held_wake = frames
                    self.counters["waves.start_held_for_gate"] += 1
                self.counters["waves.start_broadcasts"] += 1
                if coordinator_wake:
                    self.timeline.wake_sent(action.wave, now)
                self._record(KIND_WAKE, cause, rank=rank, exclude=action.exclude)
                log.debug("START_DP_WAVE [%d, %s] (%s)", action.wave, action.exclude, cause)
            elif isinstance(action, PublishWave):
                self._send_pub(
                    "front_publish", [vllm.encode_front_publish(None, action.wave, action.running)]
                )
                self.counters["publish.wave"] += 1
                self.timeline.observe(action.wave, action.running, now)
                # The watchdog learns of the change at its next tick (O(ranks) work
                # stays off the wake path); the recorder and /debug/waves have it now.
                self._record(KIND_WAVE, cause, rank=rank)
                log.debug("wave %d %s (%s)", action.wave,
                          "running" if action.running else "paused", cause)
        if actions:
            self._state_changed()
            self._push_observed(now)

    def _rank_range(self) -> range:
        return range(self.config.rank_start, self.config.rank_start + self.config.engines)

    def _record(self, kind: str, cause: str, *, rank: int | None = None,
                **detail: object) -> None:
        wave, running = self.waves.snapshot()
        self.recorder.record(at=self.clock(), kind=kind, cause=cause, wave=wave,
                             running=running, rank=rank, **detail)

    # ---- back_publish upstream (XPUB, vLLM C3): the startup gate ------------

    def on_back_publish(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._drop("back_publish", "frame_count", f"got {len(frames)} frames")
            return
        frame = frames[0]
        if frame == vllm.SUBSCRIBE:
            self.gate_subscriptions += 1
            if self.gate_open:
                # A late or returning engine is blocked until it sees READY.
                self._send_pub("back_publish", [vllm.READY])
                log.info("engine subscription on back_publish after start-up; sent READY")
            elif self.gate_subscriptions >= self.config.engines:
                self.gate_open = True
                self._state_changed()
                self._send_pub("back_publish", [vllm.READY])
                if self._held_wake is not None:
                    self._send_pub("back_publish", self._held_wake)
                    self._held_wake = None
                self.schedule.start(self.clock())
                self._stats_dirty.set()
                log.info("all %d engines subscribed; READY sent", self.config.engines)
            else:
                log.info("engine subscribed on back_publish (%d of %d)",
                         self.gate_subscriptions, self.config.engines)
        elif frame == vllm.UNSUBSCRIBE:
            log.info("the last engine subscriber left back_publish")
        else:
            self._drop("back_publish", "unexpected_frame", f"{frame[:32]!r}")

    # ---- front_publish upstream (XPUB, vLLM C1) -----------------------------

    def on_front_upstream(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._drop("front_publish", "frame_count", f"got {len(frames)} frames")
            return
        frame = frames[0]
        if frame[:1] == vllm.SUBSCRIBE:
            # A new subscriber missed every earlier publish: send it a full one soon
            # instead of leaving it blind until the next heartbeat (vLLM: up to 5 s).
            self.counters["front.subscriptions"] += 1
            self._publish_requested = True
            self._stats_dirty.set()
            return
        if frame[:1] == vllm.UNSUBSCRIBE:
            return
        try:
            message = vllm.decode_front_upstream(frame)
        except ProtocolError as exc:
            self._drop("front_publish", exc.reason, exc.message)
            return
        if isinstance(message, vllm.ScaleElasticEP):
            self._resize(message.new_count)
        elif self.config.vllm_compat == "legacy":
            self._on_legacy_first_request(message)
        else:
            self._drop("front_publish", "legacy_first_request",
                       f"[{message.engine_index}, {message.wave}] (pre-0.33 frontend wake; "
                       "start with --vllm-compat legacy to honour it)")

    def _on_legacy_first_request(self, message: vllm.LegacyFirstRequest) -> None:
        """A pre-0.33 frontend sent a request to a paused group: wake the others.

        Same rule as a submit through the coordinator (one wake per wave; a stale
        stamp wakes everyone), but running still flips only on an engine's report.
        """
        if self.membership.check_rank(message.engine_index) is not None:
            self._drop("front_publish", "rank_out_of_range",
                       f"legacy wake names engine {message.engine_index}")
            return
        self.counters["legacy.first_requests"] += 1
        self._apply_wave_actions(
            self.waves.on_first_request(message.engine_index, message.wave, now=self.clock()),
            cause="legacy first request", rank=message.engine_index, coordinator_wake=True,
        )

    def _resize(self, new_total: int) -> None:
        count = new_total - self.config.rank_start
        if count < 1:
            self._drop("front_publish", "bad_value", f"SCALE_ELASTIC_EP {new_total} leaves no "
                       f"ranks above rank_start={self.config.rank_start}")
            return
        log.info("SCALE_ELASTIC_EP: %d -> %d engines", self.config.engines, count)
        for change in self.membership.resize(count):
            self._on_rank_changed(change)
        self.loads.resize(self.config.rank_start + count)
        self.config.engines = count
        self._stats_dirty.set()

    # ---- frontend ROUTER (this project's protocol) --------------------------

    def on_frontend(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drop("frontend", "frame_count", f"got {len(frames)} frames")
            return
        identity = frames[0]
        try:
            message, payload = fp.decode_request(frames[1:])
        except ProtocolError as exc:
            self._drop("frontend", exc.reason, exc.message)
            call_id = fp.salvage_call_id(frames[1]) if len(frames) > 1 else 0
            self._reply(identity, fp.ErrorReply(call_id, fp.ERR_BAD_FRAME, exc.message))
            return
        if isinstance(message, fp.Submit):
            self._on_submit(identity, message, payload)
        elif isinstance(message, fp.Finished):
            self._on_finished(message.request_ids)
        elif isinstance(message, fp.Register):
            self._on_register(identity, message)
        elif isinstance(message, fp.Abort):
            self._on_abort(identity, message)
        elif isinstance(message, fp.QueryState):
            self._reply(identity, fp.StateReply(message.call_id, self.group_state()))
        else:
            self._on_admin(identity, message)

    def _reply(self, identity: bytes, message: fp.FrontendReply) -> None:
        self._send_router("frontend", identity, fp.encode(message))

    def _on_register(self, identity: bytes, msg: fp.Register) -> None:
        expected = self.config.frontends
        if expected and msg.client_index >= expected:
            self._reply(identity, fp.ErrorReply(
                msg.call_id, fp.ERR_BAD_CLIENT_INDEX,
                f"client_index {msg.client_index} is outside 0..{expected - 1} "
                f"(the coordinator was started with --frontends {expected})"))
            return
        if msg.client_index not in self.frontends and len(self.frontends) >= max(
            expected, self.config.max_frontends
        ):
            self._reply(identity, fp.ErrorReply(msg.call_id, fp.ERR_BAD_CLIENT_INDEX,
                                                "too many frontends registered"))
            return
        previous = self.frontends.get(msg.client_index)
        if (
            previous is not None
            and previous.output_address != msg.output_address
            and self._inits_sent
        ):
            # Engines learnt the old address in INIT and keep pushing there; taking the
            # new one would silently lose every output for this client index.
            self._reply(identity, fp.ErrorReply(
                msg.call_id, fp.ERR_BAD_CLIENT_INDEX,
                f"client_index {msg.client_index} is registered with outputs at "
                f"{previous.output_address}, which engines already use; a restarted frontend "
                f"must bind that same address (or use another client index)"))
            return
        self.frontends[msg.client_index] = FrontendPeer(
            identity, msg.client_index, msg.output_address, msg.input_address
        )
        self._state_changed()
        if previous is not None and previous.identity != identity:
            moved = self._move_requests(previous.identity, identity)
            log.warning("frontend client_index=%d re-registered from a new connection; "
                        "%d in-flight requests now report to it", msg.client_index, moved)
        else:
            log.info("frontend client_index=%d registered (outputs at %s)", msg.client_index,
                     msg.output_address)
        wave, running = self.waves.snapshot()
        self._reply(identity, fp.Registered(
            msg.call_id, msg.client_index, self.config.rank_start, self.config.engines,
            wave, running, self.config.lockstep))
        if self.pending_inits and len(self.frontends) >= self.config.frontends:
            pending, self.pending_inits = self.pending_inits, {}
            for rank, engine_identity in sorted(pending.items()):
                self._send_init(rank, engine_identity)

    def _move_requests(self, old: bytes, new: bytes) -> int:
        """Failure notices for a restarted frontend's requests go to its new connection."""
        moved = 0
        for entry in self.in_flight.values():
            if entry.frontend == old:
                entry.frontend = new
                moved += 1
        return moved

    def _on_submit(self, identity: bytes, msg: fp.Submit, payload: list[bytes]) -> None:
        def refuse(code: str, text: str) -> None:
            self.counters[f"submit.refused.{code}"] += 1
            self._reply(identity, fp.ErrorReply(msg.call_id, code, text, msg.request_id))

        if self.shutting_down:
            refuse(fp.ERR_SHUTTING_DOWN, "the coordinator is shutting down")
            return
        if msg.request_id in self.in_flight:
            refuse(fp.ERR_DUPLICATE_REQUEST, f"request {msg.request_id!r} is already in flight")
            return
        if len(self.in_flight) >= self.config.max_in_flight:
            refuse(fp.ERR_TOO_MANY_IN_FLIGHT, f"{len(self.in_flight)} requests in flight "
                   "(frontends must send 'finished' for completed requests)")
            return
        if msg.dp_rank is not None:
            if self.membership.check_rank(msg.dp_rank) is not None:
                last = self.config.rank_start + self.config.engines - 1
                refuse(fp.ERR_UNKNOWN_RANK, f"dp_rank={msg.dp_rank} is outside "
                       f"{self.config.rank_start}..{last}")
                return
            if msg.dp_rank not in self.membership.dispatchable():
                lease = self.membership.lease(msg.dp_rank)
                state = lease.state.value if lease else "not registered"
                refuse(fp.ERR_RANK_NOT_READY, f"dp_rank={msg.dp_rank} cannot take requests "
                       f"({state})")
                return
            if not self._send_router("dispatch", rank_to_identity(msg.dp_rank), vllm.ADD,
                                     *payload):
                refuse(fp.ERR_ENGINE_UNREACHABLE,
                       f"dp_rank={msg.dp_rank} is not connected on dispatch")
                return
            chosen = msg.dp_rank
        else:
            picked = self._dispatch_to_best(payload)
            if picked is None:
                refuse(fp.ERR_NO_READY_ENGINE, "no engine is ready to take requests")
                return
            if isinstance(picked, str):
                refuse(fp.ERR_ENGINE_UNREACHABLE, picked)
                return
            chosen = picked
        actions = self.waves.on_first_request(chosen, msg.wave, now=self.clock())
        if actions:
            self._apply_wave_actions(actions, cause=f"first request {msg.request_id!r}",
                                     rank=chosen, coordinator_wake=True)
        self.loads.note_dispatched(chosen)
        self.dispatched_by_rank[chosen] += 1
        self.in_flight[msg.request_id] = InFlight(chosen, identity)
        self.in_flight_by_rank[chosen] += 1
        self.counters["submit.dispatched"] += 1
        self._reply(identity, fp.Submitted(msg.call_id, msg.request_id, chosen, bool(actions)))

    def _dispatch_to_best(self, payload: list[bytes]) -> int | str | None:
        """Send ADD to the rank the policy picks; if its connection is not there (an
        engine reconnecting after a restart, or one that just died), pick again among
        the others. Returns the rank, None if none is ready, or why all sends failed."""
        # Leases past their TTL are buried by the lease timer; one not yet buried
        # fails the send below and the next best is tried.
        candidates = self.membership.dispatchable()
        tried: list[int] = []
        while candidates:
            chosen = self.policy.pick(self.loads, candidates)
            if chosen is None:
                break
            if self._send_router("dispatch", rank_to_identity(chosen), vllm.ADD, *payload,
                                 quiet=True):
                return chosen
            tried.append(chosen)
            candidates = [rank for rank in candidates if rank != chosen]
        if tried:
            return f"no ready engine is connected on dispatch (tried dp_rank {tried})"
        return None

    def _forget(self, request_id: str) -> InFlight | None:
        entry = self.in_flight.pop(request_id, None)
        if entry is not None:
            self.in_flight_by_rank[entry.rank] -= 1
            if self.in_flight_by_rank[entry.rank] <= 0:
                del self.in_flight_by_rank[entry.rank]
                self._maybe_drained(entry.rank)
        return entry

    def _on_finished(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._forget(request_id)

    def _on_abort(self, identity: bytes, msg: fp.Abort) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in msg.request_ids:
            entry = self._forget(request_id)
            if entry is not None:
                by_rank.setdefault(entry.rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self._send_router("dispatch", rank_to_identity(rank), vllm.ABORT,
                              vllm.encode_abort(ids))
        routed = [rid for ids in by_rank.values() for rid in ids]
        self._reply(identity, fp.Aborted(msg.call_id, routed))

    def _on_admin(self, identity: bytes, msg: fp.Admin) -> None:
        if msg.command == "cordon":
            result = self.membership.cordon(msg.rank)
        elif msg.command == "uncordon":
            result = self.membership.uncordon(msg.rank)
        else:
            result = self.membership.drain(msg.rank)
        if isinstance(result, Refused):
            self._reply(identity, fp.ErrorReply(msg.call_id, fp.ERR_ADMIN_REFUSED, result.message))
            return
        self._on_rank_changed(result)
        self._reply(identity, fp.AdminDone(msg.call_id, msg.rank, str(result.new.value)
                                           if result.new else "absent"))
        if msg.command == "drain":
            self._maybe_drained(msg.rank)

    def _maybe_drained(self, rank: int) -> None:
        lease = self.membership.lease(rank)
        if lease is None or lease.state is not RankState.DRAINING:
            return
        if self.in_flight_by_rank.get(rank, 0) > 0:
            return
        log.info("dp_rank=%d drained: no requests in flight", rank)
        notice = fp.encode(fp.RankDrained(rank))
        for peer in list(self.frontends.values()):
            self._send_router("frontend", peer.identity, notice)

    # ---- membership changes and leases --------------------------------------

    def _on_rank_changed(self, change: RankChanged) -> None:
        self._state_changed()
        self._record(KIND_MEMBERSHIP, change.cause, rank=change.rank,
                     old=change.old.value if change.old else None,
                     new=change.new.value if change.new else None)
        self._push_observed(self.clock())
        log.info("dp_rank=%d: %s -> %s (%s)", change.rank,
                 change.old.value if change.old else "absent",
                 change.new.value if change.new else "absent", change.cause)
        if change.new in (RankState.DEAD, None):
            self.counters["lease.dead"] += 1
            self._fail_rank_requests(change.rank, change.cause)
            self._apply_wave_actions(self.waves.on_group_changed(),
                                     cause=f"dp_rank={change.rank} left: {change.cause}",
                                     rank=change.rank)
            if self.config.lockstep:
                log.error("dp_rank=%d is gone (%s): in lockstep mode the group cannot finish "
                          "a wave until it is back", change.rank, change.cause)

    def _fail_rank_requests(self, rank: int, reason: str) -> None:
        failed: dict[bytes, list[str]] = {}
        for request_id, entry in list(self.in_flight.items()):
            if entry.rank == rank:
                failed.setdefault(entry.frontend, []).append(request_id)
                self._forget(request_id)
        for frontend, ids in failed.items():
            self.counters["requests.failed"] += len(ids)
            self._send_router("frontend", frontend, fp.encode(fp.RequestsFailed(ids, rank,
                                                                                reason)))

    async def _lease_loop(self) -> None:
        interval = max(0.05, min(1.0, self.config.lease_ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            self._guarded("lease timer", self.check_leases, self.clock())

    def _guarded(self, what: str, step: Callable[[float], None], now: float) -> None:
        """Run one timer step; a bug in it is logged and counted, the timer goes on."""
        try:
            step(now)
        except Exception as exc:
            self._handler_failed(what.replace(" ", "_"), exc)

    def check_leases(self, now: float) -> None:
        """Probe quiet engines, then expire the leases nobody renewed.

        vLLM engines send nothing while idle, so silence alone proves nothing. An
        empty ABORT is a no-op for every engine (dense or MoE, idle or busy), and
        with ROUTER_MANDATORY the send fails at once if the engine's connection is
        gone; a connection that is still there renews the lease.
        """
        quiet_after = self.config.lease_ttl_s / 3
        probe = vllm.encode_abort([])
        for lease in self.membership.leases():
            if lease.state is RankState.DEAD or not lease.dispatch_connected:
                continue
            if now - lease.last_seen < quiet_after:
                continue
            self.counters["lease.probes"] += 1
            if self._send_router("dispatch", rank_to_identity(lease.rank), vllm.ABORT, probe,
                                 quiet=True):
                self.membership.touch(lease.rank, now)
            else:
                for change in self.membership.disconnected(lease.rank, now):
                    self._on_rank_changed(change)
        for change in self.membership.expire(now):
            self._on_rank_changed(change)

    # ---- state file (coordinator restarts) ----------------------------------

    def _state_changed(self) -> None:
        """Registrations, frontends, the gate or the wave changed: write them now.

        These change a few times per wave at most, and a write is one small atomic
        file replace, so the file never lags what a restart needs to resume.
        """
        self._state_dirty = True
        if self._serving:
            self.save_state()

    async def _state_loop(self) -> None:
        # Retries writes that failed (disk full, permissions fixed meanwhile).
        while True:
            await asyncio.sleep(1.0)
            if self._state_dirty:
                self.save_state()

    def save_state(self, *, durable: bool = False) -> None:
        path = self.config.state_file
        if path is None:
            return
        self._state_dirty = False
        leases = [
            SavedLease(lease.rank, lease.engine_id, lease.incarnation, lease.state.value,
                       lease.local, lease.headless, lease.parallel_config_hash)
            for lease in self.membership.leases()
            if lease.state in (RankState.READY, RankState.CORDONED, RankState.DRAINING)
        ]
        frontends = [
            SavedFrontend(f.client_index, f.identity.hex(), f.output_address, f.input_address)
            for f in self.frontends.values()
        ]
        state = SavedState(
            version=1, wave=self.waves.current_wave, gate_open=self.gate_open,
            inits_sent=self._inits_sent, leases=leases, frontends=frontends,
            addresses=dict(self.addresses),
        )
        try:
            save_state(path, state, durable=durable)
        except OSError as exc:
            self._state_dirty = True
            self.counters["state_file.write_errors"] += 1
            self._ratelog.log(logging.ERROR, "state-write", "could not write the state file "
                              "%s: %s", path, exc)

    def _restore_state(self, path: str) -> None:
        """Resume from a previous process's state file (raises StateFileError if bad)."""
        saved = load_state(path)
        if saved is None:
            log.info("no state file at %s yet; starting empty", path)
            return
        now = self.clock()
        moved = {k: v for k, v in saved.addresses.items() if self.addresses.get(k) != v}
        if moved:
            log.warning("the state file was written by a coordinator bound elsewhere (%s); "
                        "engines and frontends connected there will not find this one. "
                        "Use --ipc-dir, or --host with --port-base, for stable addresses",
                        ", ".join(sorted(moved)))
        self.waves = WaveState(lockstep=self.config.lockstep, wave=saved.wave)
        for item in saved.leases:
            result = self.membership.restore(
                item.rank, engine_id=item.engine_id, incarnation=item.incarnation,
                state=RankState(item.state), local=item.local, headless=item.headless,
                parallel_config_hash=item.parallel_config_hash, now=now,
            )
            if isinstance(result, Refused):
                log.warning("state file: %s", result.message)
        for fe in saved.frontends:
            self.frontends[fe.client_index] = FrontendPeer(
                bytes.fromhex(fe.identity_hex), fe.client_index, fe.output_address,
                fe.input_address,
            )
        self._inits_sent = saved.inits_sent
        if saved.gate_open:
            # Engines already passed the start-up gate; their reconnecting subscriptions
            # only get READY again, which they ignore.
            self.gate_open = True
            self.gate_subscriptions = self.config.engines
            self.schedule.start(now)
        self._record(KIND_MEMBERSHIP, "restored from state file", path=path,
                     leases=len(saved.leases), frontends=len(saved.frontends))
        log.info("restored from %s: wave %d, %d registrations, %d frontends, gate %s",
                 path, saved.wave, len(saved.leases), len(saved.frontends),
                 "open" if saved.gate_open else "closed")

    # ---- watchdog and observability -----------------------------------------

    async def _observe_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(0.25)
            self._guarded("observe timer", self.observe_tick, self.clock())
            ticks += 1
            if ticks % 4 == 0:
                release_free_memory()

    def observe_tick(self, now: float) -> None:
        for reader in self._readers.values():
            reader.poke()  # a safety net for any edge lost some other way
        self._apply_wave_actions(self.waves.on_timer(now), cause="unanswered wake retried",
                                 rank=None)
        wave, running = self.waves.snapshot()
        self.watchdog.observe_group(
            running=running and self.config.lockstep, wave=wave, ranks=self._rank_range(),
            now=now,
        )
        if self.config.watchdog_stall_s > 0:
            for alert in self.watchdog.check(now):
                self.counters[f"watchdog.{alert.kind}"] += 1
                self._record(KIND_WATCHDOG, alert.kind, ranks=list(alert.ranks),
                             message=alert.message)
                log.error("WATCHDOG: %s", alert.message)
                self.log_recorder_tail(50, now)
                if self.config.watchdog_rewake and alert.kind == "no_progress":
                    self._send_pub("back_publish", vllm.encode_start_dp_wave(wave, None))
                    self.counters["watchdog.rewakes"] += 1
                    log.warning("watchdog: re-broadcast START_DP_WAVE [%d, nil]", wave)
        self._push_observed(now, force=True)

    def dump_recorder(self) -> None:
        """Log the whole flight recorder (SIGUSR1)."""
        self.log_recorder_tail(None, self.clock())

    def log_recorder_tail(self, n: int | None, now: float) -> None:
        for line in self.recorder.format_lines(n, now=now):
            log.warning("%s", line)

    def _push_observed(self, now: float, *, force: bool = False) -> None:
        """Hand the HTTP thread a fresh snapshot: at once, or (when one went out less than
        50 ms ago) at the end of that interval, so no change waits for the next tick."""
        if self.http is None:
            return
        wait = 0.05 - (now - self._last_http_update)
        if not force and wait > 0:
            if not self._http_push_scheduled:
                self._http_push_scheduled = True
                asyncio.get_running_loop().call_later(wait, self._deferred_push)
            return
        self._last_http_update = now
        self.http.update(self.observed_state(now))

    def _deferred_push(self) -> None:
        self._http_push_scheduled = False
        self._push_observed(self.clock(), force=True)

    def _all_counters(self) -> dict[str, int]:
        counters = dict(self.counters)
        if self.curve is not None:
            counters.update(self.curve.counters())
        return counters

    def observed_state(self, now: float) -> ObservedState:
        from coordinator.frontend import group_state_to_builtins

        wave, running = self.waves.snapshot()
        ranks = []
        for rank in self._rank_range():
            lease = self.membership.lease(rank)
            load = self.loads.load(rank)
            ranks.append(RankView(
                rank=rank, state=lease.state.value if lease else "absent",
                waiting=load.waiting, running=load.running,
                kv_cache_usage=load.kv_cache_usage, dispatched=self.dispatched_by_rank[rank],
                report_age_s=self.watchdog.report_age(rank, now),
                in_flight=self.in_flight_by_rank.get(rank, 0),
            ))
        counters = self._all_counters()
        if self._recorder_json[0] != self.recorder.recorded:
            self._recorder_json = (self.recorder.recorded, self.recorder.as_json())
        totals = self.timeline.totals(now)
        return ObservedState(
            taken_at=now, wave=wave, running=running, lockstep=self.config.lockstep,
            ranks=ranks, counters=counters, waves_total=totals.waves_started,
            seconds_running=totals.seconds_running, seconds_paused=totals.seconds_paused,
            wake_latencies_s=self.timeline.take_wake_latencies(),
            watchdog=[alert.as_dict(now) for alert in self.watchdog.active],
            recorder_tail=list(self._recorder_json[1]),
            all_ready=self.membership.all_ready(now=now),
            state_json=group_state_to_builtins(self.group_state()),
        )

    # ---- publishing (XPUB front_publish, vLLM C1) ---------------------------

    async def _publish_loop(self) -> None:
        while True:
            now = self.clock()
            changed = self.loads.changed or self._publish_requested
            if self.gate_open and self.schedule.due(now, changed=changed):
                self._guarded("publish timer", self.publish_full, now)
                if self.schedule.due(now, changed=changed):
                    self.schedule.published(now)  # a failed publish must not spin
                continue
            if not self.gate_open:
                self._stats_dirty.clear()
                await self._stats_dirty.wait()
                continue
            if changed:
                await asyncio.sleep(max(0.0, self.schedule.next_due(changed=True) - now))
                continue
            self._stats_dirty.clear()
            timeout = max(0.0, self.schedule.next_due(changed=False) - now)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stats_dirty.wait(), timeout)

    def publish_full(self, now: float) -> None:
        rows = self.loads.take_publish_rows()
        wave, running = self.waves.snapshot()
        self._send_pub("front_publish", [
            vllm.encode_front_publish(rows, wave, running, row_width=self._row_width)
        ])
        self.schedule.published(now)
        self._publish_requested = False
        self.counters["publish.full"] += 1

    # ---- sending ------------------------------------------------------------

    def _send_router(self, key: str, identity: bytes, *frames: bytes, quiet: bool = False) -> bool:
        try:
            self._sockets[key].send_multipart([identity, *frames], zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.counters[f"send_dropped.{key}.full"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counters[f"send_dropped.{key}.unreachable"] += 1
        finally:
            self._poke(key)
        if quiet:
            return False
        self._ratelog.log(logging.WARNING, f"send:{key}:{identity!r}",
                          "could not send on %s to %r (peer gone or queue full)", key, identity)
        return False

    def _send_pub(self, key: str, frames: Sequence[bytes]) -> None:
        self._sockets[key].send_multipart(list(frames), zmq.NOBLOCK)
        self._poke(key)

    def _poke(self, key: str) -> None:
        # A send can swallow the read edge of a message that arrived meanwhile
        # (see FrameReader): have the socket's reader look again.
        reader = self._readers.get(key)
        if reader is not None:
            reader.poke()

    # ---- state for tools ----------------------------------------------------

    def group_state(self) -> fp.GroupState:
        now = self.clock()
        wave, running = self.waves.snapshot()
        engines: list[fp.EngineStatus] = []
        leases: dict[int, EngineLease] = {lease.rank: lease for lease in self.membership.leases()}
        for rank in range(self.config.rank_start, self.config.rank_start + self.config.engines):
            load = self.loads.load(rank)
            lease = leases.get(rank)
            engines.append(fp.EngineStatus(
                rank=rank,
                state=lease.state.value if lease else "absent",
                engine_id=lease.engine_id if lease else None,
                waiting=load.waiting,
                running=load.running,
                kv_cache_usage=load.kv_cache_usage,
                dispatched_since_report=load.dispatched_since_report,
                in_flight=self.in_flight_by_rank.get(rank, 0),
                last_seen_age_s=round(now - lease.last_seen, 3) if lease else None,
            ))
        return fp.GroupState(
            wave=wave, running=running, lockstep=self.config.lockstep,
            rank_start=self.config.rank_start, rank_count=self.config.engines,
            frontends=len(self.frontends), in_flight=len(self.in_flight), engines=engines,
            counters=self._all_counters(), shutting_down=self.shutting_down,
        )
