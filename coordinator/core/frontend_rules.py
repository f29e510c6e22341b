"""The core's rules for frontends: registration, submits, finishes, aborts, admin, state.

Admission and the in-flight ledger are ``core.requests``; registrations, the
address pin and the INIT hold are ``core.frontends``; the rank comes from
``core.route_rules`` (the balancer's policy, or the prefix router) over
``Membership.dispatchable()``. ``_on_submit`` is the dispatch hot path: one
``DispatchAdd`` for a submit to a running group.
"""

from __future__ import annotations

from logging import INFO, WARNING

from coordinator.core.actions import Action, DispatchAdd, Send, SendPurpose, SocketName
from coordinator.core.dispatch.ledger import (
    NO_READY_ENGINE,
    Refusal,
    dispatch_refusal,
    explicit_rank_refusal,
)
from coordinator.core.dispatch.prefix_policy import RoutePrompt
from coordinator.core.events import FrontendRequestReceived
from coordinator.core.frontends.registry import RegisterVerdict
from coordinator.core.ranks.authority import Authority, authority, not_authorized_message
from coordinator.core.ranks.membership import Refused
from coordinator.core.route_rules import RouteRules
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import rank_to_identity


class FrontendRules(RouteRules):
    """Handlers for what frontends send."""

    # ---- frontends -------------------------------------------------------------------------

    def _on_frontend_request(self, event: FrontendRequestReceived, now: float) -> None:
        message = event.message
        if event.channel == "admin":
            self._on_operator_request(event, now)
            return
        self.frontends.touch(event.identity, now)
        if type(message) is fp.Submit:
            self._on_submit(event.identity, message, event.payload, now)
        elif type(message) is fp.Finished:
            for request_id in message.request_ids:
                self._forget(request_id)
        elif type(message) is fp.Heartbeat:
            self._on_heartbeat(event.identity, message, now)
        elif type(message) is fp.Register:
            self._on_register(event.identity, message, now)
        elif type(message) is fp.Route:
            self._on_route(event.identity, message)
        elif type(message) is fp.Abort:
            self._on_abort(event.identity, message)
        elif type(message) is fp.QueryState:
            self._reply(event.identity, fp.StateReply(message.call_id, self.group_state(now)))
        elif type(message) is fp.Admin:
            operator = authority(event.channel, event.user_id, self.config.admin_keys)
            self._on_admin("frontend", event.identity, message, now,
                           operator=operator is Authority.OPERATOR)

    def _on_operator_request(self, event: FrontendRequestReceived, now: float) -> None:
        """The owner-only admin socket: operators' commands and state queries, nothing else."""
        message = event.message
        if type(message) is fp.Admin:
            self._on_admin("admin", event.identity, message, now, operator=True)
        elif type(message) is fp.QueryState:
            self._answer("admin", event.identity,
                         fp.StateReply(message.call_id, self.group_state(now)))
        else:
            self._drop("admin", "wrong_socket", type(message).__name__)
            self._answer("admin", event.identity, fp.ErrorReply(
                fp.call_id_of(message), fp.ERR_BAD_FRAME, "the admin socket takes only "
                "'admin' and 'state' messages; frontends use the frontend socket"))

    def _answer(self, socket: SocketName, identity: bytes, message: fp.FrontendReply) -> None:
        self._out.append(Send(socket, identity, (fp.encode(message),)))

    def _on_heartbeat(self, identity: bytes, msg: fp.Heartbeat, now: float) -> None:
        if msg.progress:
            self._observe_outputs(msg.progress, now)
        if not self.frontends.holds(identity, msg.client_index):
            self.counters["frontend.heartbeat_unregistered"] += 1
            self._reply(identity, fp.ErrorReply(
                msg.call_id, fp.ERR_NOT_REGISTERED, f"client_index {msg.client_index} is not "
                "registered from this connection (its lease expired, or the coordinator "
                "restarted without it): register again"))
            return
        self._reply(identity, fp.Alive(msg.call_id, self.frontends.lease_ttl_s,
                                       self._heartbeat_interval_s()))

    def _heartbeat_interval_s(self) -> float:
        """How often frontends should heartbeat: for their lease, and often enough that
        their evidence of progress reaches the watchdog well within its stall time."""
        interval = self.frontends.heartbeat_interval_s
        if self.config.watchdog_stall_s > 0:
            interval = min(interval, self.config.watchdog_stall_s / 4)
        return interval

    def _observe_outputs(self, ranks: list[int], now: float) -> None:
        """Outputs of ``ranks`` reached a frontend: they are stepping (see core.watchdog)."""
        members = [rank for rank in ranks if self.config.rank_start <= rank < self._rank_end]
        if members:
            self.watchdog.observe_outputs(members, now=now)

    def _expire_frontends(self, now: float) -> None:
        """Registrations nobody renewed: free their slots (see core.frontends)."""
        for peer in self.frontends.expire(now, check_interval_s=self._lease_interval_s):
            forgotten = self.requests.take_frontend(peer.identity)
            self.counters["frontend.expired"] += 1
            self._state_changed()
            self._refresh_due = True
            self._log(WARNING, "frontend client_index=%d: no message or heartbeat for %g s; "
                      "its registration expired (%d requests in flight from it forgotten)",
                      peer.client_index, self.frontends.lease_ttl_s, len(forgotten),
                      key=f"expired:{peer.client_index}")
            for rank in sorted({entry.rank for entry in forgotten}):
                if not self.requests.count(rank):
                    self._maybe_drained(rank)

    def _on_register(self, identity: bytes, msg: fp.Register, now: float) -> None:
        registration = self.frontends.register(
            msg.client_index, identity, msg.output_address, msg.input_address, now=now
        )
        if registration.refusal is not None:
            self._reply(identity, fp.ErrorReply(msg.call_id, fp.ERR_BAD_CLIENT_INDEX,
                                                registration.refusal))
            return
        self._state_changed()
        previous = registration.previous
        if registration.verdict is RegisterVerdict.MOVED and previous is not None:
            moved = self.requests.move_frontend(previous.identity, identity)
            self._log(WARNING, "frontend client_index=%d re-registered from a new connection; "
                      "%d in-flight requests now report to it", msg.client_index, moved,
                      key=f"register:{msg.client_index}")
        else:
            self._log(INFO, "frontend client_index=%d registered (outputs at %s)",
                      msg.client_index, msg.output_address, key=f"register:{msg.client_index}")
        wave, running = self.waves.snapshot()
        self._reply(identity, fp.Registered(
            msg.call_id, msg.client_index, self.config.rank_start, len(self.rank_range), wave,
            running, self.config.lockstep))
        for rank, engine in self.frontends.release_inits():
            self._send_init(rank, engine)

    def _on_submit(self, identity: bytes, msg: fp.Submit, payload: list[bytes],
                   now: float) -> None:
        refusal = self.requests.refusal(msg.request_id, shutting_down=self.shutting_down)
        if refusal is not None:
            self._refuse_submit(identity, msg.call_id, msg.request_id, refusal)
            return
        rank = msg.dp_rank
        prompt = self._read_prompt(msg.prompt, payload) if (
            msg.prompt is not None or self.router is not None) else None
        cost = 0.0
        if rank is not None:
            in_range = self.membership.check_rank(rank) is None
            dispatchable = in_range and rank in self.membership.dispatchable()
            if not dispatchable:
                lease = self.membership.lease(rank) if in_range else None
                self._refuse_submit(identity, msg.call_id, msg.request_id, explicit_rank_refusal(
                    rank, in_range=in_range, state=lease.state.value if lease else "not registered",
                    rank_start=self.config.rank_start, rank_count=len(self.rank_range),
                ))
                return
            if self.router is not None:
                cost = self.router.commit_explicit(rank, prompt)
        else:
            chosen = self._choose(self.membership.dispatchable(), prompt)
            if chosen is None:
                self._refuse_submit(identity, msg.call_id, msg.request_id, NO_READY_ENGINE)
                return
            rank, cost, _reason = chosen
        self._dispatch(identity, msg.call_id, msg.request_id, msg.wave, payload, rank, now,
                       tried=(), explicit=msg.dp_rank is not None, wake=None, cost=cost,
                       prompt=prompt)

    def _dispatch(self, identity: bytes, call_id: int, request_id: str, stamped_wave: int,
                  payload: list[bytes], rank: int, now: float, *, tried: tuple[int, ...],
                  explicit: bool, wake: tuple[Action, ...] | None, cost: float = 0.0,
                  prompt: RoutePrompt | None = None) -> None:
        if wake is None:
            # The wake leaves right after the ADD, so that the chosen engine holds its
            # request before its peers step (woken first, they could finish an idle wave
            # before the ADD arrives). It rides on the DispatchAdd until the ADD is sent.
            mark = len(self._out)
            wave_actions = self.waves.on_first_request(rank, stamped_wave, now=now)
            if wave_actions:
                self._apply_wave_actions(wave_actions, now, cause=f"first request "
                                         f"{request_id!r}", rank=rank, coordinator_wake=True)
                wake = tuple(self._out[mark:])
                del self._out[mark:]
            else:
                wake = ()
        self.loads.note_dispatched(rank)
        self.dispatched_by_rank[rank] += 1
        self.requests.add(request_id, rank, identity)
        self._dispatched += 1
        reply = Send("frontend", identity,
                     (fp.encode(fp.Submitted(call_id, request_id, rank, bool(wake))),))
        self._out.append(DispatchAdd(rank, rank_to_identity(rank), payload, reply, identity,
                                     call_id, request_id, stamped_wave, wake, tried, explicit,
                                     cost, prompt))

    def _dispatch_failed(self, add: DispatchAdd, now: float) -> None:
        """The ADD could not be sent: undo its commit, then the next best rank or a refusal."""
        rank = add.rank
        self.requests.forget(add.request_id)
        self.loads.note_dispatched(rank, -1)
        self._unchoose(rank, add.cost)
        self.dispatched_by_rank[rank] -= 1
        self._dispatched -= 1
        tried = (*add.tried, rank)
        if add.explicit:
            self._send_failed_log("dispatch", add.engine)
            chosen = None
        else:
            # Leases past their TTL are buried by the lease timer; one not yet buried
            # fails its send here and the next best is tried.
            candidates = [r for r in self.membership.dispatchable() if r not in tried]
            choice = self._choose(candidates, add.prompt)
            chosen = None if choice is None else choice[0]
        if chosen is None:
            # The wave machine counts this wake as sent, so it is sent: at worst the group
            # runs one idle wave, where a wake it believes in but never got could leave
            # the next request's peers unwoken.
            self._out.extend(add.wake)
            self._refuse_submit(add.frontend, add.call_id, add.request_id,
                                dispatch_refusal(tried, explicit=add.explicit))
            return
        if choice is None:
            raise RuntimeError('internal invariant broken: choice is not None')
        self._dispatch(add.frontend, add.call_id, add.request_id, add.stamped_wave,
                       add.payload, chosen, now, tried=tried, explicit=False, wake=add.wake,
                       cost=choice[1], prompt=add.prompt)

    def _refuse_submit(self, identity: bytes, call_id: int, request_id: str,
                       refusal: Refusal) -> None:
        self.counters[f"submit.refused.{refusal.code}"] += 1
        self._reply(identity, fp.ErrorReply(call_id, refusal.code, refusal.message, request_id))

    def _forget(self, request_id: str) -> None:
        entry = self.requests.forget(request_id)
        if entry is not None and not self.requests.count(entry.rank):
            self._maybe_drained(entry.rank)

    def _on_abort(self, identity: bytes, msg: fp.Abort) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in msg.request_ids:
            entry = self.requests.get(request_id)
            if entry is not None:
                by_rank.setdefault(entry.rank, []).append(request_id)
                self._forget(request_id)
        for rank, ids in by_rank.items():
            self._send("dispatch", rank_to_identity(rank), (vllm.ABORT, vllm.encode_abort(ids)),
                       SendPurpose.ABORT)
        routed = [request_id for ids in by_rank.values() for request_id in ids]
        self._reply(identity, fp.Aborted(msg.call_id, routed))

    def _on_admin(self, socket: SocketName, identity: bytes, msg: fp.Admin, now: float, *,
                  operator: bool) -> None:
        if not operator:
            self.counters["refused.admin.not_authorized"] += 1
            self._log(WARNING, "refused %s dp_rank=%d from a frontend connection that is not "
                      "an operator (see core.authority)", msg.command, msg.rank,
                      key="admin:not_authorized")
            self._answer(socket, identity, fp.ErrorReply(
                msg.call_id, fp.ERR_NOT_AUTHORIZED, not_authorized_message(msg.command)))
            return
        if self.membership.check_rank(msg.rank) is not None:
            first, last = self.config.rank_start, self.config.rank_start + len(self.rank_range) - 1
            self._answer(socket, identity, fp.ErrorReply(
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
            self._answer(socket, identity, fp.ErrorReply(msg.call_id, fp.ERR_ADMIN_REFUSED,
                                                         result.message))
            return
        self.counters[f"admin.{msg.command}"] += 1
        self._on_rank_changed(result, now)
        self._answer(socket, identity, fp.AdminDone(
            msg.call_id, msg.rank, result.new.value if result.new else "absent"))
        if msg.command == "drain":
            self._maybe_drained(msg.rank)
