"""The state every rule of the core shares: the composed machines, the outbox, the glue.

``CoreContext`` builds the machines of this package from ``CoreConfig`` and
holds what an event produces while it is handled: the actions (``_out``), and
whether the state file or the operators' snapshot must be refreshed once the
event is done (``_flush``). It also holds the glue that both sides of the
core need: applying the wave machine's actions (through the start-up gate),
what a rank leaving or changing state means (its requests fail, the group
pauses), drain notices, full publishes, and the read-only views
(``group_state``, ``saved_state``, ``counter_values``).

The rules themselves are in ``engine_rules`` (engines, the wave plane,
liveness) and ``frontend_rules`` (frontends: registration and requests);
``coordinator.CoordinatorCore`` puts them together and dispatches events.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from logging import DEBUG, ERROR, INFO, WARNING

from coordinator.core.actions import (
    NO_ACTIONS,
    REFRESH_OBSERVED,
    Action,
    Log,
    Publish,
    SaveState,
    Send,
    SendPurpose,
    SocketName,
)
from coordinator.core.config import CoreConfig
from coordinator.core.dispatch.balancer import BalancePolicy, LoadTable, make_policy
from coordinator.core.dispatch.ledger import RequestLedger
from coordinator.core.dispatch.prefix_policy import PREFIX_POLICY, PrefixRouter
from coordinator.core.dispatch.prefix_rule import RoutingConfig, SessionAffinity
from coordinator.core.events import HandshakeReceived
from coordinator.core.frontends.registry import FrontendRegistry
from coordinator.core.kv.plane import KVPlane
from coordinator.core.observe.publishing import PublishSchedule
from coordinator.core.observe.recorder import (
    KIND_MEMBERSHIP,
    KIND_WAKE,
    KIND_WAVE,
    FlightRecorder,
    WaveTimeline,
)
from coordinator.core.persisted import STATE_VERSION, SavedLease, SavedState
from coordinator.core.ranks import liveness
from coordinator.core.ranks.claims import SilentConnections
from coordinator.core.ranks.membership import EngineLease, Membership, RankChanged, RankState
from coordinator.core.waves.gate import GateStep, StartGate
from coordinator.core.waves.table import BroadcastStartWave, PublishWave, WaveAction, WaveState
from coordinator.core.waves.watchdog import HangWatchdog
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm

# Registrations that survive a coordinator restart (see core.persisted).
_SETTLED = (RankState.READY, RankState.CORDONED, RankState.DRAINING)


class CoreContext:
    """The composed machines and the outbox; see the module docstring."""

    def __init__(self, config: CoreConfig, *, rng: random.Random, now: float) -> None:
        self.config = config
        self.counters: Counter[str] = Counter()
        self.membership = Membership(
            rank_start=config.rank_start, rank_count=config.engines,
            lease_ttl_s=config.lease_ttl_s, handshake_ttl_s=config.handshake_ttl_s,
        )
        self.waves = WaveState(lockstep=config.lockstep, rewake_after_s=config.rewake_after_s)
        self.loads = LoadTable(config.rank_start + config.engines)
        prefix = config.policy == PREFIX_POLICY
        # The prefix policy decides through the router; the plain policy answers the rest.
        self.policy: BalancePolicy = make_policy("least-loaded" if prefix else config.policy, rng)
        self.router = PrefixRouter(
            RoutingConfig(lockstep=config.lockstep, slack_tokens=config.prefix_slack_tokens),
            config.rank_start + config.engines) if prefix else None
        self.sessions = SessionAffinity()
        self.kv = KVPlane(config.kv) if config.kv is not None and config.kv.enabled else None
        self.schedule = PublishSchedule(
            min_interval_s=config.publish_interval_s, heartbeat_s=config.heartbeat_s,
            first_publish_delay_s=config.first_publish_delay_s,
        )
        self.gate = StartGate(config.engines)
        self.frontends = FrontendRegistry(
            expected=config.frontends, max_frontends=config.max_frontends,
            lease_ttl_s=config.frontend_lease_ttl_s,
        )
        self.requests = RequestLedger(max_in_flight=config.max_in_flight)
        self.recorder = FlightRecorder(config.recorder_size)
        self.watchdog = HangWatchdog(stall_after_s=config.watchdog_stall_s or 30.0)
        self.timeline = WaveTimeline(now=now)
        self.dispatched_by_rank: Counter[int] = Counter()
        self.addresses: dict[str, str] = {}
        self.parallel_config: dict[str, int | str | list[int]] = {}
        self.shutting_down = False
        self.extra_counters: Callable[[], Mapping[str, int]] | None = None
        """Counters kept outside the core (CURVE refusals), merged into every view."""
        self._rank_end = config.rank_start + config.engines
        self._row_width = config.row_width
        self._publish_requested = False
        self._quiet_after_s = liveness.quiet_after_s(config.lease_ttl_s)
        self._heard_within_s = liveness.heard_within_s(config.lease_ttl_s)
        self.silent_connections = SilentConnections()
        # Requests failed when a rank died, by rank: (incarnation, ids), aborted on the
        # engine if that incarnation comes back (its outputs would follow a failure).
        self._failed_at_death: dict[int, tuple[int, list[str]]] = {}
        self._lease_interval_s = liveness.check_interval_s(config.lease_ttl_s)
        self._next_lease_check = now + self._lease_interval_s
        self._next_observe = now + config.observe_interval_s
        self._save_retry_at: float | None = None
        self._hellos_probing: dict[int, HandshakeReceived] = {}
        # Which forms of the pre-0.33 frontend wake were logged (by identity bytes or not).
        self._frontend_wake_forms: set[bool] = set()
        self.vllm_versions: dict[int, str] = {}
        """The ``vllm_version`` each rank's greeting named (kept while it is in range)."""
        self._versions_differ_logged = False
        # Hot counters as plain ints, merged into counter_values().
        self._stats_reports = 0
        self._stats_superseded = 0
        self._dispatched = 0
        # Actions of the event being handled, and what to append once at its end.
        self._out: list[Action] = []
        self._save_due = False
        self._refresh_due = False

    @property
    def rank_range(self) -> range:
        """The ranks this coordinator manages now (an elastic resize changes it)."""
        return range(self.config.rank_start, self._rank_end)

    def counter_values(self) -> dict[str, int]:
        """Every counter by name, including those kept outside the core."""
        counters = dict(self.counters)
        if self._stats_reports:
            counters["stats.reports"] = self._stats_reports
        if self._stats_superseded:
            counters["stats.superseded"] = self._stats_superseded
        if self._dispatched:
            counters["submit.dispatched"] = self._dispatched
        if self.kv is not None or self.router is not None:
            counters.update(self._prefix_counters())
        if self.extra_counters is not None:
            counters.update(self.extra_counters())
        return counters

    def _prefix_counters(self) -> dict[str, int]:
        """The KV event and routing counters, under ``kv.`` and ``route.``."""
        out: dict[str, int] = {}
        kv = self.kv
        if kv is not None:
            for name, value in vars(kv.streams.counters).items():
                out[f"kv.{name}"] = value
            for kind, value in kv.counters.events.items():
                out[f"kv.events.{kind}"] = value
            out["kv.events.unknown"] = kv.counters.unknown_events
            for reason, value in kv.counters.bad_batches.items():
                out[f"kv.bad_batches.{reason}"] = value
            for cause, value in kv.counters.resets.items():
                out[f"kv.resets.{cause}"] = value
            if kv.index is not None:
                for name, value in vars(kv.index.counters).items():
                    out[f"prefix_index.{name}"] = value
        router = self.router
        if router is not None:
            for reason, value in router.counters.reasons.items():
                out[f"route.decisions.{reason}"] = value
            out["route.prompt_tokens"] = router.counters.prompt_tokens
            out["route.cached_tokens"] = router.counters.cached_tokens
            out["route.unmatched"] = router.counters.unmatched
        # Like every other counter, one appears once it counted something.
        return {name: value for name, value in out.items() if value}

    def group_state(self, now: float) -> fp.GroupState:
        """The group as the frontend protocol's ``state`` reply shows it."""
        wave, running = self.waves.snapshot()
        leases: dict[int, EngineLease] = {lease.rank: lease for lease in self.membership.leases()}
        engines: list[fp.EngineStatus] = []
        for rank in self.rank_range:
            load = self.loads.load(rank)
            lease = leases.get(rank)
            engines.append(fp.EngineStatus(
                rank=rank, state=lease.state.value if lease else "absent",
                engine_id=lease.engine_id if lease else None,
                waiting=load.waiting, running=load.running, kv_cache_usage=load.kv_cache_usage,
                dispatched_since_report=load.dispatched_since_report,
                in_flight=self.requests.count(rank),
                last_seen_age_s=round(now - lease.last_seen, 3) if lease else None,
                vllm_version=self.vllm_versions.get(rank) if lease else None,
            ))
        return fp.GroupState(
            wave=wave, running=running, lockstep=self.config.lockstep,
            rank_start=self.config.rank_start, rank_count=len(self.rank_range),
            frontends=len(self.frontends), in_flight=len(self.requests), engines=engines,
            counters=self.counter_values(), shutting_down=self.shutting_down,
        )

    def saved_state(self) -> SavedState:
        """What a restarted coordinator resumes from (see ``core.persisted``)."""
        leases = [
            SavedLease(lease.rank, lease.engine_id, lease.incarnation, lease.state.value,
                       lease.local, lease.headless, lease.parallel_config_hash)
            for lease in self.membership.leases() if lease.state in _SETTLED
        ]
        return SavedState(
            version=STATE_VERSION, wave=self.waves.current_wave, gate_open=self.gate.is_open,
            inits_sent=self.frontends.inits_sent, leases=leases,
            frontends=self.frontends.saved(), addresses=dict(self.addresses),
            pinned=self.frontends.pinned() or None,
        )

    # ---- outputs ---------------------------------------------------------------------------

    def _flush(self) -> Sequence[Action]:
        out = self._out
        if self._save_due:
            self._save_due = False
            out.append(SaveState(self.saved_state()))
        if self._refresh_due:
            self._refresh_due = False
            out.append(REFRESH_OBSERVED)
        if not out:
            return NO_ACTIONS
        self._out = []
        return out

    def _send(self, socket: SocketName, identity: bytes, frames: Sequence[bytes],
              purpose: SendPurpose = SendPurpose.REPLY, *, confirm: bool = False,
              conn: int = 0) -> None:
        self._out.append(Send(socket, identity, frames, purpose, confirm, conn))

    def _reply(self, identity: bytes, message: fp.FrontendReply,
               purpose: SendPurpose = SendPurpose.REPLY) -> None:
        self._out.append(Send("frontend", identity, (fp.encode(message),), purpose))

    def _notify_frontends(self, message: fp.FrontendReply) -> None:
        notice = (fp.encode(message),)
        for identity in self.frontends.identities():
            self._out.append(Send("frontend", identity, notice, SendPurpose.NOTICE))

    def _log(self, level: int, message: str, *args: object, key: str | None = None) -> None:
        self._out.append(Log(level, message, args, key))

    def _state_changed(self) -> None:
        """Registrations, frontends, the gate or the wave changed: a restart needs this."""
        if self.config.persist:
            self._save_due = True

    def _record(self, now: float, kind: str, cause: str, *, rank: int | None = None,
                **detail: object) -> None:
        wave, running = self.waves.snapshot()
        self.recorder.record(at=now, kind=kind, cause=cause, wave=wave, running=running,
                             rank=rank, **detail)

    def _drop(self, socket: SocketName, reason: str, detail: str, peer: str = "") -> None:
        """Count and (rate-limited) log one piece of bad input; state is untouched."""
        self.counters[f"dropped.{socket}.{reason}"] += 1
        self._log(WARNING, "dropped bad input on %s%s (%s): %s", socket,
                  f" from {peer}" if peer else "", reason, detail,
                  key=f"{socket}:{reason}:{peer}")

    def _ignore(self, event: object, now: float) -> None:
        """Events that change nothing (the last frontend subscriber leaving)."""

    # ---- waves -----------------------------------------------------------------------------

    def _apply_wave_actions(self, actions: Sequence[WaveAction], now: float, *, cause: str,
                            rank: int | None, coordinator_wake: bool = False) -> None:
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                self._wake(vllm.encode_start_dp_wave(action.wave, action.exclude))
                self.counters["waves.start_broadcasts"] += 1
                if coordinator_wake:
                    self.timeline.wake_sent(action.wave, now)
                self._record(now, KIND_WAKE, cause, rank=rank, exclude=action.exclude)
                self._log(DEBUG, "START_DP_WAVE [%d, %s] (%s)", action.wave, action.exclude,
                          cause)
            elif isinstance(action, PublishWave):
                self._out.append(Publish("front_publish", (
                    vllm.encode_front_publish(None, action.wave, action.running),
                )))
                self.counters["publish.wave"] += 1
                self.timeline.observe(action.wave, action.running, now)
                # The watchdog learns of the change at its next tick (O(ranks) work stays
                # off the wake path); the recorder and /debug/waves have it now.
                self._record(now, KIND_WAVE, cause, rank=rank)
                self._log(DEBUG, "wave %d %s (%s)", action.wave,
                          "running" if action.running else "paused", cause)
        if actions:
            self._state_changed()
            self._refresh_due = True

    def _wake(self, frames: list[bytes]) -> None:
        """A START_DP_WAVE, unless the gate holds it: nothing but READY may come first."""
        if self.gate.wake(frames) is GateStep.PASS:
            self._out.append(Publish("back_publish", frames))
        else:
            self.counters["waves.start_held_for_gate"] += 1

    # ---- membership changes ----------------------------------------------------------------

    def _on_rank_changed(self, change: RankChanged, now: float) -> None:
        self._state_changed()
        self._record(now, KIND_MEMBERSHIP, change.cause, rank=change.rank,
                     old=change.old.value if change.old else None,
                     new=change.new.value if change.new else None)
        self._refresh_due = True
        self._log(INFO, "dp_rank=%d: %s -> %s (%s)", change.rank,
                  change.old.value if change.old else "absent",
                  change.new.value if change.new else "absent", change.cause,
                  key=f"rank:{change.rank}:{change.new.value if change.new else 'absent'}")
        if change.new in (RankState.DEAD, None):
            self.counters["lease.dead"] += 1
            self._forget_rank_cache(change.rank, "rank_gone")
            failed = self._fail_rank_requests(change.rank, change.cause)
            lease = self.membership.lease(change.rank)
            if lease is not None and lease.died_from is not None:
                # It may come back (core.liveness): the group keeps its wave and running
                # state, which its engines still share, and what failed here is aborted
                # on the engine then.
                if failed:
                    self._failed_at_death[change.rank] = (lease.incarnation, failed)
            else:
                self._apply_wave_actions(self.waves.on_group_changed(), now,
                                         cause=f"dp_rank={change.rank} left: {change.cause}",
                                         rank=change.rank)
            if self.config.lockstep:
                self._log(ERROR, "dp_rank=%d is gone (%s): in lockstep mode the group cannot "
                          "finish a wave until it is back", change.rank, change.cause,
                          key=f"gone:{change.rank}")

    def _forget_rank_cache(self, rank: int, cause: str) -> None:
        """The rank's engine is gone or replaced: nothing it cached is there any more."""
        kv = self.kv
        if kv is not None and rank in kv.streams:
            kv.reset_rank(rank, cause)
            kv.streams.reset(rank)

    def _fail_rank_requests(self, rank: int, reason: str) -> list[str]:
        failed: list[str] = []
        for frontend, ids in self.requests.take_rank(rank).items():
            self.counters["requests.failed"] += len(ids)
            self._reply(frontend, fp.RequestsFailed(ids, rank, reason), SendPurpose.NOTICE)
            failed += ids
        # Every frontend hears of it too, after its own failures: requests sent there
        # before a coordinator restart have no entry here, and the SDK fails them itself.
        self._notify_frontends(fp.RankLost(rank, reason))
        return failed

    def _maybe_drained(self, rank: int) -> None:
        if self.membership.state(rank) is not RankState.DRAINING or self.requests.count(rank):
            return
        self._log(INFO, "dp_rank=%d drained: no requests in flight", rank, key=f"drained:{rank}")
        self._notify_frontends(fp.RankDrained(rank))

    def _publish_full(self, now: float) -> None:
        rows = self.loads.take_publish_rows()
        wave, running = self.waves.snapshot()
        self._out.append(Publish("front_publish", (
            vllm.encode_front_publish_rows(rows, wave, running) if self._row_width == 3
            else vllm.encode_front_publish(rows, wave, running, row_width=self._row_width),
        )))
        self.schedule.published(now)
        self._publish_requested = False
        self.counters["publish.full"] += 1

    def _send_init(self, rank: int, identity: bytes) -> None:
        frontends = self.frontends
        # An index nobody holds points at back_output, where a stray output is dropped and
        # counted instead of reaching another frontend (see core.frontends).
        addresses = vllm.EngineZmqAddresses(
            inputs=[self.addresses["dispatch"], *frontends.input_addresses()],
            outputs=frontends.output_addresses(hole=self.addresses["back_output"]),
            coordinator_input=self.addresses["back_publish"],
            coordinator_output=self.addresses["back_output"],
            frontend_stats_publish_address=self.addresses["front_publish"],
        )
        meta = vllm.EngineHandshakeMetadata(addresses=addresses,
                                            parallel_config=self.parallel_config)
        self._send("handshake", identity, (vllm.encode_init(meta),), SendPurpose.INIT,
                   confirm=True)

    def _send_failed_log(self, socket: SocketName, identity: bytes) -> None:
        # Keyed by socket only: peers choose their identities, and a key per identity
        # would give every new one a line of its own.
        self._log(WARNING, "could not send on %s to %s (peer gone or queue full)", socket,
                  identity.hex(), key=f"send:{socket}")

