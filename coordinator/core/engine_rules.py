"""The core's rules for engines: handshakes, greetings, reports, the gate, liveness.

Each handler takes one event (see ``coordinator.core.events``) and appends
what follows to the outbox; the machines it consults say why in their own
docstrings (``membership``, ``liveness``, ``gate``, ``waves``, ``balancer``,
``watchdog``). ``on_engine_report`` is the stats hot path: no allocation
unless something changed.
"""

from __future__ import annotations

from logging import ERROR, INFO, WARNING

from coordinator.core.actions import (
    REARM_TIMER,
    REFRESH_OBSERVED_NOW,
    CloseConnection,
    Publish,
    SendPurpose,
)
from coordinator.core.events import (
    EngineGreeted,
    EngineSubscribed,
    EngineUnsubscribed,
    FrontendSubscribed,
    HandshakeReceived,
    PeerConnected,
    PeerDisconnected,
)
from coordinator.core.frontends.registry import InitStep
from coordinator.core.kv_rules import KVRules
from coordinator.core.observe.recorder import KIND_MEMBERSHIP, KIND_REFUSAL, KIND_WATCHDOG
from coordinator.core.ranks import liveness
from coordinator.core.ranks.authority import resize_refusal
from coordinator.core.ranks.claims import Greeting
from coordinator.core.ranks.liveness import ProbeAnswer, ProbeEffect
from coordinator.core.ranks.membership import (
    Accepted,
    EngineLease,
    ProbeHolder,
    RankChanged,
    Refused,
)
from coordinator.core.waves.gate import GateStep
from coordinator.core.waves.watchdog import NO_PROGRESS
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
            now=now, holder_reachable=holder_reachable, conn=event.conn,
            protocol_version=message.protocol_version,
        )
        if isinstance(result, ProbeHolder):
            # Decided once the holder's probe answers (SendSucceeded / SendFailed).
            self._hellos_probing[rank] = event
            self._probe(result.holder, SendPurpose.PROBE_HOLDER)
            return
        if isinstance(result, Refused):
            self._refuse_handshake(event.identity, result.reason.value, result.message, now)
            return
        if result.released is not None:
            self._on_rank_changed(result.released, now)
        if not result.duplicate:
            self._failed_at_death.pop(rank, None)  # a new incarnation never had them
            old = result.replaced
            if old is not None and old.dispatch_conn and not old.dispatch_closed:
                # Its connection still holds the rank's identity on dispatch (a host that
                # crashed without closing it): the new engine could never connect there.
                self._out.append(CloseConnection("dispatch", old.dispatch_conn))
        self._note_accepted("hello", result, now)
        if self.frontends.init_step() is InitStep.HOLD:
            self._log(INFO, "dp_rank=%d said HELLO; INIT waits until %d frontends registered "
                      "(%d so far)", rank, self.frontends.expected, len(self.frontends),
                      key=f"hold:{rank}")
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
                      result.replaced.state.value, key=f"replaced:{lease.rank}")
            self._forget_rank_cache(lease.rank, "rank_replaced")
            self._fail_rank_requests(lease.rank, "the engine was replaced by a new incarnation")
            self._apply_wave_actions(self.waves.on_group_changed(), now,
                                     cause=f"dp_rank={lease.rank} has a new incarnation",
                                     rank=lease.rank)

    def _on_ready(self, event: HandshakeReceived, now: float) -> None:
        result = self.membership.ready(
            event.rank, parallel_config_hash=event.message.parallel_config_hash, now=now,
            conn=event.conn,
        )
        if isinstance(result, Refused):
            self._refuse_handshake(event.identity, result.reason.value, result.message, now)
            return
        self._note_accepted("ready", result, now)
        if result.lease.protocol_version is not None:
            # Only this project's engine SDK waits for ACCEPTED: a vLLM engine closes its
            # handshake socket right after READY and never reads a reply.
            self._send("handshake", event.identity, (vllm.encode_handshake_accepted(),),
                       SendPurpose.HANDSHAKE)
        self._log(INFO, "dp_rank=%d ready (engine_id=%s)", event.rank, result.lease.engine_id,
                  key=f"ready:{event.rank}")

    # ---- engines: dispatch greetings, reports, the gate ------------------------------------

    def _on_greeted(self, event: EngineGreeted, now: float) -> None:
        rank = event.rank
        self.silent_connections.spoke(event.conn)
        if self.membership.check_rank(rank) is not None:
            self._drop("dispatch", "rank_out_of_range", f"dp_rank={rank}")
            return
        greeting = self.membership.greeted(rank, now, event.conn)
        if greeting is not Greeting.SECOND_CLAIM:
            # Not from a connection that spoofs a live rank: what it says of the engine's
            # KV event publisher is followed (vLLM's own launcher may have done the
            # handshake, so an unregistered greeting counts too).
            self._kv_greeted(event, now)
            if event.vllm_version is not None:
                self._note_vllm_version(rank, event.vllm_version)
        if greeting is Greeting.BOUND or greeting is Greeting.REPEATED:
            self.counters["dispatch.greetings"] += 1
            # Only the greeting that binds a connection is news: a connect is logged once,
            # not once per message.
            if greeting is Greeting.BOUND:
                self._log(INFO, "dp_rank=%d connected on dispatch", rank)
        elif greeting is Greeting.SECOND_CLAIM:
            self.counters["dispatch.second_claims"] += 1
            self._record(now, KIND_REFUSAL, "second claim on dispatch", rank=rank,
                         conn=event.conn)
            self._log(WARNING, "dp_rank=%d: a second connection greeted on dispatch for a rank "
                      "whose engine already greeted on another one; it is not that engine "
                      "(an engine greets once per connection), so dp_rank=%d gets no new "
                      "requests until that connection is gone and the rank's own answers a "
                      "probe", rank, rank, key=f"claim:{event.conn}")
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

    def _note_vllm_version(self, rank: int, version: str) -> None:
        """Keep the version a rank's greeting named; say once if the ranks disagree."""
        versions = self.vllm_versions
        if versions.get(rank) == version:
            return
        versions[rank] = version
        if self._versions_differ_logged or len(set(versions.values())) < 2:
            return
        self._versions_differ_logged = True
        by_version: dict[str, list[int]] = {}
        for r, v in sorted(versions.items()):
            by_version.setdefault(v, []).append(r)
        self._log(WARNING, "the ranks run different vLLM versions: %s; the wire differs "
                  "between releases (docs/vllm.md), run one version on every rank",
                  "; ".join(f"{v} on dp_rank {', '.join(map(str, rs))}"
                            for v, rs in by_version.items()), key="vllm-versions")

    def _on_engine_subscribed(self, event: EngineSubscribed, now: float) -> None:
        step = self.gate.subscribed()
        if step is GateStep.LATE_READY:
            # A late or returning engine is blocked until it sees READY.
            self._out.append(Publish("back_publish", (vllm.READY,)))
            self._log(INFO, "engine subscription on back_publish after start-up; sent READY",
                      key="late-subscription")
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
                      self.gate.subscriptions, self.gate.expected, key="subscription")

    def _on_engine_unsubscribed(self, event: EngineUnsubscribed, now: float) -> None:
        self._log(INFO, "the last engine subscriber left back_publish", key="unsubscription")

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
        config = self.config
        refusal = resize_refusal(count, current=len(self.rank_range),
                                 min_engines=config.min_engines or config.engines,
                                 max_engines=config.max_engines or config.engines)
        if refusal is not None:
            self.counters["refused.front_publish.scale_out_of_range"] += 1
            self._log(WARNING, "%s", refusal, key="resize-refused")
            return
        self._log(INFO, "SCALE_ELASTIC_EP: %d -> %d engines", len(self.rank_range), count,
                  key="resize")
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

        Honoured by default, whatever the row width: a 0.29-0.32 engine given a request
        stamped with its own wave sends no ``start_wave``, so this message is the only
        thing that brings its lockstep peers in (``WaveState.on_frontend_wake``).
        ``frontend_wake=False`` drops it, as vLLM 0.33's coordinator does.
        """
        if not self.config.frontend_wake:
            self._drop("front_publish", "legacy_first_request",
                       f"[{event.engine_index}, {event.wave}] (pre-0.33 frontend wake, "
                       "ignored by --frontend-wake ignore; a vLLM 0.29-0.32 MoE group "
                       "hangs without it: drop that flag)")
            return
        if self.membership.check_rank(event.engine_index) is not None:
            self._drop("front_publish", "rank_out_of_range",
                       f"legacy wake names engine {event.engine_index}")
            return
        self.counters["legacy.first_requests"] += 1
        if event.by_identity not in self._frontend_wake_forms:
            self._frontend_wake_forms.add(event.by_identity)
            who = ("a vLLM 0.29-0.32 frontend (engine named by its identity bytes)"
                   if event.by_identity else "a frontend older than vLLM 0.29 (engine index)")
            self._log(INFO, "honouring the pre-0.33 first-request wake from %s, first "
                      "[%d, %d]%s", who, event.engine_index, event.wave,
                      "" if self.config.lockstep else "; dense group: nothing to wake",
                      key=f"frontend-wake:{event.by_identity}")
        self._apply_wave_actions(
            self.waves.on_frontend_wake(event.engine_index, event.wave, now=now), now,
            cause="legacy first request", rank=event.engine_index, coordinator_wake=True,
        )

    def _probe(self, lease: EngineLease, purpose: SendPurpose) -> None:
        """An empty ABORT to the rank on dispatch, naming the connection that holds it."""
        conn = 0 if lease.dispatch_closed else lease.dispatch_conn
        self._send("dispatch", rank_to_identity(lease.rank), liveness.PROBE_FRAMES, purpose,
                   confirm=True, conn=conn)

    def _probe_answered(self, purpose: SendPurpose, rank: int, sent: bool,
                        heard_ago_s: float | None, now: float) -> None:
        answer = liveness.answer_of(sent, heard_ago_s,
                                    liveness.silent_after_s(self.config.lease_ttl_s))
        if purpose is SendPurpose.PROBE_HOLDER:
            hello = self._hellos_probing.pop(rank, None)
            if hello is not None:
                effect = liveness.HOLDER_PROBE_OUTCOMES[answer]
                self._on_hello(hello, now,
                               holder_reachable=effect is ProbeEffect.REFUSE_HELLO)
        else:
            heard_at = now - (self._heard_within_s if heard_ago_s is None else heard_ago_s)
            self._lease_probed(rank, answer, heard_at, now)

    def _lease_probed(self, rank: int, answer: ProbeAnswer, heard_at: float,
                      now: float) -> None:
        """A lease probe's answer (see core.liveness for what it proves)."""
        lease = self.membership.lease(rank)
        if lease is None:  # pragma: no cover - a probe goes only to a rank with a lease
            return
        effect = liveness.PROBE_OUTCOMES[
            liveness.condition(lease, now, self._quiet_after_s), answer]
        if effect is ProbeEffect.RENEW or effect is ProbeEffect.STALE:
            self.membership.renew(rank, heard_at)  # only to when it was last heard
            if effect is ProbeEffect.STALE:
                self.membership.mark_unreachable(rank)
            # The probe spared it from this check's expiry: what it found decides.
            for change in self.membership.expire(now, only=(rank,)):
                self._on_rank_changed(change, now)
        elif effect is ProbeEffect.UNREACHABLE:
            self.membership.mark_unreachable(rank)
        elif effect is ProbeEffect.DISCONNECT:
            for change in self.membership.disconnected(rank, now):
                self._on_rank_changed(change, now)
        elif effect is ProbeEffect.REVIVE:
            revived = self.membership.revive(
                rank, heard_at, "reachable again on dispatch, same incarnation: evidence of "
                "life revises the death")
            if isinstance(revived, Refused):
                self.counters["lease.revival_refused"] += 1
                self._log(WARNING, "%s", revived.message, key=f"revival-refused:{rank}")
            elif revived is not None:
                self._revived(rank, lease.incarnation, revived, now)

    def _revived(self, rank: int, incarnation: int, change: RankChanged, now: float) -> None:
        self.counters["lease.revived"] += 1
        self._on_rank_changed(change, now)
        failed = self._failed_at_death.pop(rank, None)
        if failed is not None and failed[0] == incarnation:
            # Their frontends were told they failed: the engine must not finish them now.
            self.counters["requests.aborted_on_revival"] += len(failed[1])
            self._send("dispatch", rank_to_identity(rank),
                       (vllm.ABORT, vllm.encode_abort(failed[1])), SendPurpose.ABORT)

    def _on_peer_connected(self, event: PeerConnected, now: float) -> None:
        if event.socket == "dispatch":
            self.silent_connections.opened(event.conn, now, event.peer)

    def _on_peer_disconnected(self, event: PeerDisconnected, now: float) -> None:
        self.silent_connections.closed(event.conn)
        rank = self.membership.connection_closed(event.conn)
        if rank is not None and event.socket == "dispatch":
            self._log(INFO, "dp_rank=%d: its dispatch connection closed; no new requests go "
                      "there until a probe reaches it again", rank, key=f"lost:{rank}")

    def _credit_pause(self, pause: float, now: float) -> None:
        """The coordinator did not run for ``pause`` s: that is no engine's silence."""
        self.membership.credit_pause(pause, now)
        self.counters["coordinator.pauses"] += 1
        self._record(now, KIND_MEMBERSHIP, "coordinator paused", seconds=round(pause, 3))
        self._log(WARNING, "the coordinator did not run for %.1f s (stopped, frozen or "
                  "starved); every lease was credited that time, and leases are judged again "
                  "once what the engines sent meanwhile has been read", pause)
        # Judge after the queued traffic is read: the readers run before the next tick.
        self._next_lease_check = now + self._lease_interval_s

    # ---- timers ----------------------------------------------------------------------------

    def _check_leases(self, now: float) -> None:
        """Probe quiet, unreachable and revivable engines, then expire the leases nobody
        renewed (see core.liveness); and count dispatch connections that never greeted."""
        leases = self.membership.leases()
        probed = liveness.ranks_to_probe(leases, now, self._quiet_after_s)
        by_rank = {lease.rank: lease for lease in leases}
        for rank in probed:
            self.counters["lease.probes"] += 1
            self._probe(by_rank[rank], SendPurpose.PROBE_LEASE)
        for change in self.membership.expire(now, spare=probed):
            self._on_rank_changed(change, now)
        for _conn, peer in self.silent_connections.overdue(now):
            self.counters["dispatch.silent_connections"] += 1
            self._log(WARNING, "a connection on dispatch%s has not greeted within %g s: an "
                      "engine reconnecting after its connection dropped, or a second "
                      "connection claiming a rank whose engine is connected (it gets nothing), "
                      "or not an engine", f" from {peer}" if peer else "",
                      self.silent_connections.grace_s, key="silent-dispatch")

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

