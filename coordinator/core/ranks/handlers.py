"""The rank domain's handlers: who holds each rank, and when it is alive or gone.

The rules are the machines beside this module: the lease lifecycle
(``ranks.membership``), who may claim a rank (``ranks.claims``), what a probe
proves (``ranks.liveness``) and who may change membership (``ranks.authority``).
``RankHandlers`` applies them to what engines and operators send: handshakes,
dispatch greetings, connections opening and closing, probe answers, the lease
timer, cordon/uncordon/drain.

What a change of membership means for the other domains (a rank's requests
fail, its cache is forgotten, the group pauses, an INIT goes out or waits for
the frontends) is not decided here: every such fact goes to ``RankFanout``,
which ``CoordinatorCore`` implements by calling the domains concerned.
"""

from __future__ import annotations

from logging import ERROR, INFO, WARNING
from typing import Protocol

from coordinator.core.actions import CloseConnection, SendPurpose, SocketName
from coordinator.core.config import CoreConfig
from coordinator.core.events import (
    EngineGreeted,
    HandshakeReceived,
    PeerConnected,
    PeerDisconnected,
)
from coordinator.core.observe.journal import Journal
from coordinator.core.observe.recorder import KIND_MEMBERSHIP, KIND_REFUSAL
from coordinator.core.outbox import Outbox
from coordinator.core.ranks import liveness
from coordinator.core.ranks.claims import Greeting, SilentConnections
from coordinator.core.ranks.liveness import ProbeAnswer, ProbeEffect
from coordinator.core.ranks.membership import (
    Accepted,
    EngineLease,
    Membership,
    ProbeHolder,
    RankChanged,
    RankState,
    Refused,
)
from coordinator.core.ranks.span import RankSpan
from coordinator.core.ranks.versions import VersionAction, check_version
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.identity import identity_to_rank, rank_to_identity

_PROBES = (SendPurpose.PROBE_LEASE, SendPurpose.PROBE_HOLDER)


class RankFanout(Protocol):
    """What the other domains must hear of a change of membership."""

    def rank_changed(self, change: RankChanged, now: float, out: Outbox) -> None:
        """A rank changed state (it may be gone: then its requests fail)."""

    def rank_replaced(self, rank: int, now: float, out: Outbox) -> None:
        """A new incarnation took ``rank``: nothing of the old one's is valid."""

    def rank_revived(self, rank: int, incarnation: int, out: Outbox) -> None:
        """A dead rank's same incarnation answered again."""

    def new_incarnation(self, rank: int) -> None:
        """A HELLO of a new incarnation was accepted for ``rank``."""

    def engine_said_hello(self, rank: int, identity: bytes, out: Outbox) -> None:
        """``rank``'s HELLO was accepted: its INIT goes out, or waits for frontends."""

    def drain_requested(self, rank: int, out: Outbox) -> None:
        """An operator asked to drain ``rank``: say so once nothing is in flight."""


class RankHandlers:
    """Membership, claims and liveness applied to events; see the module docstring."""

    def __init__(self, config: CoreConfig, journal: Journal, span: RankSpan,
                 fanout: RankFanout, *, now: float) -> None:
        self._config = config
        self._journal = journal
        self._span = span
        self._fanout = fanout
        self.membership = Membership(
            rank_start=config.rank_start, rank_count=config.engines,
            lease_ttl_s=config.lease_ttl_s, handshake_ttl_s=config.handshake_ttl_s,
        )
        self.silent_connections = SilentConnections()
        self.vllm_versions: dict[int, str] = {}
        """The ``vllm_version`` each rank's greeting named (kept while it is in range)."""
        self._versions_differ_logged = False
        self._versions_warned: set[str] = set()
        self._version_refused: dict[int, int] = {}
        """rank -> the incarnation cordoned for its vLLM version (once each: an operator's
        uncordon of that incarnation is not undone)."""
        self._hellos_probing: dict[int, HandshakeReceived] = {}
        self._quiet_after_s = liveness.quiet_after_s(config.lease_ttl_s)
        self._heard_within_s = liveness.heard_within_s(config.lease_ttl_s)
        self.lease_interval_s = liveness.check_interval_s(config.lease_ttl_s)
        self.next_lease_check = now + self.lease_interval_s

    def all_dead(self) -> bool:
        """Every rank of the group has a lease, and each is DEAD: nothing of the group is
        left to step (a rank without a lease, known only from its stats, may be)."""
        membership = self.membership
        return all(membership.state(rank) is RankState.DEAD for rank in self._span.range)

    # ---- the handshake -----------------------------------------------------------------

    def on_handshake(self, event: HandshakeReceived, now: float, out: Outbox) -> None:
        status = event.message.status
        if status == vllm.STATUS_HELLO:
            self._on_hello(event, now, out, holder_reachable=None)
        elif status == vllm.STATUS_READY:
            self._on_ready(event, now, out)
        else:
            self.refuse_handshake(event.identity, "bad_status", f"dp_rank={event.rank} sent "
                                  f"status {status!r}; expected HELLO or READY", now, out)

    def refuse_handshake(self, identity: bytes, reason: str, message: str, now: float,
                         out: Outbox) -> None:
        self._journal.counters[f"refused.handshake.{reason}"] += 1
        try:
            rank: int | None = identity_to_rank(identity)
        except ProtocolError:
            rank = None
        self._journal.record(now, KIND_REFUSAL, reason, rank=rank, identity=identity.hex(),
                             message=message)
        # One line per reason per interval (with a count of the rest): a flood of bad
        # peers, each with its own identity, must not flood the log too.
        out.log(ERROR, "refused engine %r: %s", identity, message, key=f"refuse:{reason}",
                event="refused", refused="engine", reason=reason, rank=rank,
                identity=identity.hex(), detail=message)
        self.handshake_error(identity, message, out)

    def handshake_error(self, identity: bytes, reason: str, out: Outbox) -> None:
        reply = vllm.encode_handshake_reply(vllm.HandshakeError(reason=reason))
        out.send("handshake", identity, (reply,), SendPurpose.HANDSHAKE)

    def _on_hello(self, event: HandshakeReceived, now: float, out: Outbox, *,
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
            self._probe(result.holder, SendPurpose.PROBE_HOLDER, out)
            return
        if isinstance(result, Refused):
            self.refuse_handshake(event.identity, result.reason.value, result.message, now, out)
            return
        if result.released is not None:
            self._fanout.rank_changed(result.released, now, out)
        if not result.duplicate:
            self._fanout.new_incarnation(rank)
            old = result.replaced
            if old is not None and old.dispatch_conn and not old.dispatch_closed:
                # Its connection still holds the rank's identity on dispatch (a host that
                # crashed without closing it): the new engine could never connect there.
                out.add(CloseConnection("dispatch", old.dispatch_conn))
        self._note_accepted("hello", result, now, out)
        self._fanout.engine_said_hello(rank, event.identity, out)

    def _note_accepted(self, step: str, result: Accepted, now: float, out: Outbox) -> None:
        lease = result.lease
        journal = self._journal
        journal.counters[f"handshake.{step}.accepted"] += 1
        journal.record(now, KIND_MEMBERSHIP, f"{step} accepted", rank=lease.rank,
                       engine_id=lease.engine_id, incarnation=lease.incarnation)
        out.refresh()
        out.state_changed()
        if result.replaced is not None:
            journal.counters["handshake.replaced"] += 1
            out.log(WARNING, "dp_rank=%d: engine %s replaces %s (previous registration %s)",
                    lease.rank, lease.engine_id, result.replaced.engine_id,
                    result.replaced.state.value, key=f"replaced:{lease.rank}",
                    event="rank_replaced", rank=lease.rank, engine_id=lease.engine_id,
                    replaced_engine_id=result.replaced.engine_id)
            self._fanout.rank_replaced(lease.rank, now, out)

    def _on_ready(self, event: HandshakeReceived, now: float, out: Outbox) -> None:
        result = self.membership.ready(
            event.rank, parallel_config_hash=event.message.parallel_config_hash, now=now,
            conn=event.conn,
        )
        if isinstance(result, Refused):
            self.refuse_handshake(event.identity, result.reason.value, result.message, now, out)
            return
        self._note_accepted("ready", result, now, out)
        self._enforce_vllm_version(event.rank, now, out)
        if result.lease.protocol_version is not None:
            # Only this project's engine SDK waits for ACCEPTED: a vLLM engine closes its
            # handshake socket right after READY and never reads a reply.
            out.send("handshake", event.identity, (vllm.encode_handshake_accepted(),),
                     SendPurpose.HANDSHAKE)
        out.log(INFO, "dp_rank=%d ready (engine_id=%s)", event.rank, result.lease.engine_id,
                key=f"ready:{event.rank}", event="rank_state", rank=event.rank,
                old="handshaking", new="ready", cause="READY",
                engine_id=result.lease.engine_id)

    # ---- dispatch greetings and connections --------------------------------------------

    def on_greeted(self, event: EngineGreeted, now: float, out: Outbox) -> bool:
        """Apply a dispatch greeting; True if what it says of the engine is to be believed
        (it is not a second connection spoofing a live rank)."""
        rank = event.rank
        counters = self._journal.counters
        self.silent_connections.spoke(event.conn)
        if self.membership.check_rank(rank) is not None:
            self._journal.drop(out, "dispatch", "rank_out_of_range", f"dp_rank={rank}")
            return False
        greeting = self.membership.greeted(rank, now, event.conn)
        if greeting is not Greeting.SECOND_CLAIM and event.vllm_version is not None:
            self._note_vllm_version(rank, event.vllm_version, out)
            self._enforce_vllm_version(rank, now, out)
        if greeting is Greeting.BOUND or greeting is Greeting.REPEATED:
            counters["dispatch.greetings"] += 1
            # Only the greeting that binds a connection is news: a connect is logged once,
            # not once per message.
            if greeting is Greeting.BOUND:
                out.log(INFO, "dp_rank=%d connected on dispatch", rank)
        elif greeting is Greeting.SECOND_CLAIM:
            counters["dispatch.second_claims"] += 1
            self._journal.record(now, KIND_REFUSAL, "second claim on dispatch", rank=rank,
                                 conn=event.conn)
            out.log(WARNING, "dp_rank=%d: a second connection greeted on dispatch for a rank "
                    "whose engine already greeted on another one; it is not that engine "
                    "(an engine greets once per connection), so dp_rank=%d gets no new "
                    "requests until that connection is gone and the rank's own answers a "
                    "probe", rank, rank, key=f"claim:{event.conn}")
            return False
        else:
            # Handshook with someone else (vLLM's launcher) or not at all: it can still take
            # part in waves and stats, but nothing is routed to an unknown incarnation.
            counters["dispatch.unregistered_greeting"] += 1
            out.log(INFO, "dp_rank=%d greeted on dispatch without a handshake here; it is "
                    "not used for dispatch", rank, key=f"greet:{rank}")
        return True

    def _note_vllm_version(self, rank: int, version: str, out: Outbox) -> None:
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
        out.log(WARNING, "the ranks run different vLLM versions: %s; the wire differs "
                "between releases (docs/vllm.md), run one version on every rank",
                "; ".join(f"{v} on dp_rank {', '.join(map(str, rs))}"
                          for v, rs in by_version.items()), key="vllm-versions")

    def _enforce_vllm_version(self, rank: int, now: float, out: Outbox) -> None:
        """Warn once per version outside the supported range; with
        ``require_supported_vllm``, cordon the rank's incarnation once it is READY."""
        version = self.vllm_versions.get(rank)
        if version is None:
            return
        check = check_version(rank, version,
                              require_supported=self._config.require_supported_vllm)
        if check.action is VersionAction.ACCEPT:
            return
        if check.action is VersionAction.WARN:
            # Versions are peer input: the set of those already warned about is capped.
            if version not in self._versions_warned and len(self._versions_warned) < 64:
                self._versions_warned.add(version)
                out.log(WARNING, "%s", check.message, key=f"vllm-version:{version}")
            return
        lease = self.membership.lease(rank)
        if lease is None or lease.state is not RankState.READY:
            return  # refused when it becomes READY (cordoning needs a joined rank)
        if self._version_refused.get(rank) == lease.incarnation:
            return  # an operator uncordoned this very incarnation: that is their call
        self._version_refused[rank] = lease.incarnation
        result = self.membership.cordon(rank, now=now, cause=f"cordoned: {check.message}")
        if isinstance(result, Refused):
            return
        self._journal.counters["refused.dispatch.vllm_version"] += 1
        self._journal.record(now, KIND_REFUSAL, "vllm_version", rank=rank,
                             engine_id=lease.engine_id, message=check.message)
        out.log(ERROR, "%s; it stays in the wave but gets no requests (`dp-coordinator "
                "uncordon %d` overrides)", check.message, rank, key=f"vllm-refused:{rank}")
        self._fanout.rank_changed(result, now, out)

    def on_peer_connected(self, event: PeerConnected, now: float) -> None:
        if event.socket == "dispatch":
            self.silent_connections.opened(event.conn, now, event.peer)

    def on_peer_disconnected(self, event: PeerDisconnected, out: Outbox) -> None:
        self.silent_connections.closed(event.conn)
        rank = self.membership.connection_closed(event.conn)
        if rank is not None and event.socket == "dispatch":
            out.log(INFO, "dp_rank=%d: its dispatch connection closed; no new requests go "
                    "there until a probe reaches it again", rank, key=f"lost:{rank}")

    # ---- probes ------------------------------------------------------------------------

    def _probe(self, lease: EngineLease, purpose: SendPurpose, out: Outbox) -> None:
        """An empty ABORT to the rank on dispatch, naming the connection that holds it."""
        conn = 0 if lease.dispatch_closed else lease.dispatch_conn
        out.send("dispatch", rank_to_identity(lease.rank), liveness.PROBE_FRAMES, purpose,
                 confirm=True, conn=conn)

    @staticmethod
    def is_probe(purpose: SendPurpose) -> bool:
        return purpose in _PROBES

    def probe_answered(self, purpose: SendPurpose, rank: int, sent: bool,
                       heard_ago_s: float | None, now: float, out: Outbox) -> None:
        answer = liveness.answer_of(sent, heard_ago_s,
                                    liveness.silent_after_s(self._config.lease_ttl_s))
        if purpose is SendPurpose.PROBE_HOLDER:
            hello = self._hellos_probing.pop(rank, None)
            if hello is not None:
                effect = liveness.HOLDER_PROBE_OUTCOMES[answer]
                self._on_hello(hello, now, out,
                               holder_reachable=effect is ProbeEffect.REFUSE_HELLO)
        else:
            heard_at = now - (self._heard_within_s if heard_ago_s is None else heard_ago_s)
            self._lease_probed(rank, answer, heard_at, now, out)

    def _lease_probed(self, rank: int, answer: ProbeAnswer, heard_at: float, now: float,
                      out: Outbox) -> None:
        """A lease probe's answer (see ranks.liveness for what it proves)."""
        membership, fanout = self.membership, self._fanout
        lease = membership.lease(rank)
        if lease is None:  # pragma: no cover - a probe goes only to a rank with a lease
            return
        effect = liveness.PROBE_OUTCOMES[
            liveness.condition(lease, now, self._quiet_after_s), answer]
        if effect is ProbeEffect.RENEW or effect is ProbeEffect.STALE:
            membership.renew(rank, heard_at)  # only to when it was last heard
            if effect is ProbeEffect.STALE:
                membership.mark_unreachable(rank)
            # The probe spared it from this check's expiry: what it found decides.
            for change in membership.expire(now, only=(rank,)):
                fanout.rank_changed(change, now, out)
        elif effect is ProbeEffect.UNREACHABLE:
            membership.mark_unreachable(rank)
        elif effect is ProbeEffect.DISCONNECT:
            for change in membership.disconnected(rank, now):
                fanout.rank_changed(change, now, out)
        elif effect is ProbeEffect.REVIVE:
            revived = membership.revive(
                rank, heard_at, "reachable again on dispatch, same incarnation: evidence of "
                "life revises the death")
            if isinstance(revived, Refused):
                self._journal.counters["lease.revival_refused"] += 1
                out.log(WARNING, "%s", revived.message, key=f"revival-refused:{rank}",
                        event="refused", refused="revival", reason=revived.reason.value,
                        rank=rank)
            elif revived is not None:
                self._journal.counters["lease.revived"] += 1
                fanout.rank_changed(revived, now, out)
                fanout.rank_revived(rank, lease.incarnation, out)

    # ---- timers ------------------------------------------------------------------------

    def credit_pause(self, pause: float, now: float, out: Outbox) -> None:
        """The coordinator did not run for ``pause`` s: that is no engine's silence."""
        self.membership.credit_pause(pause, now)
        self._journal.counters["coordinator.pauses"] += 1
        self._journal.record(now, KIND_MEMBERSHIP, "coordinator paused",
                             seconds=round(pause, 3))
        out.log(WARNING, "the coordinator did not run for %.1f s (stopped, frozen or "
                "starved); every lease was credited that time, and leases are judged again "
                "once what the engines sent meanwhile has been read", pause,
                event="coordinator_paused", seconds=round(pause, 3))
        # Judge after the queued traffic is read: the readers run before the next tick.
        self.next_lease_check = now + self.lease_interval_s

    def check_leases(self, now: float, out: Outbox) -> None:
        """Probe quiet, unreachable and revivable engines, then expire the leases nobody
        renewed (see ranks.liveness); and count dispatch connections that never greeted."""
        counters = self._journal.counters
        leases = self.membership.leases()
        probed = liveness.ranks_to_probe(leases, now, self._quiet_after_s)
        by_rank = {lease.rank: lease for lease in leases}
        for rank in probed:
            counters["lease.probes"] += 1
            self._probe(by_rank[rank], SendPurpose.PROBE_LEASE, out)
        for change in self.membership.expire(now, spare=probed):
            self._fanout.rank_changed(change, now, out)
        for _conn, peer in self.silent_connections.overdue(now):
            counters["dispatch.silent_connections"] += 1
            out.log(WARNING, "a connection on dispatch%s has not greeted within %g s: an "
                    "engine reconnecting after its connection dropped, or a second "
                    "connection claiming a rank whose engine is connected (it gets nothing), "
                    "or not an engine", f" from {peer}" if peer else "",
                    self.silent_connections.grace_s, key="silent-dispatch")

    # ---- operators ---------------------------------------------------------------------

    def on_admin(self, socket: SocketName, identity: bytes, msg: fp.Admin, now: float,
                 out: Outbox) -> None:
        """cordon, uncordon or drain, from someone already known to be an operator."""
        if self.membership.check_rank(msg.rank) is not None:
            first, last = self._span.start, self._span.end - 1
            out.answer(socket, identity, fp.ErrorReply(
                msg.call_id, fp.ERR_ADMIN_REFUSED, f"dp_rank={msg.rank} is not one of this "
                f"coordinator's ranks ({first}..{last}); `dp-coordinator status` lists them"))
            return
        if msg.command == "cordon":
            result = self.membership.cordon(msg.rank)
        elif msg.command == "uncordon":
            result = self.membership.uncordon(msg.rank)
        else:
            result = self.membership.drain(msg.rank)
        if isinstance(result, Refused):
            out.answer(socket, identity, fp.ErrorReply(msg.call_id, fp.ERR_ADMIN_REFUSED,
                                                       result.message))
            return
        self._journal.counters[f"admin.{msg.command}"] += 1
        self._fanout.rank_changed(result, now, out)
        out.answer(socket, identity, fp.AdminDone(
            msg.call_id, msg.rank, result.new.value if result.new else "absent"))
        if msg.command == "drain":
            self._fanout.drain_requested(msg.rank, out)
