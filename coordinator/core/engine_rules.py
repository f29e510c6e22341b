"""The core's rules for engines: handshakes, greetings, reports, the gate, liveness.

Each handler takes one event (see ``coordinator.core.events``) and appends
what follows to the outbox; the machines it consults say why in their own
docstrings (``membership``, ``liveness``, ``gate``, ``waves``, ``balancer``,
``watchdog``). ``on_engine_report`` is the stats hot path: no allocation
unless something changed.
"""

from __future__ import annotations

from logging import ERROR, INFO, WARNING

from coordinator.core import liveness
from coordinator.core.actions import REARM_TIMER, REFRESH_OBSERVED_NOW, Publish, SendPurpose
from coordinator.core.events import (
    EngineGreeted,
    EngineSubscribed,
    EngineUnsubscribed,
    FrontendSubscribed,
    HandshakeReceived,
)
from coordinator.core.frontends import InitStep
from coordinator.core.gate import GateStep
from coordinator.core.kv_rules import KVRules
from coordinator.core.membership import Accepted, ProbeHolder, Refused
from coordinator.core.recorder import KIND_MEMBERSHIP, KIND_REFUSAL, KIND_WATCHDOG
from coordinator.core.watchdog import NO_PROGRESS
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import identity_to_rank, rank_to_identity


class EngineRules(KVRules):
    """Handlers for what engines send, and the lease and watchdog timers."""

    # ---- engines: handshake ----------------------------------------------------------------

    def _on_handshake(self, event: HandshakeReceived, now: float) -> None:
        status = event.message.status
        if status == vllm.STATUS_HELLO:
            self._on_hello(event, now, holder_reachable=None)
        elif status == vllm.STATUS_READY:
            self._on_ready(event, now)
        else:
            self._refuse_handshake(event.identity, "bad_status", f"dp_rank={event.rank} sent "
                                   f"status {status!r}; expected HELLO or READY", now)

    def _refuse_handshake(self, identity: bytes, reason: str, message: str, now: float) -> None:
        self.counters[f"refused.handshake.{reason}"] += 1
        try:
            rank: int | None = identity_to_rank(identity)
        except ProtocolError:
            rank = None
        self._record(now, KIND_REFUSAL, reason, rank=rank, identity=identity.hex(),
                     message=message)
        # One line per reason per interval (with a count of the rest): a flood of bad
        # peers, each with its own identity, must not flood the log too.
        self._log(ERROR, "refused engine %r: %s", identity, message, key=f"refuse:{reason}")
        self._handshake_error(identity, message)

    def _handshake_error(self, identity: bytes, reason: str) -> None:
        reply = vllm.encode_handshake_reply(vllm.HandshakeError(reason=reason))
        self._send("handshake", identity, (reply,), SendPurpose.HANDSHAKE)

    def _on_hello(self, event: HandshakeReceived, now: float, *,
                  holder_reachable: bool | None) -> None:
        message, rank = event.message, event.rank
        result = self.membership.hello(
            rank, engine_id=message.engine_id, local=message.local, headless=message.headless,
            now=now, holder_reachable=holder_reachable,
        )
        if isinstance(result, ProbeHolder):
            # Decided once the holder's probe answers (SendSucceeded / SendFailed).
            self._hellos_probing[rank] = event
            self._send("dispatch", rank_to_identity(rank), liveness.PROBE_FRAMES,
                       SendPurpose.PROBE_HOLDER, confirm=True)
            return
        if isinstance(result, Refused):
            self._refuse_handshake(event.identity, result.reason.value, result.message, now)
            return
        if result.released is not None:
            self._on_rank_changed(result.released, now)
        self._note_accepted("hello", result, now)
        if self.frontends.init_step() is InitStep.HOLD:
            self._log(INFO, "dp_rank=%d said HELLO; INIT waits until %d frontends registered "
                      "(%d so far)", rank, self.frontends.expected, len(self.frontends))
            self.frontends.hold_init(rank, event.identity)
            return
        self._send_init(rank, event.identity)

    def _note_accepted(self, step: str, result: Accepted, now: float) -> None:
        lease = result.lease
        self.counters[f"handshake.{step}.accepted"] += 1
        self._record(now, KIND_MEMBERSHIP, f"{step} accepted", rank=lease.rank,
                     engine_id=lease.engine_id, incarnation=lease.incarnation)
        self._refresh_due = True
        self._state_changed()
        if result.replaced is not None:
            self.counters["handshake.replaced"] += 1
            self._log(WARNING, "dp_rank=%d: engine %s replaces %s (previous registration %s)",
                      lease.rank, lease.engine_id, result.replaced.engine_id,
                      result.replaced.state.value)
            self._forget_rank_cache(lease.rank, "rank_replaced")
            self._fail_rank_requests(lease.rank, "the engine was replaced by a new incarnation")
            self._apply_wave_actions(self.waves.on_group_changed(), now,
                                     cause=f"dp_rank={lease.rank} has a new incarnation",
                                     rank=lease.rank)

    def _on_ready(self, event: HandshakeReceived, now: float) -> None:
        result = self.membership.ready(
            event.rank, parallel_config_hash=event.message.parallel_config_hash, now=now
        )
        if isinstance(result, Refused):
            self._refuse_handshake(event.identity, result.reason.value, result.message, now)
            return
        self._note_accepted("ready", result, now)
        self._send("handshake", event.identity, (vllm.encode_handshake_accepted(),),
                   SendPurpose.HANDSHAKE)
        self._log(INFO, "dp_rank=%d ready (engine_id=%s)", event.rank, result.lease.engine_id)

    # ---- engines: dispatch greetings, reports, the gate ------------------------------------

    def _on_greeted(self, event: EngineGreeted, now: float) -> None:
        rank = event.rank
        if self.membership.check_rank(rank) is not None:
            self._drop("dispatch", "rank_out_of_range", f"dp_rank={rank}")
            return
        self._kv_greeted(event, now)
        if self.membership.greeted(rank, now):
            self.counters["dispatch.greetings"] += 1
            self._log(INFO, "dp_rank=%d connected on dispatch", rank)
        else:
            # Handshook with someone else (vLLM's launcher) or not at all: it can still take
            # part in waves and stats, but nothing is routed to an unknown incarnation.
            self.counters["dispatch.unregistered_greeting"] += 1
            self._log(INFO, "dp_rank=%d greeted on dispatch without a handshake here; it is "
                      "not used for dispatch", rank, key=f"greet:{rank}")

    def _on_engine_report(self, msg: vllm.EngineReport, now: float) -> None:
        rank = msg.engine_index
        if not self.config.rank_start <= rank < self._rank_end:
            self._drop("back_output", "rank_out_of_range", f"engine_index={rank}")
            return
        self.membership.touch(rank, now)
        if msg.wave_complete is not None or msg.start_wave is not None:
            if msg.wave_complete is not None:
                cause = f"wave_complete({msg.wave_complete}) from rank {rank}"
            else:
                cause = f"start_wave({msg.start_wave}) from rank {rank}"
            self._apply_wave_actions(
                self.waves.on_engine_output(rank, msg.wave_complete, msg.start_wave, now=now),
                now, cause=cause, rank=rank,
            )
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
        if self.router is not None:
            self.router.on_report(rank)
        if outcome.stale:
            self.counters["stats.stale"] += 1
            self._log(INFO, "dp_rank=%d reported (wave %d, step %d), behind its previous "
                      "report; counters restarted?", rank, stats.current_wave,
                      stats.step_counter, key=f"stale:{rank}")
        self._stats_reports += 1
        self.watchdog.observe_stats(rank, wave=stats.current_wave, step=stats.step_counter,
                                    now=now)
        if not was_changed and loads.changed:
            self._out.append(REARM_TIMER)  # a publish is now due sooner
        reported = self.waves.on_reported_wave(rank, stats.current_wave)
        if reported:
            self._apply_wave_actions(
                reported, now, cause=f"stats from rank {rank} report wave {stats.current_wave}",
                rank=rank,
            )

    def _on_engine_subscribed(self, event: EngineSubscribed, now: float) -> None:
        step = self.gate.subscribed()
        if step is GateStep.LATE_READY:
            # A late or returning engine is blocked until it sees READY.
            self._out.append(Publish("back_publish", (vllm.READY,)))
            self._log(INFO, "engine subscription on back_publish after start-up; sent READY")
        elif step is GateStep.OPEN:
            self._state_changed()
            self._out.append(Publish("back_publish", (vllm.READY,)))
            held = self.gate.take_held()
            if held is not None:
                self._out.append(Publish("back_publish", held))
            self.schedule.start(now)
            self._out.append(REARM_TIMER)
            self._log(INFO, "all %d engines subscribed; READY sent", self.gate.expected)
        else:
            self._log(INFO, "engine subscribed on back_publish (%d of %d)",
                      self.gate.subscriptions, self.gate.expected)

    def _on_engine_unsubscribed(self, event: EngineUnsubscribed, now: float) -> None:
        self._log(INFO, "the last engine subscriber left back_publish")

    # ---- front_publish upstream ------------------------------------------------------------

    def _on_frontend_subscribed(self, event: FrontendSubscribed, now: float) -> None:
        # A new subscriber missed every earlier publish: send it a full one soon instead
        # of leaving it blind until the next heartbeat (vLLM: up to 5 s).
        self.counters["front.subscriptions"] += 1
        self._publish_requested = True
        self._out.append(REARM_TIMER)

    def _on_resize(self, event: vllm.ScaleElasticEP, now: float) -> None:
        rank_start = self.config.rank_start
        count = event.new_count - rank_start
        if count < 1:
            self._drop("front_publish", "bad_value", f"SCALE_ELASTIC_EP {event.new_count} "
                       f"leaves no ranks above rank_start={rank_start}")
            return
        self._log(INFO, "SCALE_ELASTIC_EP: %d -> %d engines", len(self.rank_range), count)
        before = self.rank_range
        for change in self.membership.resize(count):
            self._on_rank_changed(change, now)
        self._rank_end = rank_start + count
        self.loads.resize(rank_start + count)
        self._kv_resized(before)
        self.gate.expected = count
        self._out.append(REARM_TIMER)

    def _on_legacy_first_request(self, event: vllm.LegacyFirstRequest, now: float) -> None:
        """A pre-0.33 frontend sent a request to a paused group: wake the others.

        Same rule as a submit through the coordinator (one wake per wave; a stale stamp
        wakes everyone), but running still flips only on an engine's report.
        """
        if not self.config.legacy_frontends:
            self._drop("front_publish", "legacy_first_request",
                       f"[{event.engine_index}, {event.wave}] (pre-0.33 frontend wake; "
                       "start with --vllm-compat legacy to honour it)")
            return
        if self.membership.check_rank(event.engine_index) is not None:
            self._drop("front_publish", "rank_out_of_range",
                       f"legacy wake names engine {event.engine_index}")
            return
        self.counters["legacy.first_requests"] += 1
        self._apply_wave_actions(
            self.waves.on_first_request(event.engine_index, event.wave, now=now), now,
            cause="legacy first request", rank=event.engine_index, coordinator_wake=True,
        )

    def _holder_probed(self, rank: int, reachable: bool, now: float) -> None:
        hello = self._hellos_probing.pop(rank, None)
        if hello is not None:
            self._on_hello(hello, now, holder_reachable=reachable)

    # ---- timers ----------------------------------------------------------------------------

    def _check_leases(self, now: float) -> None:
        """Probe quiet engines, then expire the leases nobody renewed (see core.liveness)."""
        probed = liveness.ranks_to_probe(self.membership.leases(), now, self._quiet_after_s)
        for rank in probed:
            self.counters["lease.probes"] += 1
            self._send("dispatch", rank_to_identity(rank), liveness.PROBE_FRAMES,
                       SendPurpose.PROBE_LEASE, confirm=True)
        for change in self.membership.expire(now, spare=probed):
            self._on_rank_changed(change, now)

    def _observe(self, now: float) -> None:
        self._apply_wave_actions(self.waves.on_timer(now), now, cause="unanswered wake retried",
                                 rank=None)
        wave, running = self.waves.snapshot()
        self.watchdog.observe_group(running=running and self.config.lockstep, wave=wave,
                                    ranks=self.rank_range, now=now)
        if self.config.watchdog_stall_s > 0:
            for alert in self.watchdog.check(now):
                self.counters[f"watchdog.{alert.kind}"] += 1
                self._record(now, KIND_WATCHDOG, alert.kind, ranks=list(alert.ranks),
                             message=alert.message)
                self._log(ERROR, "WATCHDOG: %s", alert.message)
                for line in self.recorder.format_lines(50, now=now):
                    self._log(WARNING, "%s", line)
                if self.config.watchdog_rewake and alert.kind == NO_PROGRESS:
                    self._wake(vllm.encode_start_dp_wave(wave, None))
                    self.counters["watchdog.rewakes"] += 1
                    self._log(WARNING, "watchdog: re-broadcast START_DP_WAVE [%d, nil]", wave)
        self._out.append(REFRESH_OBSERVED_NOW)

