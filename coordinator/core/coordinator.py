"""The coordinator's every decision, in one sans-IO core: events in, actions out.

Theory of operation
-------------------
``CoordinatorCore`` composes the machines of this package, each of which owns
one rule and says so in its own docstring:

==========================  =================================================
machine                     rule
==========================  =================================================
``membership.Membership``   who holds each rank: HELLO/READY verdicts, leases
``liveness``                which quiet engines are probed, what answers mean
``gate.StartGate``          READY on ``back_publish``, and the wake held for it
``waves.WaveState``         the wave table: wakes, relays, pauses
``frontends``               registrations, the address pin, the INIT hold
``requests``                submit admission and the in-flight ledger
``balancer``                per-rank load and the policy that picks a rank
``publishing``              when full ``[counts, wave, running]`` go out
``watchdog``, ``recorder``  hang alerts; the flight recorder and wave times
``kv_plane``, ``kv_stream`` each rank's KV events, in order, into the index
``router``                  the ``prefix`` policy: the routing rule's inputs
==========================  =================================================

and adds the glue between them: what an event means for each machine, and
which frames, logs and counters follow. The glue is split by who sent the
event: ``engine_rules`` (handshakes, greetings, reports, the gate, the lease
and watchdog timers) and ``frontend_rules`` (registrations and requests), over
the shared state and helpers of ``context``, with ``kv_rules`` (KV event
publishers and their batches) and ``route_rules`` (the choice of a rank, and
``route`` calls) beside them; this module dispatches events and
handles the rest (send outcomes, timers, the process's own life, bad input).
Feed it with ``handle(event, now)``;
it returns the actions to carry out, in order (usually none or one).
``next_deadline()`` says when to feed the next ``Tick``. Queries
(``group_state``, ``saved_state``, ``counter_values`` and the machines
themselves) never change anything.

Hot paths stay short: a stats report (``on_engine_report``) touches the lease,
the load row and the watchdog, and returns no actions unless the wave moved or
the next publish became due sooner; a submit to a running group picks a rank
and returns one ``DispatchAdd``.

A ``DispatchAdd`` is committed when it is handed out (ledger, load, counters).
If the ADD cannot be sent, the server says so (``SendFailed``) before feeding
anything else, and the commit is undone before the next rank is tried, so no
other event ever sees it.

No IO, no asyncio, no clock: time comes in as ``now`` (monotonic seconds) and
randomness from the ``rng`` the caller passes in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from logging import ERROR, INFO, WARNING
from typing import Any

from coordinator.core.actions import Action, DispatchAdd, SendPurpose, SetLinger, SocketName
from coordinator.core.config import CoreConfig
from coordinator.core.engine_rules import EngineRules
from coordinator.core.events import (
    BadFrame,
    Bound,
    DumpRecorder,
    EngineGreeted,
    EngineSubscribed,
    EngineUnsubscribed,
    Event,
    FrontendRequestReceived,
    FrontendSubscribed,
    FrontendUnsubscribed,
    HandshakeReceived,
    KVBadMessage,
    KVBatchReceived,
    KVDrain,
    KVPublisherConnected,
    KVPublisherDisconnected,
    KVReplayEnded,
    PeerConnected,
    PeerDisconnected,
    Restore,
    SendFailed,
    SendSucceeded,
    Shutdown,
    StateSaveFailed,
    Tick,
)
from coordinator.core.frontend_rules import FrontendRules
from coordinator.core.observe.recorder import KIND_MEMBERSHIP
from coordinator.core.ranks import liveness
from coordinator.core.ranks.membership import RankState, Refused
from coordinator.core.waves.table import WaveState
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import identity_to_rank

__all__ = ["CoordinatorCore", "CoreConfig"]

SHUTDOWN_LINGER_MS = 500
# ADDs acknowledged `submitted` but still queued for a slow engine: flushed for at
# most this long at a clean shutdown, then dropped (the process must still exit).
DISPATCH_FLUSH_LINGER_MS = 3_000
_PROBES = (SendPurpose.PROBE_LEASE, SendPurpose.PROBE_HOLDER)


class CoordinatorCore(EngineRules, FrontendRules):
    """Every rule of one coordinator process; see the module docstring."""

    def __init__(self, config: CoreConfig, *, rng: random.Random, now: float) -> None:
        super().__init__(config, rng=rng, now=now)
        # Handlers take their own event type; the table is keyed by that type.
        self._handlers: dict[type, Callable[[Any, float], None]] = {
            HandshakeReceived: self._on_handshake,
            EngineGreeted: self._on_greeted,
            PeerConnected: self._on_peer_connected,
            PeerDisconnected: self._on_peer_disconnected,
            vllm.EngineReport: self._on_engine_report,
            EngineSubscribed: self._on_engine_subscribed,
            EngineUnsubscribed: self._on_engine_unsubscribed,
            FrontendSubscribed: self._on_frontend_subscribed,
            FrontendUnsubscribed: self._ignore,
            vllm.ScaleElasticEP: self._on_resize,
            vllm.LegacyFirstRequest: self._on_legacy_first_request,
            FrontendRequestReceived: self._on_frontend_request,
            KVBatchReceived: self._on_kv_batch,
            KVReplayEnded: self._on_kv_replay_ended,
            KVBadMessage: self._on_kv_bad_message,
            KVPublisherConnected: self._on_kv_publisher_connected,
            KVPublisherDisconnected: self._on_kv_publisher_disconnected,
            KVDrain: self._on_kv_drain,
            BadFrame: self._on_bad_frame,
            SendFailed: self._on_send_failed,
            SendSucceeded: self._on_send_succeeded,
            Tick: self._on_tick,
            Bound: self._on_bound,
            Restore: self._on_restore,
            StateSaveFailed: self._on_state_save_failed,
            Shutdown: self._on_shutdown,
            DumpRecorder: self._on_dump_recorder,
        }

    # ---- the API ---------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> Sequence[Action]:
        """Apply one event; return the actions to carry out, in order."""
        self._handlers[type(event)](event, now)
        return self._flush()

    def on_engine_report(self, report: vllm.EngineReport, now: float) -> Sequence[Action]:
        """``handle`` for the hot path's event, without the lookup."""
        self._on_engine_report(report, now)
        return self._flush()

    def note_stats_superseded(self, count: int) -> None:
        """``count`` stats reports were not fed in: a newer one of the same engine was.

        A batched reader skips them (see ``coordinator.server.stats_reader``); only
        the counter ``stats.superseded`` changes.
        """
        self._stats_superseded += count

    def skippable_wave(self) -> int:
        """The newest wave a stats report may name and change nothing but its load row.

        A report naming a newer wave moves the group's wave (see ``WaveState``), so a
        reader may skip only reports up to this one in favour of newer ones.
        """
        return self.waves.current_wave if self.config.lockstep else vllm.MAX_WAVE

    def step_state(self) -> tuple[tuple[int, int] | None, bool] | None:
        """What the lockstep step snapshot depends on: the step mark and whether the rows
        changed since the last publish (None in dense mode, which takes no snapshots).
        A batched reader may skip a report only where these decide the same without it."""
        if not self.config.lockstep:
            return None
        return self.loads.step_mark, self.loads.changed

    def next_deadline(self) -> float:
        """When the next ``Tick`` is due (monotonic seconds)."""
        deadline = min(self._next_lease_check, self._next_observe)
        if self.gate.is_open:
            changed = self.loads.changed or self._publish_requested
            deadline = min(deadline, self.schedule.next_due(changed=changed))
        if self._save_retry_at is not None:
            deadline = min(deadline, self._save_retry_at)
        replay_deadline = self._kv_deadline()
        if replay_deadline is not None:
            deadline = min(deadline, replay_deadline)
        return deadline

    # ---- send outcomes ---------------------------------------------------------------------

    def _on_send_failed(self, event: SendFailed, now: float) -> None:
        action = event.action
        socket: SocketName = "dispatch" if isinstance(action, DispatchAdd) else action.socket
        self.counters[f"send_dropped.{socket}.{event.reason}"] += 1
        if isinstance(action, DispatchAdd):
            if event.reason == "unreachable":
                self.membership.mark_unreachable(action.rank)
            self._dispatch_failed(action, now)
        elif action.purpose in _PROBES:
            self._probe_answered(action.purpose, identity_to_rank(action.identity), False,
                                 None, now)
        else:
            self._send_failed_log(socket, action.identity)

    def _on_send_succeeded(self, event: SendSucceeded, now: float) -> None:
        action = event.action
        if action.purpose is SendPurpose.INIT:
            # The engine pushes to the addresses it carried for good: pin them. Nothing
            # changed in between: the outcome is reported right after the send.
            if self.frontends.pin_outputs():
                self._state_changed()
            if not self.frontends.inits_sent:
                self.frontends.inits_sent = True
                self._state_changed()
            rank = identity_to_rank(action.identity)
            self._log(INFO, "dp_rank=%d: sent INIT", rank, key=f"init:{rank}")
        elif action.purpose in _PROBES:
            self._probe_answered(action.purpose, identity_to_rank(action.identity), True,
                                 event.heard_ago_s, now)

    # ---- timers ----------------------------------------------------------------------------

    def _on_tick(self, event: Tick, now: float) -> None:
        pause = liveness.pause_of(min(self._next_lease_check, self._next_observe), now)
        if pause:
            self._credit_pause(pause, now)
            self.frontends.credit_pause(now)
        if now >= self._next_lease_check:
            self._next_lease_check = now + self._lease_interval_s
            self._check_leases(now)
            self._expire_frontends(now)
        if now >= self._next_observe:
            self._next_observe = now + self.config.observe_interval_s
            self._observe(now)
        changed = self.loads.changed or self._publish_requested
        if self.gate.is_open and self.schedule.due(now, changed=changed):
            self._publish_full(now)
        if self._save_retry_at is not None and now >= self._save_retry_at:
            self._save_retry_at = None
            self._state_changed()
        self._kv_timer(now)

    # ---- the process's own life ------------------------------------------------------------

    def _on_bound(self, event: Bound, now: float) -> None:
        self.addresses = dict(event.addresses)
        self.parallel_config = dict(event.parallel_config)
        self._kv_start()

    def _on_restore(self, event: Restore, now: float) -> None:
        """Resume from a previous process's state file (see core.persisted)."""
        saved = event.saved
        moved = {k: v for k, v in saved.addresses.items() if self.addresses.get(k) != v}
        if moved:
            self._log(WARNING, "the state file was written by a coordinator bound elsewhere "
                      "(%s); engines and frontends connected there will not find this one. "
                      "Use --ipc-dir, or --host with --port-base, for stable addresses",
                      ", ".join(sorted(moved)))
        self.waves = WaveState(lockstep=self.config.lockstep, wave=saved.wave,
                               rewake_after_s=self.config.rewake_after_s)
        for item in saved.leases:
            result = self.membership.restore(
                item.rank, engine_id=item.engine_id, incarnation=item.incarnation,
                state=RankState(item.state), local=item.local, headless=item.headless,
                parallel_config_hash=item.parallel_config_hash, now=now,
            )
            if isinstance(result, Refused):
                self._log(WARNING, "state file: %s", result.message)
        self.frontends.restore(saved.frontends, inits_sent=saved.inits_sent, now=now,
                               pinned=saved.pinned)
        if saved.gate_open:
            # Engines already passed the start-up gate; their reconnecting subscriptions
            # only get READY again, which they ignore.
            self.gate.restore_open()
            self.schedule.start(now)
        self._record(now, KIND_MEMBERSHIP, "restored from state file", path=event.path,
                     leases=len(saved.leases), frontends=len(saved.frontends))
        self._log(INFO, "restored from %s: wave %d, %d registrations, %d frontends, gate %s",
                  event.path, saved.wave, len(saved.leases), len(saved.frontends),
                  "open" if saved.gate_open else "closed")

    def _on_state_save_failed(self, event: StateSaveFailed, now: float) -> None:
        self.counters["state_file.write_errors"] += 1
        self._save_retry_at = now + self.config.state_retry_s
        self._log(ERROR, "could not write the state file %s: %s", event.path, event.error,
                  key="state-write")

    def _on_shutdown(self, event: Shutdown, now: float) -> None:
        """Stop taking work and tell everyone, before the sockets close."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self._notify_frontends(fp.ShuttingDown(event.reason))
        if self.gate.is_open:
            self._publish_full(now)
        # Give the goodbye messages a moment to leave; closing would drop them.
        self._out.append(SetLinger("frontend", SHUTDOWN_LINGER_MS))
        self._out.append(SetLinger("front_publish", SHUTDOWN_LINGER_MS))
        self._out.append(SetLinger("dispatch", DISPATCH_FLUSH_LINGER_MS))

    def _on_dump_recorder(self, event: DumpRecorder, now: float) -> None:
        for line in self.recorder.format_lines(None, now=now):
            self._log(INFO, "%s", line)

    def _on_bad_frame(self, event: BadFrame, now: float) -> None:
        error, socket = event.error, event.socket
        if socket == "handshake" and error.reason != "frame_count":
            identity = event.identity or b""
            if event.rank is None:
                self._refuse_handshake(identity, error.reason, error.message, now)
            else:
                self._refuse_handshake(identity, error.reason, f"bad handshake payload from "
                                       f"dp_rank={event.rank}: {error.message}", now)
            return
        self._drop(socket, error.reason, error.message)
        if event.identity is None:
            return
        if socket == "handshake" and event.frame_count > 2:
            self._handshake_error(event.identity, "expected exactly one payload frame")
        elif socket in ("frontend", "admin") and event.frame_count >= 2:
            code = fp.ERR_TOO_LARGE if error.reason == "too_large" else fp.ERR_BAD_FRAME
            self._send(socket, event.identity,
                       (fp.encode(fp.ErrorReply(event.call_id, code, error.message)),))
