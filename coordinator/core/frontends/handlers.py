"""The frontend domain's handlers: registrations, heartbeats, leases, and the INITs.

The rules are ``frontends.registry``'s: index bounds, leases, the pin of the
output addresses that INITs carried, and the INIT hold (with ``--frontends N``
no engine gets its INIT before N frontends registered, since an INIT fixes the
output addresses an engine pushes to). ``FrontendHandlers`` applies them: a
registration is answered and may release the held INITs; a heartbeat renews
the lease and carries the frontend's evidence of progress to the watchdog;
registrations nobody renewed expire, and their requests are forgotten.
"""

from __future__ import annotations

from logging import INFO, WARNING

from coordinator.core.actions import SendPurpose
from coordinator.core.config import CoreConfig
from coordinator.core.dispatch.ledger import RequestLedger
from coordinator.core.frontends.registry import (
    FrontendRegistry,
    InitStep,
    RegisterVerdict,
    inits_went_to,
)
from coordinator.core.observe.journal import Journal
from coordinator.core.outbox import Outbox
from coordinator.core.ranks.span import RankSpan
from coordinator.core.waves.handlers import WaveHandlers
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm


class FrontendHandlers:
    """The frontend registry applied to events; see the module docstring."""

    def __init__(self, config: CoreConfig, journal: Journal, span: RankSpan,
                 requests: RequestLedger, waves: WaveHandlers) -> None:
        self._config = config
        self._journal = journal
        self._span = span
        self._requests = requests
        self._waves = waves
        self.registry = FrontendRegistry(
            expected=config.frontends, max_frontends=config.max_frontends,
            lease_ttl_s=config.frontend_lease_ttl_s,
        )
        self.addresses: dict[str, str] = {}
        """Every socket's address (from ``Bound``): what INITs carry."""
        self.parallel_config: dict[str, int | str | list[int]] = {}

    # ---- INITs -------------------------------------------------------------------------

    def engine_said_hello(self, rank: int, identity: bytes, out: Outbox) -> None:
        registry = self.registry
        if registry.init_step() is InitStep.HOLD:
            out.log(INFO, "dp_rank=%d said HELLO; INIT waits until %d frontends registered "
                    "(%d so far)", rank, registry.expected, len(registry), key=f"hold:{rank}")
            registry.hold_init(rank, identity)
            return
        self._send_init(identity, out)

    def _send_init(self, identity: bytes, out: Outbox) -> None:
        registry, addresses = self.registry, self.addresses
        # An index nobody holds points at back_output, where a stray output is dropped and
        # counted instead of reaching another frontend (see frontends.registry).
        engine_addresses = vllm.EngineZmqAddresses(
            inputs=[addresses["dispatch"], *registry.input_addresses()],
            outputs=registry.output_addresses(hole=addresses["back_output"]),
            coordinator_input=addresses["back_publish"],
            coordinator_output=addresses["back_output"],
            frontend_stats_publish_address=addresses["front_publish"],
        )
        meta = vllm.EngineHandshakeMetadata(addresses=engine_addresses,
                                            parallel_config=self.parallel_config)
        out.send("handshake", identity, (vllm.encode_init(meta),), SendPurpose.INIT,
                 confirm=True)

    def init_sent(self, rank: int, out: Outbox) -> None:
        """An INIT was handed to its engine: the output addresses it carried are pinned."""
        registry = self.registry
        # Nothing changed in between: the outcome is reported right after the send.
        if registry.pin_outputs():
            out.state_changed()
        registry.note_init(rank)
        if not registry.inits_sent:
            registry.inits_sent = True
            out.state_changed()
        out.log(INFO, "dp_rank=%d: sent INIT", rank, key=f"init:{rank}")

    # ---- what frontends send -----------------------------------------------------------

    def on_register(self, identity: bytes, msg: fp.Register, now: float, out: Outbox) -> None:
        registration = self.registry.register(
            msg.client_index, identity, msg.output_address, msg.input_address, now=now
        )
        if registration.refusal is not None:
            out.reply(identity, fp.ErrorReply(msg.call_id, fp.ERR_BAD_CLIENT_INDEX,
                                              registration.refusal))
            return
        out.state_changed()
        previous = registration.previous
        if registration.verdict is RegisterVerdict.MOVED and previous is not None:
            moved = self._requests.move_frontend(previous.identity, identity)
            out.log(WARNING, "frontend client_index=%d re-registered from a new connection; "
                    "%d in-flight requests now report to it", msg.client_index, moved,
                    key=f"register:{msg.client_index}")
        else:
            out.log(INFO, "frontend client_index=%d registered (outputs at %s)",
                    msg.client_index, msg.output_address, key=f"register:{msg.client_index}")
        blind = self.registry.undeliverable_indices().get(msg.client_index)
        if blind:
            self._journal.counters["frontend.undeliverable"] += 1
            out.log(WARNING, "frontend client_index=%d registered after %s, which did not "
                    "carry its output address: those engines cannot deliver its outputs, so "
                    "its requests go only to other ranks (refused when there are none). "
                    "Start the coordinator with --frontends N, or restart those engines",
                    msg.client_index, inits_went_to(blind),
                    key=f"undeliverable-register:{msg.client_index}")
        wave, running = self._waves.snapshot()
        out.reply(identity, fp.Registered(
            msg.call_id, msg.client_index, self._span.start, len(self._span), wave, running,
            self._config.lockstep, list(blind or ())))
        for _rank, engine in self.registry.release_inits():
            self._send_init(engine, out)

    def on_heartbeat(self, identity: bytes, msg: fp.Heartbeat, now: float, out: Outbox) -> None:
        if msg.progress:
            self._observe_outputs(msg.progress, now)
        registry = self.registry
        if not registry.holds(identity, msg.client_index):
            self._journal.counters["frontend.heartbeat_unregistered"] += 1
            out.reply(identity, fp.ErrorReply(
                msg.call_id, fp.ERR_NOT_REGISTERED, f"client_index {msg.client_index} is not "
                "registered from this connection (its lease expired, or the coordinator "
                "restarted without it): register again"))
            return
        out.reply(identity, fp.Alive(msg.call_id, registry.lease_ttl_s,
                                     self._heartbeat_interval_s()))

    def _heartbeat_interval_s(self) -> float:
        """How often frontends should heartbeat: for their lease, and often enough that
        their evidence of progress reaches the watchdog well within its stall time."""
        interval = self.registry.heartbeat_interval_s
        stall_s = self._config.watchdog_stall_s
        if stall_s > 0:
            interval = min(interval, stall_s / 4)
        return interval

    def _observe_outputs(self, ranks: list[int], now: float) -> None:
        """Outputs of ``ranks`` reached a frontend: they are stepping (see waves.watchdog)."""
        span = self._span
        members = [rank for rank in ranks if rank in span]
        if members:
            self._waves.watchdog.observe_outputs(members, now=now)

    # ---- leases ------------------------------------------------------------------------

    def expire(self, now: float, check_interval_s: float, out: Outbox) -> set[int]:
        """Registrations nobody renewed: free their slots; the ranks their forgotten
        requests were on (each may now be drained)."""
        registry = self.registry
        ranks: set[int] = set()
        for peer in registry.expire(now, check_interval_s=check_interval_s):
            forgotten = self._requests.take_frontend(peer.identity)
            self._journal.counters["frontend.expired"] += 1
            out.state_changed()
            out.refresh()
            out.log(WARNING, "frontend client_index=%d: no message or heartbeat for %g s; "
                    "its registration expired (%d requests in flight from it forgotten)",
                    peer.client_index, registry.lease_ttl_s, len(forgotten),
                    key=f"expired:{peer.client_index}", event="frontend_expired",
                    client_index=peer.client_index, forgotten=len(forgotten))
            ranks.update(entry.rank for entry in forgotten)
        return ranks
