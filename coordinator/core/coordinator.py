"""The coordinator's every decision, in one sans-IO core: events in, actions out.

Theory of operation
-------------------
The rules live in domain packages, each with its machines, the handlers that
apply them and what it shows:

==============  ===============================================================
package         decides
==============  ===============================================================
``ranks``       who holds each rank (leases, claims), what a probe proves, who
                may change membership; the rank span an elastic resize moves
``waves``       the wave table, the start-up gate and the wake it holds, the
                hang watchdog
``dispatch``    admission and the in-flight ledger, the load table and the
                policies, the prefix rule, one tie rule, the session table
``frontends``   registrations and their leases, the address pin, the INIT hold
``kv``          each rank's KV event stream, the prefix index
``bootstrap``   the KV bootstrap registry: who holds each DP rank's entry
``observe``     counters and the flight recorder, when full publishes go out,
                the views (``state``, the state file, the operators' view)
==============  ===============================================================

``CoordinatorCore`` is the handler table (each event type to the one domain
handler that takes it), the stats hot path (``on_engine_report``), the wiring
of the domains (one's dependencies on another are constructor arguments), and
the explicit fan-out of the few facts that cross domains (``RankFanout``): a
rank changed state or left (its requests fail, its cache is forgotten, the
group's wave moves), a new incarnation replaced a rank, a dead rank came
back, an engine's HELLO was accepted (its INIT goes out, or waits for the
frontends), a drain was asked for. It also handles the process's own life:
start-up, restore, the timer, send outcomes, shutdown, bad input.

Feed it with ``handle(event, now)``; it returns the actions to carry out, in
order (usually none or one), and ``core.runner.ActionRunner`` carries them
out in the order the contract fixes. ``next_deadline()`` says when to feed
the next ``Tick``. Queries (``group_state``, ``saved_state``,
``counter_values``, ``operator_view`` and the domains' machines) never change
anything.

Hot paths stay short: a stats report touches the lease, the load row and the
watchdog, and returns no actions unless the wave moved or the next publish
became due sooner; a submit to a running group picks a rank and returns one
``DispatchAdd``.

No IO, no asyncio, no clock: time comes in as ``now`` (monotonic seconds) and
randomness from the ``rng`` the caller passes in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from logging import ERROR, INFO, WARNING
from typing import Any

from coordinator.core.actions import (
    NO_ACTIONS,
    REARM_TIMER,
    REFRESH_OBSERVED,
    REFRESH_OBSERVED_NOW,
    Action,
    DispatchAdd,
    Publish,
    SaveState,
    SendPurpose,
    SetLinger,
    SocketName,
    StopProcess,
)
from coordinator.core.bootstrap.handlers import BootstrapHandlers
from coordinator.core.bootstrap.payload import PayloadBounds, RegisterWorkerPayload
from coordinator.core.bootstrap.registry import Decision, ProbeNeeded
from coordinator.core.config import CoreConfig
from coordinator.core.dispatch.choice import RankChoice
from coordinator.core.dispatch.handlers import DispatchHandlers
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
    GracefulStop,
    HandshakeReceived,
    KVBadMessage,
    KVBatchReceived,
    KVDrain,
    KVPublisherConnected,
    KVPublisherDisconnected,
    KVReplayEnded,
    KVReplayUnsent,
    KVSubscribeFailed,
    PeerConnected,
    PeerDisconnected,
    Restore,
    SendFailed,
    SendSucceeded,
    ServerCounters,
    Shutdown,
    StateSaveFailed,
    Tick,
)
from coordinator.core.frontends.handlers import FrontendHandlers
from coordinator.core.kv.handlers import KVHandlers
from coordinator.core.observe.journal import Journal
from coordinator.core.observe.publishing import PublishSchedule
from coordinator.core.observe.recorder import KIND_MEMBERSHIP, FlightRecorder
from coordinator.core.observe.views import CoreViews, OperatorView
from coordinator.core.outbox import Outbox
from coordinator.core.persisted import SavedState
from coordinator.core.ranks import liveness
from coordinator.core.ranks.authority import (
    Authority,
    authority,
    not_authorized_message,
    resize_refusal,
)
from coordinator.core.ranks.handlers import RankHandlers
from coordinator.core.ranks.membership import RankChanged, RankState, Refused
from coordinator.core.ranks.span import RankSpan
from coordinator.core.waves.handlers import WaveHandlers
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import identity_to_rank

__all__ = ["CoordinatorCore", "CoreConfig"]

SHUTDOWN_LINGER_MS = 500
# ADDs acknowledged `submitted` but still queued for a slow engine: flushed for at
# most this long at a clean shutdown, then dropped (the process must still exit).
DISPATCH_FLUSH_LINGER_MS = 3_000


class CoordinatorCore:
    """Every rule of one coordinator process, composed; see the module docstring."""

    def __init__(self, config: CoreConfig, *, rng: random.Random, now: float) -> None:
        self.config = config
        self.span = RankSpan(config.rank_start, config.engines)
        self.schedule = PublishSchedule(
            min_interval_s=config.publish_interval_s, heartbeat_s=config.heartbeat_s,
            first_publish_delay_s=config.first_publish_delay_s,
        )
        self.recorder = FlightRecorder(config.recorder_size)
        self.journal = Journal(self.recorder, self._wave_snapshot)
        counters = self.journal.counters
        self.waves = WaveHandlers(config, self.journal, self.span, self.schedule,
                                  lambda: self.ranks.all_dead(), now=now)
        self.ranks = RankHandlers(config, self.journal, self.span, self, now=now)
        self.kv = KVHandlers(config.kv, counters, self.span)
        choice = RankChoice(config, counters, self.span, self.ranks.membership, rng,
                            self.kv.index)
        self.dispatch = DispatchHandlers(config, self.journal, self.span,
                                         self.ranks.membership, choice, self.waves,
                                         self._frontend_identities, self._blind_ranks)
        self.frontends = FrontendHandlers(config, self.journal, self.span,
                                          self.dispatch.requests, self.waves)
        sizes = config.kv_bootstrap
        self.bootstrap = None if sizes is None else BootstrapHandlers(PayloadBounds(
            range(config.rank_start, config.rank_start + max(config.engines, config.max_engines)),
            sizes.tp_size, sizes.pp_size), self.journal)
        self.views = CoreViews(journal=self.journal, span=self.span, lockstep=config.lockstep,
                               policy=config.policy, ranks=self.ranks, waves=self.waves,
                               dispatch=self.dispatch, frontends=self.frontends, kv=self.kv,
                               hot_counters=self._hot_counters, version=config.version,
                               bootstrap=self.bootstrap)
        # Machines read often enough to deserve a short name (the stats hot path).
        self.membership = self.ranks.membership
        self.loads = choice.loads
        self._out = Outbox()
        self._persist = config.persist
        self._row_width = config.row_width
        self._publish_requested = False
        self._next_observe = now + config.observe_interval_s
        self._save_retry_at: float | None = None
        # Hot counters as plain ints, merged into counter_values().
        self._stats_reports = 0
        self._stats_superseded = 0
        self._handlers: dict[type, Callable[[Any, float, Outbox], None]] = {
            HandshakeReceived: lambda e, now, out: self.ranks.on_handshake(e, now, out),
            EngineGreeted: self._on_greeted,
            PeerConnected: lambda e, now, out: self.ranks.on_peer_connected(e, now),
            PeerDisconnected: lambda e, now, out: self.ranks.on_peer_disconnected(e, out),
            vllm.EngineReport: lambda e, now, out: self._on_engine_report(e, now, out),
            EngineSubscribed: lambda e, now, out: self.waves.on_engine_subscribed(now, out),
            EngineUnsubscribed: lambda e, now, out: self.waves.on_engine_unsubscribed(out),
            FrontendSubscribed: self._on_frontend_subscribed,
            FrontendUnsubscribed: lambda e, now, out: None,  # the last subscriber leaving
            vllm.ScaleElasticEP: self._on_resize,
            vllm.LegacyFirstRequest: self.waves.on_frontend_wake,
            FrontendRequestReceived: self._on_frontend_request,
            KVBatchReceived: self.kv.on_batch,
            KVReplayEnded: self.kv.on_replay_ended,
            KVBadMessage: self.kv.on_bad_message,
            KVPublisherConnected: self.kv.on_publisher_connected,
            KVPublisherDisconnected: lambda e, now, out: self.kv.on_publisher_disconnected(
                e, out),
            KVDrain: lambda e, now, out: self.kv.drain(),
            KVSubscribeFailed: lambda e, now, out: self.kv.on_subscribe_failed(e, out),
            KVReplayUnsent: self.kv.on_replay_unsent,
            ServerCounters: self._on_server_counters,
            BadFrame: self._on_bad_frame,
            SendFailed: self._on_send_failed,
            SendSucceeded: self._on_send_succeeded,
            Tick: self._on_tick,
            Bound: self._on_bound,
            Restore: self._on_restore,
            StateSaveFailed: self._on_state_save_failed,
            Shutdown: self._on_shutdown,
            GracefulStop: self._on_graceful_stop,
            DumpRecorder: self._on_dump_recorder,
        }

    # ---- the API ---------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> Sequence[Action]:
        """Apply one event; return the actions to carry out, in order."""
        self._handlers[type(event)](event, now, self._out)
        return self._flush()

    def on_engine_report(self, report: vllm.EngineReport, now: float) -> Sequence[Action]:
        """``handle`` for the hot path's event, without the lookup."""
        self._on_engine_report(report, now, self._out)
        return self._flush()

    def note_stats_superseded(self, count: int) -> None:
        """``count`` stats reports were not fed in: a newer one of the same engine was.

        A batched reader skips them (see ``coordinator.server.stats_reader``); only
        the counter ``stats.superseded`` changes.
        """
        self._stats_superseded += count

    def group_paused(self) -> bool:
        """True while a submit would wake a lockstep group (paused, or woken and not yet
        heard running): a reader keeps anything but the decision off that request's path."""
        return self.config.lockstep and not self.waves.table.snapshot()[1]

    def skippable_wave(self) -> int:
        """The newest wave a stats report may name and change nothing but its load row.

        A report naming a newer wave moves the group's wave (see ``WaveState``), so a
        reader may skip only reports up to this one in favour of newer ones.
        """
        return self.waves.table.current_wave if self.config.lockstep else vllm.MAX_WAVE

    def step_state(self) -> tuple[tuple[int, int] | None, bool] | None:
        """What the lockstep step snapshot depends on: the step mark and whether the rows
        changed since the last publish (None in dense mode, which takes no snapshots).
        A batched reader may skip a report only where these decide the same without it
        (``dispatch.balancer.step_snapshot``)."""
        if not self.config.lockstep:
            return None
        return self.loads.step_mark, self.loads.changed

    def next_deadline(self) -> float:
        """When the next ``Tick`` is due (monotonic seconds)."""
        deadline = min(self.ranks.next_lease_check, self._next_observe)
        if self.waves.gate.is_open:
            changed = self.loads.changed or self._publish_requested
            deadline = min(deadline, self.schedule.next_due(changed=changed))
        if self._save_retry_at is not None:
            deadline = min(deadline, self._save_retry_at)
        replay_deadline = self.kv.next_deadline()
        if replay_deadline is not None:
            deadline = min(deadline, replay_deadline)
        return deadline

    # ---- queries ---------------------------------------------------------------------------

    @property
    def rank_range(self) -> range:
        """The ranks this coordinator manages now (an elastic resize changes it)."""
        return self.span.range

    @property
    def shutting_down(self) -> bool:
        return self.dispatch.shutting_down

    def counter_values(self) -> dict[str, int]:
        return self.views.counter_values()

    def requests_in_flight(self) -> int:
        """Requests dispatched and not yet finished, failed or aborted."""
        return len(self.dispatch.requests)

    def group_state(self, now: float) -> fp.GroupState:
        return self.views.group_state(now)

    def saved_state(self) -> SavedState:
        return self.views.saved_state()

    def operator_view(self, now: float) -> OperatorView:
        return self.views.operator_view(now)

    @property
    def follows_kv_events(self) -> bool:
        """Whether the core follows the engines' KV event publishers."""
        return self.kv.plane is not None

    def kv_backlog_full(self) -> bool:
        """The KV events queued for the index reached their bound: read no more for now."""
        plane = self.kv.plane
        return plane is not None and plane.backlog_full

    def kv_pending(self) -> bool:
        """KV events are queued for the index (a ``KVDrain`` would apply some)."""
        plane = self.kv.plane
        return plane is not None and plane.pending_blocks > 0

    # ---- the KV bootstrap registry (server.bootstrap moves its requests) -------------------

    def bootstrap_register(self, payload: RegisterWorkerPayload, now: float, *,
                           probed: bool = False) -> tuple[Decision, Sequence[Action]]:
        """One registration's decision, and the actions it owes (a state-file write)."""
        return self._bootstrap().register(payload, now, self._out, probed=probed), self._flush()

    def bootstrap_probe_answered(self, probe: ProbeNeeded, alive: bool,
                                 now: float) -> Sequence[Action]:
        self._bootstrap().probe_answered(probe, alive, now, self._out)
        return self._flush()

    def _bootstrap(self) -> BootstrapHandlers:
        if self.bootstrap is None:
            raise RuntimeError("this core serves no KV bootstrap registry (no kv_bootstrap)")
        return self.bootstrap

    def wake_latencies_since(self, cursor: int) -> tuple[list[float], int]:
        """Wake latencies measured after ``cursor``, and the next cursor (a query)."""
        return self.waves.timeline.wake_latencies_since(cursor)

    def _hot_counters(self) -> Mapping[str, int]:
        return {"stats.reports": self._stats_reports,
                "stats.superseded": self._stats_superseded,
                "submit.dispatched": self.dispatch.dispatched}

    def _wave_snapshot(self) -> tuple[int, bool]:
        return self.waves.table.snapshot()

    def _frontend_identities(self) -> list[bytes]:
        return self.frontends.registry.identities()

    def _blind_ranks(self, identity: bytes) -> set[int]:
        return self.frontends.registry.blind_ranks(identity)

    # ---- outputs ---------------------------------------------------------------------------

    def _flush(self) -> Sequence[Action]:
        out = self._out
        actions = out.actions
        if out.save_due:
            out.save_due = False
            if self._persist:
                actions.append(SaveState(self.views.saved_state()))
        if out.refresh_due:
            out.refresh_due = False
            actions.append(REFRESH_OBSERVED)
        if not actions:
            return NO_ACTIONS
        out.actions = []
        return actions

    def _publish_full(self, now: float, out: Outbox) -> None:
        rows = self.loads.take_publish_rows()
        wave, running = self.waves.table.snapshot()
        out.add(Publish("front_publish", (
            vllm.encode_front_publish_rows(rows, wave, running) if self._row_width == 3
            else vllm.encode_front_publish(rows, wave, running, row_width=self._row_width),
        )))
        self.schedule.published(now)
        self._publish_requested = False
        self.journal.counters["publish.full"] += 1

    # ---- the stats hot path ----------------------------------------------------------------

    def _on_engine_report(self, msg: vllm.EngineReport, now: float, out: Outbox) -> None:
        rank = msg.engine_index
        if rank not in self.span:
            self.journal.drop(out, "back_output", "rank_out_of_range", f"engine_index={rank}")
            return
        self.membership.touch(rank, now)
        waves = self.waves
        if msg.wave_complete is not None or msg.start_wave is not None:
            if msg.wave_complete is not None:
                cause = f"wave_complete({msg.wave_complete}) from rank {rank}"
            else:
                cause = f"start_wave({msg.start_wave}) from rank {rank}"
            waves.apply(waves.table.on_engine_output(rank, msg.wave_complete, msg.start_wave,
                                                     now=now),
                        now, out, cause=cause, rank=rank)
        stats = msg.scheduler_stats
        if stats is None:
            return
        loads = self.loads
        was_changed = loads.changed
        outcome = loads.apply_stats(
            rank, waiting=stats.num_waiting_reqs, running=stats.num_running_reqs,
            kv_cache_usage=stats.kv_cache_usage, wave=stats.current_wave,
            step=stats.step_counter, lockstep=self.config.lockstep,
        )
        router = self.dispatch.choice.router
        if router is not None:
            router.on_report(rank)
        if outcome.stale:
            self.journal.counters["stats.stale"] += 1
            out.log(INFO, "dp_rank=%d reported (wave %d, step %d), behind its previous "
                    "report; counters restarted?", rank, stats.current_wave,
                    stats.step_counter, key=f"stale:{rank}")
        self._stats_reports += 1
        waves.watchdog.observe_stats(rank, wave=stats.current_wave, step=stats.step_counter,
                                     now=now)
        if not was_changed and loads.changed:
            out.add(REARM_TIMER)  # a publish is now due sooner
        reported = waves.table.on_reported_wave(rank, stats.current_wave)
        if reported:
            waves.apply(reported, now, out,
                        cause=f"stats from rank {rank} report wave {stats.current_wave}",
                        rank=rank)

    # ---- the fan-out (ranks.handlers.RankFanout) -------------------------------------------

    def rank_changed(self, change: RankChanged, now: float, out: Outbox) -> None:
        out.state_changed()
        self.journal.record(now, KIND_MEMBERSHIP, change.cause, rank=change.rank,
                            old=change.old.value if change.old else None,
                            new=change.new.value if change.new else None)
        out.refresh()
        out.log(INFO, "dp_rank=%d: %s -> %s (%s)", change.rank,
                change.old.value if change.old else "absent",
                change.new.value if change.new else "absent", change.cause,
                key=f"rank:{change.rank}:{change.new.value if change.new else 'absent'}",
                event="rank_state", rank=change.rank,
                old=change.old.value if change.old else "absent",
                new=change.new.value if change.new else "absent", cause=change.cause)
        if change.new not in (RankState.DEAD, None):
            return
        if self.bootstrap is not None:
            if change.new is None:
                self.bootstrap.rank_superseded(change.rank, "the rank left the group", out)
            else:
                self.bootstrap.rank_died(change.rank, out)
        self.journal.counters["lease.dead"] += 1
        lease = self.membership.lease(change.rank)
        # It may come back (ranks.liveness): the group keeps its wave and running state,
        # which its engines still share, and what fails here is aborted on the engine then.
        # Its KV index is kept too: the same engine comes back with the same cache, its
        # publisher is still followed, and a dead rank is never routed to meanwhile. Only
        # an engine gone for good (or replaced, below) takes its index with it.
        returns = lease is not None and lease.died_from is not None
        if not returns:
            self.kv.forget_rank(change.rank, "rank_gone")
        self.dispatch.fail_rank(change.rank, change.cause, out,
                                may_return_as=lease.incarnation if returns and lease else None)
        if not returns:
            self.waves.group_changed(now, out, cause=f"dp_rank={change.rank} left: "
                                     f"{change.cause}", rank=change.rank)
        if self.config.lockstep:
            out.log(ERROR, "dp_rank=%d is gone (%s): in lockstep mode the group cannot "
                    "finish a wave until it is back", change.rank, change.cause,
                    key=f"gone:{change.rank}", event="rank_gone", rank=change.rank,
                    cause=change.cause)

    def rank_replaced(self, rank: int, now: float, out: Outbox) -> None:
        if self.bootstrap is not None:
            self.bootstrap.rank_superseded(rank, "a new incarnation took the rank", out)
        self.kv.forget_rank(rank, "rank_replaced")
        self.dispatch.fail_rank(rank, "the engine was replaced by a new incarnation", out)
        self.waves.group_changed(now, out, cause=f"dp_rank={rank} has a new incarnation",
                                 rank=rank)

    def rank_revived(self, rank: int, incarnation: int, out: Outbox) -> None:
        if self.bootstrap is not None:
            self.bootstrap.rank_revived(rank, out)
        self.dispatch.rank_revived(rank, incarnation, out)

    def new_incarnation(self, rank: int) -> None:
        if self.bootstrap is not None:  # its HELLO's acceptance saves and refreshes
            self.bootstrap.registry.rank_superseded(rank, "a new incarnation said HELLO")
        self.dispatch.new_incarnation(rank)

    def engine_said_hello(self, rank: int, identity: bytes, out: Outbox) -> None:
        self.frontends.engine_said_hello(rank, identity, out)

    def drain_requested(self, rank: int, out: Outbox) -> None:
        self.dispatch.maybe_drained(rank, out)

    # ---- events that cross domains ---------------------------------------------------------

    def _on_greeted(self, event: EngineGreeted, now: float, out: Outbox) -> None:
        if self.ranks.on_greeted(event, now, out):
            # Not from a connection that spoofs a live rank: what it says of the engine's
            # KV event publisher is followed (vLLM's own launcher may have done the
            # handshake, so an unregistered greeting counts too).
            self.kv.greeted(event, out)

    def _on_frontend_subscribed(self, event: FrontendSubscribed, now: float,
                                out: Outbox) -> None:
        # A new subscriber missed every earlier publish: send it a full one soon instead
        # of leaving it blind until the next heartbeat (vLLM: up to 5 s).
        self.journal.counters["front.subscriptions"] += 1
        self._publish_requested = True
        out.add(REARM_TIMER)

    def _on_resize(self, event: vllm.ScaleElasticEP, now: float, out: Outbox) -> None:
        config, span = self.config, self.span
        count = event.new_count - span.start
        if count < 1:
            self.journal.drop(out, "front_publish", "bad_value", f"SCALE_ELASTIC_EP "
                              f"{event.new_count} leaves no ranks above rank_start={span.start}")
            return
        refusal = resize_refusal(count, current=len(span),
                                 min_engines=config.min_engines or config.engines,
                                 max_engines=config.max_engines or config.engines)
        if refusal is not None:
            self.journal.counters["refused.front_publish.scale_out_of_range"] += 1
            out.log(WARNING, "%s", refusal, key="resize-refused", event="refused",
                    refused="scale_elastic_ep", reason="scale_out_of_range", requested=count)
            return
        out.log(INFO, "SCALE_ELASTIC_EP: %d -> %d engines", len(span), count, key="resize")
        before = span.range
        for change in self.membership.resize(count):
            self.rank_changed(change, now, out)
        span.end = span.start + count
        self.dispatch.choice.resize(span.end)
        self.kv.resized(before, out)
        self.waves.gate.expected = count
        out.add(REARM_TIMER)

    def _on_frontend_request(self, event: FrontendRequestReceived, now: float,
                             out: Outbox) -> None:
        message = event.message
        if event.channel == "admin":
            self._on_operator_request(event, now, out)
            return
        self.frontends.registry.touch(event.identity, now)
        # Structs of one union, tested most frequent first (submit is the hot path).
        if isinstance(message, fp.Submit):
            self.dispatch.on_submit(event.identity, message, event.payload, now, out)
        elif isinstance(message, fp.Finished):
            self.dispatch.on_finished(message, out)
        elif isinstance(message, fp.Heartbeat):
            self.frontends.on_heartbeat(event.identity, message, now, out)
        elif isinstance(message, fp.Register):
            self.frontends.on_register(event.identity, message, now, out)
        elif isinstance(message, fp.Route):
            self.dispatch.on_route(event.identity, message, out)
        elif isinstance(message, fp.Abort):
            self.dispatch.on_abort(event.identity, message, out)
        elif isinstance(message, fp.QueryState):
            out.reply(event.identity, fp.StateReply(message.call_id, self.group_state(now)))
        elif isinstance(message, fp.Admin):
            operator = authority(event.channel, event.user_id, self.config.admin_keys)
            self._on_admin("frontend", event.identity, message, now, out,
                           operator=operator is Authority.OPERATOR)

    def _on_operator_request(self, event: FrontendRequestReceived, now: float,
                             out: Outbox) -> None:
        """The owner-only admin socket: operators' commands and state queries, nothing else."""
        message = event.message
        if type(message) is fp.Admin:
            self._on_admin("admin", event.identity, message, now, out, operator=True)
        elif type(message) is fp.QueryState:
            out.answer("admin", event.identity,
                       fp.StateReply(message.call_id, self.group_state(now)))
        else:
            self.journal.drop(out, "admin", "wrong_socket", type(message).__name__)
            out.answer("admin", event.identity, fp.ErrorReply(
                fp.call_id_of(message), fp.ERR_BAD_FRAME, "the admin socket takes only "
                "'admin' and 'state' messages; frontends use the frontend socket"))

    def _on_admin(self, socket: SocketName, identity: bytes, msg: fp.Admin, now: float,
                  out: Outbox, *, operator: bool) -> None:
        if not operator:
            self.journal.counters["refused.admin.not_authorized"] += 1
            out.log(WARNING, "refused %s dp_rank=%d from a frontend connection that is not "
                    "an operator (see ranks.authority)", msg.command, msg.rank,
                    key="admin:not_authorized", event="refused", refused="admin",
                    reason="not_authorized", command=msg.command, rank=msg.rank)
            out.answer(socket, identity, fp.ErrorReply(
                msg.call_id, fp.ERR_NOT_AUTHORIZED, not_authorized_message(msg.command)))
            return
        if msg.command in fp.PROCESS_COMMANDS:
            self._on_stop_command(socket, identity, msg, now, out)
            return
        self.ranks.on_admin(socket, identity, msg, now, out)

    # ---- send outcomes ---------------------------------------------------------------------

    def _on_send_failed(self, event: SendFailed, now: float, out: Outbox) -> None:
        action = event.action
        socket: SocketName = "dispatch" if isinstance(action, DispatchAdd) else action.socket
        self.journal.counters[f"send_dropped.{socket}.{event.reason}"] += 1
        if isinstance(action, DispatchAdd):
            if event.reason == "unreachable":
                self.membership.mark_unreachable(action.rank)
            self.dispatch.dispatch_failed(action, now, out)
        elif self.ranks.is_probe(action.purpose):
            self.ranks.probe_answered(action.purpose, identity_to_rank(action.identity), False,
                                      None, now, out)
        else:
            out.send_failed(socket, action.identity)

    def _on_send_succeeded(self, event: SendSucceeded, now: float, out: Outbox) -> None:
        action = event.action
        if action.purpose is SendPurpose.INIT:
            self.frontends.init_sent(identity_to_rank(action.identity), out)
        elif self.ranks.is_probe(action.purpose):
            self.ranks.probe_answered(action.purpose, identity_to_rank(action.identity), True,
                                      event.heard_ago_s, now, out)

    # ---- timers ----------------------------------------------------------------------------

    def _on_tick(self, event: Tick, now: float, out: Outbox) -> None:
        ranks = self.ranks
        pause = liveness.pause_of(min(ranks.next_lease_check, self._next_observe), now)
        if pause:
            ranks.credit_pause(pause, now, out)
            self.frontends.registry.credit_pause(now)
        if now >= ranks.next_lease_check:
            ranks.next_lease_check = now + ranks.lease_interval_s
            ranks.check_leases(now, out)
            for rank in sorted(self.frontends.expire(now, ranks.lease_interval_s, out)):
                self.dispatch.maybe_drained(rank, out)
        if now >= self._next_observe:
            self._next_observe = now + self.config.observe_interval_s
            self.waves.on_observe_timer(now, out)
            out.add(REFRESH_OBSERVED_NOW)
        changed = self.loads.changed or self._publish_requested
        if self.waves.gate.is_open and self.schedule.due(now, changed=changed):
            self._publish_full(now, out)
        if self._save_retry_at is not None and now >= self._save_retry_at:
            self._save_retry_at = None
            out.state_changed()
        self.kv.on_timer(now, out)

    # ---- the process's own life ------------------------------------------------------------

    def _on_bound(self, event: Bound, now: float, out: Outbox) -> None:
        self.frontends.addresses = dict(event.addresses)
        self.frontends.parallel_config = dict(event.parallel_config)
        self.kv.start(out)

    def _on_restore(self, event: Restore, now: float, out: Outbox) -> None:
        """Resume from a previous process's state file (see core.persisted)."""
        saved = event.saved
        addresses = self.frontends.addresses
        moved = {k: v for k, v in saved.addresses.items() if addresses.get(k) != v}
        if moved:
            out.log(WARNING, "the state file was written by a coordinator bound elsewhere "
                    "(%s); engines and frontends connected there will not find this one. "
                    "Use --ipc-dir, or --host with --port-base, for stable addresses",
                    ", ".join(sorted(moved)))
        self.waves.restore(saved.wave, gate_open=saved.gate_open, now=now)
        for item in saved.leases:
            result = self.membership.restore(
                item.rank, engine_id=item.engine_id, incarnation=item.incarnation,
                state=RankState(item.state), local=item.local, headless=item.headless,
                parallel_config_hash=item.parallel_config_hash, now=now,
            )
            if isinstance(result, Refused):
                out.log(WARNING, "state file: %s", result.message)
        self.frontends.registry.restore(saved.frontends, inits_sent=saved.inits_sent, now=now,
                                        pinned=saved.pinned)
        if self.bootstrap is not None and saved.kv_bootstrap:
            self.bootstrap.restore(saved.kv_bootstrap, now, out)
        self.journal.record(now, KIND_MEMBERSHIP, "restored from state file", path=event.path,
                            leases=len(saved.leases), frontends=len(saved.frontends))
        out.log(INFO, "restored from %s: wave %d, %d registrations, %d frontends, gate %s",
                event.path, saved.wave, len(saved.leases), len(saved.frontends),
                "open" if saved.gate_open else "closed", event="restored", path=event.path,
                wave=saved.wave, registrations=len(saved.leases),
                frontends=len(saved.frontends), gate_open=saved.gate_open)

    def _on_state_save_failed(self, event: StateSaveFailed, now: float, out: Outbox) -> None:
        self.journal.counters["state_file.write_errors"] += 1
        self._save_retry_at = now + self.config.state_retry_s
        out.log(ERROR, "could not write the state file %s: %s", event.path, event.error,
                key="state-write")

    def _on_shutdown(self, event: Shutdown, now: float, out: Outbox) -> None:
        """Stop taking work and tell everyone, before the sockets close."""
        if self.dispatch.shutting_down:
            return
        self.dispatch.shutting_down = True
        out.notify(self._frontend_identities(), fp.ShuttingDown(event.reason))
        if self.waves.gate.is_open:
            self._publish_full(now, out)
        # Give the goodbye messages a moment to leave; closing would drop them.
        out.add(SetLinger("frontend", SHUTDOWN_LINGER_MS))
        out.add(SetLinger("front_publish", SHUTDOWN_LINGER_MS))
        out.add(SetLinger("dispatch", DISPATCH_FLUSH_LINGER_MS))

    def _on_graceful_stop(self, event: GracefulStop, now: float, out: Outbox) -> None:
        """Planned maintenance: admission closes (``dispatch.stopping``) while what is in
        flight finishes; the server stops the process once nothing is left."""
        dispatch = self.dispatch
        if dispatch.stopping or dispatch.shutting_down:
            return
        dispatch.stopping = True
        self.journal.counters["shutdown.graceful"] += 1
        self.journal.record(now, KIND_MEMBERSHIP, "graceful stop", reason=event.reason,
                            in_flight=len(dispatch.requests))
        out.refresh()
        out.log(INFO, "graceful stop (%s): refusing new submits; %d requests in flight",
                event.reason, len(dispatch.requests), event="graceful_stop",
                reason=event.reason, in_flight=len(dispatch.requests))

    def _on_stop_command(self, socket: SocketName, identity: bytes, msg: fp.Admin,
                         now: float, out: Outbox) -> None:
        graceful = msg.command == "graceful_stop"
        self.journal.counters[f"admin.{msg.command}"] += 1
        if graceful:
            self._on_graceful_stop(GracefulStop("an operator's graceful stop"), now, out)
        out.answer(socket, identity, fp.AdminDone(msg.call_id, msg.rank, "stopping"))
        out.add(SetLinger(socket, SHUTDOWN_LINGER_MS))  # the answer must outlive the close
        out.add(StopProcess(graceful))

    def _on_dump_recorder(self, event: DumpRecorder, now: float, out: Outbox) -> None:
        for line in self.recorder.format_lines(None, now=now):
            out.log(INFO, "%s", line)

    def _on_server_counters(self, event: ServerCounters, now: float, out: Outbox) -> None:
        self.views.server_counters = dict(event.values)

    def _on_bad_frame(self, event: BadFrame, now: float, out: Outbox) -> None:
        error, socket = event.error, event.socket
        if socket == "handshake" and error.reason != "frame_count":
            identity = event.identity or b""
            if event.rank is None:
                self.ranks.refuse_handshake(identity, error.reason, error.message, now, out)
            else:
                self.ranks.refuse_handshake(identity, error.reason, f"bad handshake payload "
                                            f"from dp_rank={event.rank}: {error.message}",
                                            now, out)
            return
        self.journal.drop(out, socket, error.reason, error.message)
        if event.identity is None:
            return
        if socket == "handshake" and event.frame_count > 2:
            self.ranks.handshake_error(event.identity, "expected exactly one payload frame",
                                       out)
        elif socket in ("frontend", "admin") and event.frame_count >= 2:
            code = fp.ERR_TOO_LARGE if error.reason == "too_large" else fp.ERR_BAD_FRAME
            out.answer(socket, event.identity,
                       fp.ErrorReply(event.call_id, code, error.message))
