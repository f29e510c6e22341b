"""Drive a ``CoordinatorCore`` event by event, the way the server does, without sockets.

``Driver`` keeps the server's side of the contract (``coordinator.core.actions``):
it carries out every action in order into plain lists, reports every send's
outcome back to the core at once (``SendFailed`` for peers a test made
unreachable, ``SendSucceeded`` for confirmed sends) and carries out what the
core answers after the current actions, with the same ``core.runner.ActionRunner``
that ``CoordinatorServer.execute`` uses, so the order lives in one place. Helpers
build the events that engines and frontends cause, and decode what the core sent
back with the protocol package's decoders.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.actions import (
    Action,
    CloseConnection,
    DispatchAdd,
    KVRequestReplay,
    KVSubscribe,
    KVUnsubscribe,
    Log,
    Publish,
    RearmTimer,
    RefreshObserved,
    SaveState,
    Send,
    SetLinger,
    StopProcess,
)
from coordinator.core.coordinator import CoordinatorCore, CoreConfig
from coordinator.core.events import (
    ENGINE_SUBSCRIBED,
    FRONTEND_SUBSCRIBED,
    TICK,
    Bound,
    EngineGreeted,
    Event,
    FrontendRequestReceived,
    HandshakeReceived,
    PeerConnected,
    PeerDisconnected,
    SendFailed,
    SendSucceeded,
)
from coordinator.core.persisted import SavedState
from coordinator.core.runner import ActionRunner, Carrier
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import rank_to_identity

ADDRESSES = {
    "handshake": "ipc:///run/h", "dispatch": "ipc:///run/d", "back_output": "ipc:///run/bo",
    "back_publish": "ipc:///run/bp", "front_publish": "ipc:///run/fp",
    "frontend": "ipc:///run/fe",
}
PARALLEL: dict[str, int | str | list[int]] = {
    "data_parallel_master_ip": "127.0.0.1", "data_parallel_master_port": 29500,
    "_data_parallel_master_port_list": [29501], "data_parallel_size": 4,
}


OPERATOR = b"\x00operator"


def frontend_identity(index: int) -> bytes:
    return b"\x00fe-" + bytes([index])


@dataclass
class Driver:
    """A core plus the record of everything it asked for; see the module docstring."""

    core: CoordinatorCore
    now: float = 0.0
    unreachable: set[tuple[str, bytes]] = field(default_factory=set)
    """(socket, identity) pairs whose sends fail as 'unreachable'."""
    last_heard: dict[tuple[str, bytes], float] = field(default_factory=dict)
    """(socket, identity) -> when anything last arrived on its connection, reported with
    a confirmed send that names one, as the server measures tcp connections."""
    cut: list[tuple[str, int]] = field(default_factory=list)
    """Connections the core asked to cut (CloseConnection)."""
    sends: list[tuple[str, bytes, list[bytes]]] = field(default_factory=list)
    publishes: list[tuple[str, list[bytes]]] = field(default_factory=list)
    logs: list[Log] = field(default_factory=list)
    stops: list[StopProcess] = field(default_factory=list)
    saves: list[SavedState] = field(default_factory=list)
    lingers: dict[str, int] = field(default_factory=dict)
    rearms: int = 0
    refreshes: int = 0
    failed_sends: list[SendFailed] = field(default_factory=list)
    kv_actions: list[KVSubscribe | KVUnsubscribe | KVRequestReplay] = field(default_factory=list)
    _runner: ActionRunner | None = None
    _calls: int = 0

    @classmethod
    def start(cls, *, now: float = 0.0, seed: int = 0, **config: Any) -> Driver:
        settings: dict[str, Any] = {"rank_start": 0, "engines": 2}
        settings.update(config)
        core = CoordinatorCore(CoreConfig(**settings), rng=random.Random(seed), now=now)
        driver = cls(core, now=now)
        driver.feed(Bound(dict(ADDRESSES), dict(PARALLEL)))
        return driver

    # ---- the server's side -----------------------------------------------------------------

    def feed(self, event: Event, now: float | None = None) -> Sequence[Action]:
        """Hand the core one event at ``now`` (default: the driver's clock) and carry out
        everything that follows; returns the core's direct answer."""
        if now is not None:
            self.now = now
        actions = self.core.handle(event, self.now)
        self.execute(actions)
        return actions

    def execute(self, actions: Sequence[Action]) -> None:
        """Carry out ``actions`` with the server's own runner (``core.runner``)."""
        if self._runner is None:
            self._runner = ActionRunner(self.core, self._carriers(), lambda: self.now)
        self._runner.run(actions)

    def _carriers(self) -> dict[type, Carrier]:
        def record(into: list[Any]) -> Carrier:
            def carry(action: Any) -> None:
                into.append(action)
            return carry
        return {
            Send: self._send, DispatchAdd: self._dispatch_add,
            Publish: lambda a: self.publishes.append((a.socket, list(a.frames))),
            Log: record(self.logs), SaveState: lambda a: self.saves.append(a.state),
            SetLinger: lambda a: self.lingers.__setitem__(a.socket, a.linger_ms),
            RefreshObserved: lambda a: self._count("refreshes"),
            RearmTimer: lambda a: self._count("rearms"),
            CloseConnection: lambda a: self.cut.append((a.socket, a.conn)),
            StopProcess: record(self.stops),
            KVSubscribe: self._kv_action, KVUnsubscribe: self._kv_action,
            KVRequestReplay: self._kv_action,
        }

    def _count(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)

    def _kv_action(self, action: KVSubscribe | KVUnsubscribe | KVRequestReplay) -> None:
        self.kv_actions.append(action)

    def _send(self, action: Send) -> Event | None:
        if (action.socket, action.identity) in self.unreachable:
            return self._failed(SendFailed(action, "unreachable"))
        self.sends.append((action.socket, action.identity, list(action.frames)))
        if action.confirm:
            at = self.last_heard.get((action.socket, action.identity))
            heard = None if at is None or not action.conn else self.now - at
            return SendSucceeded(action, heard)
        return None

    def _dispatch_add(self, action: DispatchAdd) -> Event | None:
        if ("dispatch", action.engine) in self.unreachable:
            return self._failed(SendFailed(action, "unreachable"))
        self.sends.append(("dispatch", action.engine, [vllm.ADD, *action.payload]))
        return None

    def _failed(self, event: SendFailed) -> SendFailed:
        self.failed_sends.append(event)
        return event

    # ---- engines ---------------------------------------------------------------------------

    def hello(self, rank: int, engine_id: str | None = None, *, conn: int = 0,
              **fields: Any) -> None:
        # An engine with an id is this project's SDK, which also sends its protocol version.
        fields.setdefault("protocol_version", None if engine_id is None else 1)
        message = vllm.HandshakeMessage("HELLO", engine_id=engine_id, **fields)
        self.feed(HandshakeReceived(rank_to_identity(rank), rank, message, conn))

    def ready(self, rank: int, config_hash: str | None = None, *, conn: int = 0) -> None:
        message = vllm.HandshakeMessage("READY", parallel_config_hash=config_hash)
        self.feed(HandshakeReceived(rank_to_identity(rank), rank, message, conn))

    def greet(self, rank: int, *, conn: int = 0) -> None:
        self.feed(EngineGreeted(rank, conn))

    def connected(self, socket: Any, conn: int, peer: str = "") -> None:
        """Connection ``conn`` was accepted on ``socket`` ("handshake" or "dispatch")."""
        self.feed(PeerConnected(socket, conn, peer))

    def disconnected(self, socket: Any, conn: int) -> None:
        self.feed(PeerDisconnected(socket, conn))

    def subscribe(self, times: int = 1) -> None:
        for _ in range(times):
            self.feed(ENGINE_SUBSCRIBED)

    def join(self, rank: int, engine_id: str | None = None) -> None:
        """HELLO, READY and the dispatch greeting of one engine."""
        self.hello(rank, engine_id)
        self.ready(rank)
        self.greet(rank)

    def start_group(self, ranks: Sequence[int]) -> None:
        """Every rank joins, then subscribes: the gate opens."""
        for rank in ranks:
            self.join(rank)
        self.subscribe(len(ranks))

    def report(self, rank: int, *, wave_complete: int | None = None,
               start_wave: int | None = None, wave: int | None = None, step: int = 0,
               waiting: int = 0, running: int = 0, kv: float = 0.0) -> Sequence[Action]:
        stats = None if wave is None else vllm.SchedulerLoad(
            num_running_reqs=running, num_waiting_reqs=waiting, step_counter=step,
            current_wave=wave, kv_cache_usage=kv)
        return self.feed(vllm.EngineReport(engine_index=rank, scheduler_stats=stats,
                                           wave_complete=wave_complete, start_wave=start_wave))

    def tick(self, now: float) -> None:
        """Let the clock run to ``now``, ticking at every deadline on the way as the
        server's timer does, then at ``now`` itself."""
        for _ in range(100_000):
            due = self.core.next_deadline()
            if due >= now:
                break
            self.feed(TICK, max(self.now, due))
        else:  # pragma: no cover - deadlines that never advance are a bug
            raise AssertionError("the core's deadlines do not advance")
        self.feed(TICK, now)

    def stall(self, now: float) -> None:
        """The coordinator did not run until ``now`` (stopped, frozen): one late tick."""
        self.feed(TICK, now)

    # ---- frontends -------------------------------------------------------------------------

    def request(self, identity: bytes, message: fp.FrontendRequest,
                payload: Sequence[bytes] = ()) -> list[fp.FrontendReply]:
        """Send one frontend request; return the replies it caused to that frontend."""
        before = len(self.sends)
        self.feed(FrontendRequestReceived(identity, message, list(payload)))
        return [fp.decode_reply(frames[0]) for socket, ident, frames in self.sends[before:]
                if socket == "frontend" and ident == identity]

    def operator(self, message: fp.FrontendRequest,
                 identity: bytes = OPERATOR) -> list[fp.FrontendReply]:
        """A request on the operators' owner-only ``admin`` socket; the replies it caused."""
        before = len(self.sends)
        self.feed(FrontendRequestReceived(identity, message, [], "admin"))
        return [fp.decode_reply(frames[0]) for socket, ident, frames in self.sends[before:]
                if socket == "admin" and ident == identity]

    def call_id(self) -> int:
        self._calls += 1
        return self._calls

    def register(self, index: int, *, identity: bytes | None = None,
                 output: str | None = None) -> fp.FrontendReply:
        identity = identity if identity is not None else frontend_identity(index)
        output = output if output is not None else f"ipc:///run/out-{index}"
        (reply,) = self.request(identity, fp.Register(self.call_id(), index, output))
        return reply

    def submit(self, request_id: str, *, frontend: int = 0, wave: int = 0,
               rank: int | None = None, identity: bytes | None = None) -> fp.FrontendReply:
        identity = identity if identity is not None else frontend_identity(frontend)
        replies = self.request(identity, fp.Submit(self.call_id(), request_id, wave, rank),
                               [b"payload:" + request_id.encode()])
        (reply,) = [r for r in replies if isinstance(r, (fp.Submitted, fp.ErrorReply))]
        return reply

    def subscribe_frontend(self) -> None:
        self.feed(FRONTEND_SUBSCRIBED)

    # ---- what the core sent ----------------------------------------------------------------

    def sent_to(self, socket: str, identity: bytes) -> list[list[bytes]]:
        return [frames for s, ident, frames in self.sends if s == socket and ident == identity]

    def replies(self, identity: bytes) -> list[fp.FrontendReply]:
        return [fp.decode_reply(frames[0]) for frames in self.sent_to("frontend", identity)]

    def handshake_replies(self, rank: int) -> list[vllm.HandshakeReply]:
        return [vllm.decode_handshake_reply(frames[0])
                for frames in self.sent_to("handshake", rank_to_identity(rank))]

    def adds(self, rank: int) -> list[list[bytes]]:
        """Payloads of the ADDs sent to ``rank``."""
        return [frames[1:] for frames in self.sent_to("dispatch", rank_to_identity(rank))
                if frames[0] == vllm.ADD]

    def probes(self, rank: int) -> int:
        empty = vllm.encode_abort([])
        return sum(1 for frames in self.sent_to("dispatch", rank_to_identity(rank))
                   if frames == [vllm.ABORT, empty])

    def back_publish(self) -> list[object]:
        """What went out on back_publish: "READY" or a decoded (wave, exclude)."""
        out: list[object] = []
        for socket, frames in self.publishes:
            if socket == "back_publish":
                out.append("READY" if frames == [vllm.READY] else
                           vllm.decode_start_dp_wave(frames))
        return out

    def wakes(self) -> list[tuple[int, int | None]]:
        return [item for item in self.back_publish() if isinstance(item, tuple)]

    def front_publishes(self) -> list[Any]:
        """Decoded front_publish messages; 2-wide rows are returned undecoded."""
        out = []
        for socket, frames in self.publishes:
            if socket == "front_publish":
                out.append(vllm.decode_front_publish(frames[0]))
        return out

    def log_text(self) -> str:
        return "\n".join(log.message % log.args for log in self.logs)
