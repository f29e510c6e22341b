"""The coordinator process: six sockets around the sans-IO core.

The server decides nothing. It binds the sockets, reads each one with a
``FrameReader``, turns frames into events (``coordinator.server.planes``),
feeds them to ``CoordinatorCore`` and carries out the actions it returns:
sends, publishes, log lines, state-file writes. Sends whose outcome matters
are reported back to the core at once (``SendFailed``, ``SendSucceeded``);
whatever the core answers is carried out after the current actions. One timer
(``coordinator.server.timers``) ticks the core at its deadlines.

Every send is NOBLOCK and every handler is synchronous, so nothing a peer does
can stall the loop, and a handler's exception is logged and counted, never
fatal. See docs/ARCHITECTURE.md for the whole flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from coordinator.core.actions import (
    Action,
    DispatchAdd,
    Log,
    Publish,
    RearmTimer,
    RefreshObserved,
    SaveState,
    Send,
    SetLinger,
)
from coordinator.core.coordinator import CoordinatorCore, CoreConfig
from coordinator.core.events import (
    DUMP_RECORDER,
    Bound,
    Event,
    FrontendRequestReceived,
    Restore,
    SendFailed,
    SendFailure,
    SendSucceeded,
    Shutdown,
    StateSaveFailed,
)
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.server.config import ServerConfig
from coordinator.server.curve import CurveServer
from coordinator.server.http import HttpEndpoints
from coordinator.server.meeting_point import build_parallel_config
from coordinator.server.observe import DecisionTimes, ObservedPusher, ObservedState
from coordinator.server.planes import DECODERS, Decoder, dispatch
from coordinator.server.planes.kv_events import KVEventsPlane, kv_action_runners
from coordinator.server.statefile import load_state, save_state
from coordinator.server.timers import CoreTimer
from coordinator.server.transport import (
    FrameHandler,
    FrameReader,
    PeerFrameHandler,
    RateLimitedLog,
    bind_socket,
    make_endpoint,
    new_ipc_dir,
    write_address_file,
)

log = logging.getLogger("coordinator.server")


def core_config(cfg: ServerConfig) -> CoreConfig:
    """The rules' share of the process's settings."""
    return CoreConfig(
        rank_start=cfg.rank_start, engines=cfg.engines, frontends=cfg.frontends,
        max_frontends=cfg.max_frontends, max_in_flight=cfg.max_in_flight,
        lockstep=cfg.lockstep, lease_ttl_s=cfg.lease_ttl_s,
        handshake_ttl_s=cfg.handshake_timeout_s, publish_interval_s=cfg.publish_interval_s,
        heartbeat_s=cfg.heartbeat_s, first_publish_delay_s=cfg.first_publish_delay_s,
        policy=cfg.policy, legacy_frontends=cfg.vllm_compat == "legacy",
        watchdog_stall_s=cfg.watchdog_stall_s, watchdog_rewake=cfg.watchdog_rewake,
        recorder_size=cfg.recorder_size, persist=cfg.state_file is not None,
        kv=cfg.kv_settings(), prefix_slack_tokens=cfg.prefix_slack_tokens,
    )


class CoordinatorServer:
    """Owns the sockets of one coordinator process and feeds its core."""

    def __init__(self, config: ServerConfig, *, clock: Callable[[], float] = time.monotonic):
        config.validate()
        self.config = config
        self.clock = clock
        self.core = CoordinatorCore(core_config(config), rng=random.Random(), now=clock())
        self.addresses: dict[str, str] = {}
        self.http: HttpEndpoints | None = None
        self.curve: CurveServer | None = None
        self.counters: Counter[str] = Counter()
        """Failures of the server itself (``internal_error.*``), merged into the core's."""
        self.core.extra_counters = self._own_counters
        self._ipc_dir: str | None = None
        self._owns_ipc_dir = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._readers: dict[str, FrameReader] = {}
        self.kv_plane: KVEventsPlane | None = None
        self._ratelog = RateLimitedLog(log, interval_s=config.log_interval_s, clock=clock)
        self.decision_times = DecisionTimes()
        self._observer = ObservedPusher(self.core, self._update_http, clock, self.decision_times)
        self._timer = CoreTimer(self.core, self.execute, clock=clock,
                                on_error=self._handler_failed, pokes=self._reader_pokes)
        self._serving = False
        self._follow_ups: list[Action] = []
        self._runners: dict[type, Callable[[Any], None]] = {
            Send: self._run_send,
            DispatchAdd: self._run_dispatch_add,
            Publish: self._run_publish,
            Log: self._run_log,
            SaveState: self._run_save_state,
            SetLinger: self._run_set_linger,
            RefreshObserved: self._run_refresh,
            RearmTimer: self._run_rearm,
            **kv_action_runners(lambda: self.kv_plane, self.counters, self._ratelog),
        }
        # One handler per socket: frames in, actions carried out.
        self.frame_handlers: dict[str, FrameHandler] = {
            key: self._feeder(decode) for key, decode in DECODERS.items()
        }
        self.frame_handlers["back_output"] = self._stats_feeder()
        self.frame_handlers["frontend"] = self._frontend_feeder()
        self.dispatch_handler: PeerFrameHandler = self._greeting_feeder()

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
        if self.core.kv is not None:
            kv = self.core.kv
            self.kv_plane = KVEventsPlane(
                self._ctx, self._feed, backlog_full=lambda: kv.backlog_full,
                pending=lambda: kv.pending_blocks > 0, max_message_bytes=cfg.max_message_bytes,
                on_error=self._handler_failed)
        configure = None
        if cfg.curve_secret_key is not None and cfg.curve_clients_dir is not None:
            self.curve = CurveServer(self._ctx, cfg.curve_secret_key, cfg.curve_clients_dir)
            self.curve.start()
            configure = self.curve.configure_socket
        try:
            for index, (key, kind, options) in enumerate(self._socket_specs()):
                port = cfg.port_base + index if cfg.port_base is not None else 0
                endpoint = cfg.bind_overrides.get(key) or make_endpoint(
                    key, host=cfg.host, ipc_dir=ipc_dir, port=port
                )
                sock, resolved = bind_socket(
                    self._ctx, kind, endpoint, max_message_bytes=cfg.max_message_bytes,
                    options=options,
                    configure=configure if endpoint.startswith("tcp://") else None,
                )
                self._sockets[key] = sock
                self.addresses[key] = resolved
        except zmq.ZMQError:
            self.close()
            raise
        self._feed(Bound(dict(self.addresses), build_parallel_config(cfg)))
        if cfg.state_file is not None:
            saved = load_state(cfg.state_file)  # raises StateFileError if unusable
            if saved is None:
                log.info("no state file at %s yet; starting empty", cfg.state_file)
            else:
                self._feed(Restore(saved, cfg.state_file))
        if cfg.metrics_port is not None:
            self.http = HttpEndpoints(cfg.metrics_host, cfg.metrics_port, clock=self.clock)
            port = self.http.start()
            log.info("metrics and health endpoints on http://%s:%d/", cfg.metrics_host, port)
        if cfg.addr_file:
            write_address_file(cfg.addr_file, self.addresses)
        return dict(self.addresses)

    def _socket_specs(self) -> list[tuple[str, int, list[tuple[int, int]]]]:
        """The six sockets in bind order (``--port-base`` counts in this order)."""
        # ZMTP heartbeats: a tcp peer that stops answering is disconnected, which turns
        # a silent network failure into a failed probe within the lease TTL.
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        heartbeats = [(zmq.HEARTBEAT_IVL, max(100, ttl_ms // 4)), (zmq.HEARTBEAT_TIMEOUT, ttl_ms)]
        return [
            # No ROUTER_HANDOVER here: it would cut off an engine mid-handshake whenever a
            # second process claims its rank, losing the first one's READY. The second is
            # then refused by libzmq itself, silently (see docs/vllm.md).
            # Heartbeats drop a half-open tcp connection (a host that died mid-handshake)
            # that would otherwise keep the rank's identity and turn its restart away.
            ("handshake", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), *heartbeats]),
            ("dispatch", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1),
                                      (zmq.SNDHWM, 0), *heartbeats]),
            ("back_output", zmq.PULL, [(zmq.RCVHWM, 0)]),
            ("back_publish", zmq.XPUB, [(zmq.XPUB_VERBOSE, 1)]),
            ("front_publish", zmq.XPUB, [(zmq.XPUB_VERBOSE, 1)]),
            ("frontend", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1)]),
        ]

    def close(self) -> None:
        if self.config.state_file is not None and self._serving:
            # Only a process that served may speak for the group.
            self.execute([SaveState(self.core.saved_state(), durable=True)])
        if self.http is not None:
            self.http.stop()
            self.http = None
        if self.kv_plane is not None:
            self.kv_plane.close()
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
        if self.http is not None:
            self._observer.push(force=True)
        self._readers = {
            key: FrameReader(self._sockets[key], handler, name=key,
                             on_error=self._handler_failed)
            for key, handler in self.frame_handlers.items() if key != "dispatch"
        }
        self._readers["dispatch"] = FrameReader(
            self._sockets["dispatch"], self.dispatch_handler, name="dispatch",
            on_error=self._handler_failed, peer=True)
        tasks = [asyncio.ensure_future(reader.run()) for reader in self._readers.values()]
        tasks.append(asyncio.ensure_future(self._timer.run()))
        if self.kv_plane is not None:
            tasks.append(asyncio.ensure_future(self.kv_plane.run()))
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
        if self._sockets:
            self._feed(Shutdown(reason))

    def dump_recorder(self) -> None:
        """Log the whole flight recorder (SIGUSR1)."""
        self._feed(DUMP_RECORDER)

    def _feeder(self, decode: Decoder) -> FrameHandler:
        handle, clock, execute = self.core.handle, self.clock, self.execute

        def on_frames(frames: list[bytes]) -> None:
            actions = handle(decode(frames), clock())
            if actions:
                execute(actions)

        return on_frames

    def _frontend_feeder(self) -> FrameHandler:
        """``frontend``: submits and route calls are timed (``DecisionTimes``)."""
        decode = DECODERS["frontend"]
        handle, clock, execute = self.core.handle, self.clock, self.execute
        observe, timed = self.decision_times.observe, (fp.Submit, fp.Route)
        cpu_time = time.thread_time
        request_type = FrontendRequestReceived

        def on_frames(frames: list[bytes]) -> None:
            event = decode(frames)
            if type(event) is request_type and type(event.message) in timed:
                started = cpu_time()
                actions = handle(event, clock())
                observe(cpu_time() - started)
            else:
                actions = handle(event, clock())
            if actions:
                execute(actions)

        return on_frames

    def _stats_feeder(self) -> FrameHandler:
        """``back_output``: the hot path, straight to the core's stats handler."""
        decode = DECODERS["back_output"]
        handle, on_report = self.core.handle, self.core.on_engine_report
        clock, execute, report_type = self.clock, self.execute, vllm.EngineReport

        def on_frames(frames: list[bytes]) -> None:
            event = decode(frames)
            if type(event) is report_type:
                actions = on_report(event, clock())
            else:
                actions = handle(event, clock())
            if actions:
                execute(actions)

        return on_frames

    def _greeting_feeder(self) -> PeerFrameHandler:
        """``dispatch``: greetings, with the engine's host when it connected over tcp."""
        handle, clock, execute = self.core.handle, self.clock, self.execute

        def on_frames(frames: list[bytes], peer: str | None) -> None:
            tcp = self.addresses.get("dispatch", "").startswith("tcp://")
            actions = handle(dispatch.decode(frames, peer if tcp else None), clock())
            if actions:
                execute(actions)

        return on_frames

    def _feed(self, event: Event) -> None:
        self.execute(self.core.handle(event, self.clock()))

    def _handler_failed(self, socket_name: str, exc: BaseException) -> None:
        self.counters[f"internal_error.{socket_name}"] += 1
        log.error("internal error while handling a %s message", socket_name, exc_info=exc)

    def _own_counters(self) -> Mapping[str, int]:
        counters = dict(self.counters)
        if self.curve is not None:
            counters.update(self.curve.counters())
        return counters

    def _reader_pokes(self) -> list[Callable[[], None]]:
        return [reader.poke for reader in self._readers.values()]

    # ---- carrying out actions -----------------------------------------------

    def execute(self, actions: Sequence[Action]) -> None:
        """Carry out ``actions`` in order, then whatever the core answered to their outcomes."""
        runners = self._runners
        while actions:
            for action in actions:
                runners[type(action)](action)
            if not self._follow_ups:
                return
            actions, self._follow_ups = self._follow_ups, []

    def _report(self, event: SendFailed | SendSucceeded | StateSaveFailed) -> None:
        # The core learns the outcome now, before any other event; what it answers is
        # carried out once the current actions are done.
        self._follow_ups.extend(self.core.handle(event, self.clock()))

    def _send_frames(self, key: str, frames: list[bytes]) -> SendFailure | None:
        try:
            self._sockets[key].send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return "full"
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return "unreachable"
        finally:
            self._poke(key)
        return None

    def _run_send(self, action: Send) -> None:
        failure = self._send_frames(action.socket, [action.identity, *action.frames])
        if failure is not None:
            self._report(SendFailed(action, failure))
        elif action.confirm:
            self._report(SendSucceeded(action))

    def _run_dispatch_add(self, action: DispatchAdd) -> None:
        failure = self._send_frames("dispatch", [action.engine, vllm.ADD, *action.payload])
        if failure is not None:
            self._report(SendFailed(action, failure))
            return
        runners = self._runners
        for then in action.wake:
            runners[type(then)](then)
        self._run_send(action.reply)

    def _run_publish(self, action: Publish) -> None:
        self._sockets[action.socket].send_multipart(list(action.frames), zmq.NOBLOCK)
        self._poke(action.socket)

    def _run_log(self, action: Log) -> None:
        if action.key is None:
            log.log(action.level, action.message, *action.args)
        else:
            self._ratelog.log(action.level, action.key, action.message, *action.args)

    def _run_save_state(self, action: SaveState) -> None:
        path = self.config.state_file
        if path is None:
            return
        try:
            save_state(path, action.state, durable=action.durable)
        except OSError as exc:
            self._report(StateSaveFailed(path, str(exc)))

    def _run_set_linger(self, action: SetLinger) -> None:
        sock = self._sockets.get(action.socket)
        if sock is not None:
            sock.setsockopt(zmq.LINGER, action.linger_ms)

    def _run_refresh(self, action: RefreshObserved) -> None:
        if self.http is not None:
            self._observer.push(force=action.force)

    def _run_rearm(self, action: RearmTimer) -> None:
        self._timer.rearm()

    def _update_http(self, snapshot: ObservedState) -> None:
        if self.http is not None:
            self.http.update(snapshot)

    def _poke(self, key: str) -> None:
        # A send can swallow the read edge of a message that arrived meanwhile
        # (see FrameReader): have the socket's reader look again.
        reader = self._readers.get(key)
        if reader is not None:
            reader.poke()
