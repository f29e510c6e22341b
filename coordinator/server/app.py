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
import itertools
import logging
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import zmq

from coordinator.core.actions import (
    Action,
    CloseConnection,
    ConnectionSocket,
    DispatchAdd,
    Log,
    Publish,
    RearmTimer,
    RefreshObserved,
    SaveState,
    Send,
    SetLinger,
    StopProcess,
)
from coordinator.core.coordinator import CoordinatorCore
from coordinator.core.events import (
    DUMP_RECORDER,
    Bound,
    Event,
    Restore,
    SendFailed,
    SendFailure,
    SendSucceeded,
    Shutdown,
    StateSaveFailed,
)
from coordinator.core.runner import ActionRunner
from coordinator.protocol import vllm
from coordinator.protocol.addresses import SOCKET_KEYS
from coordinator.server.bootstrap import BootstrapServer, bootstrap_server
from coordinator.server.config import ServerConfig
from coordinator.server.connection_gate import ConnectionGate
from coordinator.server.connections import PeerConnections
from coordinator.server.curve import CurveKeyError, CurveServer, load_client_keys
from coordinator.server.feeders import Feeders
from coordinator.server.frontend_reader import FrontendReader
from coordinator.server.http import HttpEndpoints
from coordinator.server.meeting_point import build_parallel_config
from coordinator.server.observe import DecisionTimes, ObservedPusher, ObservedState
from coordinator.server.planes.kv_events import KVEventsPlane, kv_action_runners
from coordinator.server.sending import poke_if_readable, send_add, send_frames, send_routed
from coordinator.server.sockets import bind_admin, binds_tcp, socket_specs
from coordinator.server.statefile import check_writable, load_state, save_state
from coordinator.server.stats_reader import StatsReader
from coordinator.server.stopping import StopControl
from coordinator.server.subscriptions import SubscriptionGuard
from coordinator.server.timers import CoreTimer
from coordinator.server.transport import (
    FrameHandler,
    FrameReader,
    RateLimitedLog,
    bind_socket,
    make_endpoint,
    new_ipc_dir,
    write_address_file,
)

log = logging.getLogger("coordinator.server")

# Sockets whose connections are numbered and watched (server.connections).
MONITORED: Mapping[str, ConnectionSocket] = {"handshake": "handshake", "dispatch": "dispatch"}


class AddressFileError(Exception):
    """The address file cannot be written (a configuration error)."""


class CoordinatorServer:
    """Owns the sockets of one coordinator process and feeds its core."""

    def __init__(self, config: ServerConfig, *, clock: Callable[[], float] = time.monotonic):
        config.validate()
        self.config = config
        self.clock = clock
        admin_keys = frozenset[str]()
        if config.admin_keys_dir is not None:
            admin_keys = frozenset(key.decode("ascii")
                                   for key in load_client_keys(config.admin_keys_dir))
        self.core = CoordinatorCore(config.core_config(admin_keys), rng=random.Random(),
                                    now=clock())
        self.addresses: dict[str, str] = {}
        self.http: HttpEndpoints | None = None
        self.bootstrap: BootstrapServer | None = None
        self.curve: CurveServer | None = None
        self.counters: Counter[str] = Counter()
        """Failures of the server itself (``internal_error.*``), merged into the core's."""
        self._ipc_dir: str | None = None
        self._owns_ipc_dir = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._readers: dict[str, FrameReader | StatsReader | FrontendReader] = {}
        # Connection facts of the sockets whose peers claim ranks (server.connections).
        self._connections: dict[str, PeerConnections] = {}
        self._conn_ids = itertools.count(1)
        self.kv_plane: KVEventsPlane | None = None
        self._ratelog = RateLimitedLog(log, interval_s=config.log_interval_s, clock=clock)
        self.decision_times = DecisionTimes()
        self._observer = ObservedPusher(self.core, self._update_http, clock, self.decision_times)
        self._timer = CoreTimer(self.core, self.execute, clock=clock,
                                on_error=self._handler_failed, pokes=self._reader_pokes,
                                server_counters=self._own_counters)
        self._serving = False
        self.stopping = StopControl(self._feed, self.core.requests_in_flight, clock,
                                    graceful_stop_s=config.graceful_stop_s)
        self._sent_on: set[str] = set()
        """Sockets sent on by the actions being carried out; their readers are poked after."""
        self._runner = ActionRunner(self.core, {
            Send: self._run_send,
            DispatchAdd: self._run_dispatch_add,
            Publish: self._run_publish,
            Log: self._run_log,
            SaveState: self._run_save_state,
            SetLinger: self._run_set_linger,
            RefreshObserved: self._run_refresh,
            RearmTimer: self._run_rearm,
            CloseConnection: self._run_close_connection,
            StopProcess: self.stopping.request,
            **kv_action_runners(lambda: self.kv_plane),
        }, clock)
        # One handler per socket: frames in, actions carried out.
        self.feeders = Feeders(self.core, clock, self.execute, self.decision_times,
                               self._connections)
        self.gate = ConnectionGate(config.engines, config.frontends, config.log_interval_s, clock)
        self.subscriptions = SubscriptionGuard(self.gate, config.log_interval_s, clock)
        self.frame_handlers: dict[str, FrameHandler] = self.subscriptions.guarded(
            self.feeders.handlers())
        self._admin_dir: str | None = None

    # ---- setup and teardown -------------------------------------------------

    def bind(self) -> dict[str, str]:
        """Bind all six sockets, then write the address file; return the endpoints."""
        cfg = self.config
        if cfg.state_file is not None:
            check_writable(cfg.state_file)  # before anything is bound or announced
        if cfg.host is None:
            if cfg.ipc_dir is not None:
                os.makedirs(cfg.ipc_dir, exist_ok=True)
                self._ipc_dir = cfg.ipc_dir
            else:
                self._ipc_dir = new_ipc_dir()
                self._owns_ipc_dir = True
        ipc_dir = self._ipc_dir or ""
        self._ctx = zmq.Context()
        if self.core.follows_kv_events:
            core = self.core
            self.kv_plane = KVEventsPlane(
                self._ctx, self._feed, backlog_full=core.kv_backlog_full,
                pending=core.kv_pending,
                max_message_bytes=cfg.max_message_bytes("kv_events"),
                on_error=self._handler_failed)
        if cfg.curve_secret_key is not None and cfg.curve_clients_dir is not None:
            try:
                self.curve = CurveServer(self._ctx, cfg.curve_secret_key,
                                         cfg.curve_clients_dir, admin_dir=cfg.admin_keys_dir)
            except ValueError as exc:
                self.close()
                raise CurveKeyError(str(exc)) from None
            self.curve.start()
        try:
            for index, (key, kind, options) in enumerate(socket_specs(cfg)):
                port = cfg.port_base + index if cfg.port_base is not None else 0
                endpoint = cfg.bind_overrides.get(key) or make_endpoint(
                    key, host=cfg.host, ipc_dir=ipc_dir, port=port
                )
                try:
                    sock, resolved = bind_socket(
                        self._ctx, kind, endpoint, max_message_bytes=cfg.max_message_bytes(key),
                        options=options, configure=self._configurer(key, endpoint),
                    )
                except zmq.ZMQError as exc:
                    raise zmq.ZMQError(exc.errno, f"socket {key} on {endpoint}: "
                                                  f"{exc.strerror}") from None
                self._sockets[key] = sock
                self.addresses[key] = resolved
            # In --ipc-dir with --host too: a service's private /tmp would hide it.
            admin, self.addresses["admin"], self._admin_dir = bind_admin(
                self._ctx, self._ipc_dir or cfg.ipc_dir, cfg.max_message_bytes("admin"))
            self._sockets["admin"] = admin
        except (zmq.ZMQError, OSError):
            self.close()
            raise
        if self.curve is not None and not any(
                address.startswith("tcp://") for address in self.addresses.values()):
            log.warning("CURVE keys were given but every socket is on ipc://, where CURVE "
                        "is not used: the keys protect nothing here (file permissions "
                        "guard ipc sockets); bind tcp with --host to use them")
        engine_facing = {key: self.addresses[key] for key in SOCKET_KEYS}
        self._feed(Bound(engine_facing, build_parallel_config(cfg)))
        if cfg.state_file is not None:
            saved = load_state(cfg.state_file)  # raises StateFileError if unusable
            if saved is None:
                log.info("no state file at %s yet; starting empty", cfg.state_file)
            else:
                self._feed(Restore(saved, cfg.state_file))
        self.bootstrap = bootstrap_server(cfg, self.core, self.clock, self.execute)
        if self.bootstrap is not None:
            self.addresses["kv_bootstrap"] = self.bootstrap.bind()
        if cfg.metrics_port is not None:
            self.http = HttpEndpoints(cfg.metrics_host, cfg.metrics_port, clock=self.clock)
            self.http.start()  # logs its URL
        if cfg.addr_file:
            try:
                write_address_file(cfg.addr_file, self.addresses)
            except OSError as exc:
                self.close()
                raise AddressFileError(f"cannot write the address file {cfg.addr_file}: "
                                       f"{exc.strerror or exc}") from None
        return dict(self.addresses)

    def _configurer(self, key: str, endpoint: str) -> Callable[[zmq.Socket[bytes]], None]:
        """What is set on socket ``key`` before it binds: CURVE on tcp, and the monitor of a
        socket whose peers claim ranks (so that no connection is missed)."""
        curve = self.curve if endpoint.startswith("tcp://") else None

        def configure(sock: zmq.Socket[bytes]) -> None:
            if curve is not None:
                curve.configure_socket(sock)
            gate = self.gate.attach(key, sock, monitored=key in MONITORED)
            if key in MONITORED:
                self._connections[key] = PeerConnections(sock, MONITORED[key], self._conn_ids,
                                                         self._feed, gate)

        return configure

    def close(self) -> None:
        if self.config.state_file is not None and self._serving:
            # Only a process that served may speak for the group.
            self.execute([SaveState(self.core.saved_state(), durable=True)])
        if self.http is not None:
            self.http.stop()
            self.http = None
        if self.bootstrap is not None:
            self.bootstrap.close()
        for connections in self._connections.values():
            connections.close()
        self._connections.clear()
        self.gate.close()
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
        self.remove_files()

    def remove_files(self) -> None:
        """Remove the ipc sockets, their directories and the address file.

        Safe to call twice, and on its own for a forced exit that skips the rest of
        close()."""
        for endpoint in self.addresses.values():
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint[len("ipc://"):])
        if self._ipc_dir is not None and self._owns_ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._admin_dir is not None:
            shutil.rmtree(self._admin_dir, ignore_errors=True)
            self._admin_dir = None
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
        self._readers = {}
        feeders = self.feeders
        for key, handler in self.frame_handlers.items():
            if key in ("back_output", "frontend"):
                continue
            connections = self._connections.get(key)
            self._readers[key] = FrameReader(
                self._sockets[key], handler, name=key, on_error=self._handler_failed,
                source=connections.source if connections else self.subscriptions.source(key),
                max_message_bytes=self.config.max_message_bytes(key),
                on_oversize=feeders.oversize(key, self.config.max_message_bytes(key)),
                on_address=feeders.on_dispatch_peer if (
                    key == "dispatch" and binds_tcp(self.config, "dispatch")) else None)
        monitors = {key: (c.monitor, c.on_monitor_message) for key, c in self._connections.items()}
        for key, (monitor, on_event) in {**monitors, **self.gate.monitors()}.items():
            self._readers[f"{key}.monitor"] = FrameReader(
                monitor, on_event, name=f"{key}.monitor", on_error=self._handler_failed)
        self._readers["back_output"] = StatsReader(
            self._sockets["back_output"], self.core, self.execute, clock=self.clock,
            on_error=self._handler_failed,
            max_message_bytes=self.config.max_message_bytes("back_output"))
        limit = self.config.max_message_bytes("frontend")
        self._readers["frontend"] = FrontendReader(
            self._sockets["frontend"], self.core, self._runner.run, self.settle,
            clock=self.clock, on_error=self._handler_failed, max_message_bytes=limit,
            on_oversize=feeders.oversize("frontend", limit),
            observe_decision=self.decision_times.observe, curve=self.curve is not None)
        tasks = [asyncio.ensure_future(reader.run()) for reader in self._readers.values()]
        tasks.append(asyncio.ensure_future(self._timer.run()))
        if self.kv_plane is not None:
            tasks.append(asyncio.ensure_future(self.kv_plane.run()))
        if self.bootstrap is not None:
            tasks.append(asyncio.ensure_future(self.bootstrap.run()))
        stopper = asyncio.ensure_future(self.stopping.until_stopped(stop))
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

    def reload_curve_clients(self) -> str:
        """Re-read the CURVE client keys (SIGHUP); says what was reloaded."""
        if self.curve is None:
            return "nothing to reload (no CURVE client keys are in use)"
        count = self.curve.reload_clients()
        return f"reloaded {count} CURVE client keys from {self.curve.clients_dir}"

    def _feed(self, event: Event) -> None:
        self.feeders.feed(event)

    def _handler_failed(self, socket_name: str, exc: BaseException) -> None:
        self.counters[f"internal_error.{socket_name}"] += 1
        # Rate limited: a bug that one kind of message triggers must not flood the log.
        self._ratelog.log(logging.ERROR, f"internal:{socket_name}",
                          "internal error while handling a %s message", socket_name,
                          exc_info=exc)

    def _own_counters(self) -> Mapping[str, int]:
        counters = {**self.counters, **self.gate.counters(), **self.subscriptions.counters()}
        if self.curve is not None:
            counters.update(self.curve.counters())
        return counters

    def _reader_pokes(self) -> list[Callable[[], None]]:
        return [reader.poke for reader in self._readers.values()]

    # ---- carrying out actions -----------------------------------------------

    def execute(self, actions: Sequence[Action]) -> None:
        """Carry out ``actions`` in order, then whatever the core answered to their outcomes
        (``core.runner``); then poke the readers of the sockets sent on."""
        self._runner.run(actions)
        self.settle()

    def settle(self) -> None:
        # After every send, not between them: a first request's wake leaves right
        # after its ADD, without a look at the dispatch socket in between.
        sent_on = self._sent_on
        while sent_on:
            self._poke(sent_on.pop())

    def _send_frames(self, key: str, identity: bytes, frames: Sequence[bytes],
                     kind: bytes | None = None) -> SendFailure | None:
        try:
            if kind is None:
                send_routed(self._sockets[key], identity, frames)
            else:
                send_add(self._sockets[key], identity, kind, frames)
        except zmq.Again:
            return "full"
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return "unreachable"
        finally:
            self._sent_on.add(key)
        return None

    def _run_send(self, action: Send) -> SendFailed | SendSucceeded | None:
        failure = self._send_frames(action.socket, action.identity, action.frames)
        if failure is not None:
            return SendFailed(action, failure)
        if action.confirm:
            connections = self._connections.get(action.socket) if action.conn else None
            heard = connections.heard_ago(action.conn) if connections is not None else None
            return SendSucceeded(action, heard)
        return None

    def _run_close_connection(self, action: CloseConnection) -> None:
        connections = self._connections.get(action.socket)
        if connections is not None and connections.cut(action.conn):
            log.info("cut a stale connection on %s that still held an identity",
                     action.socket)

    def _run_dispatch_add(self, action: DispatchAdd) -> SendFailed | None:
        # The runner carries out the wake and the reply once the ADD is handed over.
        failure = self._send_frames("dispatch", action.engine, action.payload, vllm.ADD)
        return None if failure is None else SendFailed(action, failure)

    def _run_publish(self, action: Publish) -> None:
        send_frames(self._sockets[action.socket], action.frames)
        self._sent_on.add(action.socket)

    def _run_log(self, action: Log) -> None:
        if action.key is None:
            log.log(action.level, action.message, *action.args, extra=action.extra())
        else:
            self._ratelog.log(action.level, action.key, action.message, *action.args,
                              extra=action.extra())

    def _run_save_state(self, action: SaveState) -> StateSaveFailed | None:
        path = self.config.state_file
        if path is None:
            return None
        try:
            save_state(path, action.state, durable=action.durable)
        except OSError as exc:
            return StateSaveFailed(path, str(exc))
        return None

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
        # (see FrameReader): have the socket's reader look again if one is waiting.
        reader = self._readers.get(key)
        if reader is not None:
            poke_if_readable(self._sockets[key], reader.poke)
