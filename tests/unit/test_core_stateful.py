"""The composed core inside a model of a whole group: engines, frontends, deaths, time.

Hypothesis drives ``CoordinatorCore`` (through ``Driver``, which plays the
server's side and reports send outcomes as the server does) with everything a
group does:

* engines say HELLO (with a fresh ``engine_id`` per process, or none as stock
  vLLM does), READY, greet on dispatch and subscribe on ``back_publish``; they
  report stats and wave changes, possibly stale or ahead;
* an engine process dies (its connection is gone: every send to it fails) and a
  new one starts on the same rank; a live engine's connection drops for a while;
* frontends register (within and beyond the expected indices, from new
  connections), submit (fresh and duplicate ids, with and without an explicit
  rank, stamped with the last wave they heard), finish, abort, and send admin
  commands;
* time passes and the timer ticks.

After every step the invariants below are checked against what the core sent
and what it holds. ``WaveState``'s own model (``test_waves_stateful.py``)
checks the wave table against engine behaviour in depth; this one checks that
the composition keeps the group's promises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from coordinator.core.events import KV_DRAIN, KVBatchReceived, KVReplayEnded
from coordinator.core.kv.plane import KVSettings
from coordinator.core.ranks import liveness
from coordinator.core.ranks.membership import RankState
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.identity import identity_to_rank, rank_to_identity
from coordinator.protocol.kv_events import BlockStored, KVEventBatch
from tests.unit.core_driver import Driver

TTL = 3.0
FRONTEND_TTL = 6.0  # short enough that runs see registrations expire
REWAKE = 1.0
MAX_IN_FLIGHT = 4
MAX_FRONTENDS = 3
INDICES = 4  # client indices tried: some beyond what is allowed
SUBMIT_CODES = {
    fp.ERR_DUPLICATE_REQUEST, fp.ERR_TOO_MANY_IN_FLIGHT, fp.ERR_UNKNOWN_RANK,
    fp.ERR_RANK_NOT_READY, fp.ERR_NO_READY_ENGINE, fp.ERR_ENGINE_UNREACHABLE,
    fp.ERR_UNDELIVERABLE,
}


@dataclass
class Engine:
    """One engine process on one rank, as far as the model follows it."""

    rank: int
    generation: int
    engine_id: str | None
    phase: str = "new"  # new -> init -> ready, or refused; dead when killed
    greeted: bool = False
    subscribed: bool = False


@dataclass
class Request:
    rank: int
    frontend: int
    ended: bool = False


@dataclass
class Seen:
    """What the checks have already looked at in the driver's records."""

    sends: int = 0
    publishes: int = 0
    wakes: list[tuple[int, float, int]] = field(default_factory=list)  # wave, now, epoch
    ready_sent: bool = False
    max_wave: int = 0
    max_published_wave: int = 0
    epoch: int = 0
    carried: dict[int, set[str]] = field(default_factory=dict)
    """The output addresses each rank's last INIT carried (holes left out)."""


class CoreGroup(RuleBasedStateMachine):
    """A lockstep group of 2 to 4 ranks around one composed core."""

    @initialize(engines=st.integers(2, 4), expected=st.integers(0, 2), seed=st.integers(0, 9),
                up=st.booleans())
    def start(self, engines: int, expected: int, seed: int, up: bool) -> None:
        self.ranks = engines
        self.expected = expected
        self.driver = Driver.start(
            engines=engines, frontends=expected, max_frontends=MAX_FRONTENDS,
            max_in_flight=MAX_IN_FLIGHT, lease_ttl_s=TTL, rewake_after_s=REWAKE,
            watchdog_stall_s=0.0, persist=True, seed=seed, frontend_lease_ttl_s=FRONTEND_TTL,
        )
        self.engines = {rank: Engine(rank, 0, f"e{rank}.0") for rank in range(engines)}
        self.frontend_connections: dict[int, bytes] = {}
        self.requests: dict[str, Request] = {}
        self.next_request = 0
        self.seen = Seen()
        if up:  # most runs start from a group that is up; the others build it step by step
            self.expected_frontends_register()
            self.engines_come_up()

    # ---- helpers ---------------------------------------------------------------------------

    @property
    def core(self):  # type: ignore[no-untyped-def]
        return self.driver.core

    def epoch(self) -> int:
        """Changes whenever the group changed (a rank died or was replaced)."""
        counters = self.core.counter_values()
        return counters.get("lease.dead", 0) + counters.get("handshake.replaced", 0)

    def live(self, engine: Engine) -> bool:
        return engine.phase != "dead"

    def greet(self, rank: int) -> None:
        self.engines[rank].greeted = True
        self.driver.unreachable.discard(("dispatch", rank_to_identity(rank)))
        self.driver.greet(rank)

    def ready_accepted(self, rank: int, before: int) -> bool:
        """READY went through: the SDK engine got ACCEPTED; a stock one gets no reply."""
        replies = self.driver.handshake_replies(rank)[before:]
        if self.engines[rank].engine_id is not None:
            return replies == [vllm.HandshakeAccepted()]
        assert not any(isinstance(r, vllm.HandshakeAccepted) for r in replies)
        lease = self.core.membership.lease(rank)
        return not replies and lease is not None and lease.state is RankState.READY

    def connection(self, index: int) -> bytes:
        return self.frontend_connections.setdefault(index, bytes([0, 0xFE, index, 0]))

    def check_new_output(self) -> None:
        """Look at what the core sent since the last look (every invariant may ask first)."""
        driver = self.driver
        for socket, _identity, frames in driver.sends[self.seen.sends:]:
            if socket == "handshake":
                reply = vllm.decode_handshake_reply(frames[0])
                if isinstance(reply, vllm.EngineHandshakeMetadata):
                    # INIT never goes out before the expected frontends registered.
                    assert len(self.core.frontends.registry) >= self.expected
                    hole = reply.addresses.coordinator_output
                    self.seen.carried[identity_to_rank(_identity)] = {
                        address for address in reply.addresses.outputs if address != hole}
            elif socket == "frontend":
                message = fp.decode_reply(frames[0])
                if isinstance(message, fp.RequestsFailed):
                    event("requests failed with their rank")
                    for request_id in message.request_ids:
                        request = self.requests[request_id]
                        assert not request.ended, f"{request_id} ended twice"
                        assert request.rank == message.rank
                        request.ended = True
                elif isinstance(message, fp.RankDrained):
                    event("drain notice")
                    lease = self.core.membership.lease(message.rank)
                    assert lease is not None and lease.state is RankState.DRAINING
                    assert self.core.dispatch.requests.count(message.rank) == 0
        self.seen.sends = len(driver.sends)
        for socket, frames in driver.publishes[self.seen.publishes:]:
            if socket == "back_publish":
                if frames == [vllm.READY]:
                    self.seen.ready_sent = True
                    continue
                # No START_DP_WAVE before the gate's READY (vLLM engines assert on it).
                assert self.seen.ready_sent, "START_DP_WAVE before READY"
                wave, exclude = vllm.decode_start_dp_wave(frames)
                if exclude is None:
                    # Tagged with the group as it was before the step: a change the
                    # step made cannot excuse a wake it sent before the change.
                    self.seen.wakes.append((wave, driver.now, self.seen.epoch))
            else:
                published = vllm.decode_front_publish(frames[0])
                assert published.wave >= self.seen.max_published_wave
                self.seen.max_published_wave = published.wave
        self.seen.publishes = len(driver.publishes)
        self.seen.epoch = self.epoch()

    def prompt_keys(self, data: st.DataObject) -> fp.PromptKeys | None:
        """What a submit says about its prompt (nothing here; see PrefixCoreGroup)."""
        return None

    # ---- engines ---------------------------------------------------------------------------

    @rule(data=st.data())
    def engine_hello(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        engine = self.engines[rank]
        if engine.phase == "dead":
            return
        before = len(self.driver.handshake_replies(rank))
        self.driver.hello(rank, engine.engine_id)
        replies = self.driver.handshake_replies(rank)[before:]
        if any(isinstance(r, vllm.EngineHandshakeMetadata) for r in replies):
            engine.phase = "init"
        elif any(isinstance(r, vllm.HandshakeError) for r in replies):
            engine.phase = "refused"
        # else: the INIT is held for the frontends

    @rule()
    def engines_come_up(self) -> None:
        """Every live engine takes its next handshake steps at once (the usual start-up)."""
        for rank, engine in self.engines.items():
            if engine.phase == "new":
                before = len(self.driver.handshake_replies(rank))
                self.driver.hello(rank, engine.engine_id)
                replies = self.driver.handshake_replies(rank)[before:]
                if any(isinstance(r, vllm.EngineHandshakeMetadata) for r in replies):
                    engine.phase = "init"
            if engine.phase == "init":
                before = len(self.driver.handshake_replies(rank))
                self.driver.ready(rank)
                if self.ready_accepted(rank, before):
                    engine.phase = "ready"
            if engine.phase == "ready":
                if not engine.greeted:
                    self.greet(rank)
                if not engine.subscribed:
                    engine.subscribed = True
                    self.driver.subscribe()

    @rule()
    def expected_frontends_register(self) -> None:
        for index in range(max(self.expected, 1)):
            if self.core.frontends.registry.get(index) is None:
                self.driver.register(index, identity=self.connection(index),
                                     output=f"ipc:///out-{index}")

    @rule(data=st.data())
    def engine_ready(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        engine = self.engines[rank]
        if engine.phase not in ("init", "new"):
            return
        before = len(self.driver.handshake_replies(rank))
        self.driver.ready(rank)
        if engine.phase == "init" and self.ready_accepted(rank, before):
            engine.phase = "ready"

    @rule(data=st.data())
    def engine_greets_and_subscribes(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        engine = self.engines[rank]
        if engine.phase != "ready":
            return
        if not engine.greeted:
            self.greet(rank)
        elif not engine.subscribed:
            engine.subscribed = True
            self.driver.subscribe()

    @rule(data=st.data())
    def engine_reports(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        if not self.live(self.engines[rank]):
            return
        current = self.core.waves.table.current_wave
        wave = data.draw(st.integers(max(0, current - 1), current + 1))
        kind = data.draw(st.sampled_from(["stats", "start_wave", "wave_complete"]))
        if kind == "stats":
            self.driver.report(rank, wave=wave, step=data.draw(st.integers(0, 5)),
                               waiting=data.draw(st.integers(0, 3)))
        elif kind == "start_wave":
            self.driver.report(rank, start_wave=wave)
        elif rank == 0:
            self.driver.report(rank, wave_complete=wave)

    @rule(data=st.data())
    def engine_dies(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        engine = self.engines[rank]
        engine.phase = "dead"
        self.driver.unreachable.add(("dispatch", rank_to_identity(rank)))
        self.driver.unreachable.add(("handshake", rank_to_identity(rank)))

    @rule(data=st.data(), stock=st.booleans())
    def engine_restarts(self, data: st.DataObject, stock: bool) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        old = self.engines[rank]
        if old.phase != "dead":
            return
        generation = old.generation + 1
        self.engines[rank] = Engine(rank, generation, None if stock else f"e{rank}.{generation}")
        # Its dispatch socket connects only after its INIT: until it greets, nobody holds
        # the rank's identity there, and the old incarnation cannot be revived by it.
        self.driver.unreachable.discard(("handshake", rank_to_identity(rank)))

    @rule(data=st.data())
    def connection_blips(self, data: st.DataObject) -> None:
        """A live engine's dispatch connection is gone for a moment (or comes back)."""
        rank = data.draw(st.integers(0, self.ranks - 1))
        if not self.live(self.engines[rank]):
            return
        key = ("dispatch", rank_to_identity(rank))
        if key in self.driver.unreachable:
            self.driver.unreachable.discard(key)
        else:
            self.driver.unreachable.add(key)

    # ---- frontends -------------------------------------------------------------------------

    @rule(index=st.integers(0, INDICES - 1), reconnect=st.booleans(), moved=st.booleans())
    def frontend_registers(self, index: int, reconnect: bool, moved: bool) -> None:
        if reconnect and index in self.frontend_connections:
            self.frontend_connections[index] = bytes([0, 0xFE, index, len(self.driver.sends) % 250])
        output = f"ipc:///out-{index}" + ("-moved" if moved else "")
        previous = self.core.frontends.registry.get(index)
        reply = self.driver.register(index, identity=self.connection(index), output=output)
        current = self.core.frontends.registry.get(index)
        if isinstance(reply, fp.Registered):
            assert current is not None and current.output_address == output
        else:
            assert current == previous  # a refusal changes nothing
        if previous is not None and self.core.frontends.registry.inits_sent:
            # Engines learnt this address: it never moves after an INIT went out.
            assert current is not None and current.output_address == previous.output_address

    @rule(data=st.data(), count=st.integers(1, 3))
    def frontend_submits(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            self.submit_one(data)

    def submit_one(self, data: st.DataObject) -> None:
        registered = [peer.client_index for peer in self.core.frontends.registry.peers()]
        if not registered:
            return
        index = data.draw(st.sampled_from(registered))
        in_flight = [rid for rid, r in self.requests.items() if not r.ended]
        if in_flight and data.draw(st.booleans()):
            request_id = data.draw(st.sampled_from(in_flight))  # a duplicate
        else:
            request_id = f"r{self.next_request}"
            self.next_request += 1
        explicit = data.draw(st.none() | st.integers(0, self.ranks))
        wave = data.draw(st.sampled_from([0, self.seen.max_published_wave,
                                          self.core.waves.table.current_wave + 1]))
        dispatchable = set(self.core.membership.dispatchable())
        ledger_before = dict(self.core.dispatch.requests.per_rank())
        failed_before = len(self.driver.failed_sends)
        identity = self.core.frontends.registry.get(index).identity  # type: ignore[union-attr]
        replies = self.driver.request(identity, fp.Submit(self.driver.call_id(), request_id,
                                                          wave, explicit,
                                                          self.prompt_keys(data)),
                                      [b"payload:" + request_id.encode()])
        answers = [r for r in replies if isinstance(r, (fp.Submitted, fp.ErrorReply))]
        assert len(answers) == 1, f"submit answered {len(answers)} times: {replies}"
        (answer,) = answers
        event("submit: " + ("woke" if getattr(answer, "woke", False) else
                            getattr(answer, "code", "dispatched")))
        if any(f.action.__class__.__name__ == "DispatchAdd"
               for f in self.driver.failed_sends[failed_before:]):
            event("submit: an ADD failed and was handled")
        self.check_new_output()
        output = self.core.frontends.registry.get(index).output_address  # type: ignore[union-attr]
        # A rank whose INIT went out here delivers outputs only to the addresses it carried.
        deliver = {rank for rank in dispatchable
                   if rank not in self.seen.carried or output in self.seen.carried[rank]}
        if isinstance(answer, fp.Submitted):
            assert request_id not in self.requests or self.requests[request_id].ended
            assert answer.rank in dispatchable
            assert answer.rank in deliver, (answer.rank, output, self.seen.carried)
            assert explicit is None or answer.rank == explicit
            adds = [p for p in self.driver.adds(answer.rank)
                    if p == [b"payload:" + request_id.encode()]]
            assert len(adds) >= 1
            self.requests[request_id] = Request(answer.rank, index)
        else:
            assert answer.code in SUBMIT_CODES, answer
            assert self.core.dispatch.requests.per_rank() == ledger_before
            if answer.code == fp.ERR_UNDELIVERABLE:
                event("submit: undeliverable")
                assert not (deliver if explicit is None else deliver & {explicit}), answer

    @rule(data=st.data(), abort=st.booleans())
    def frontend_ends_a_request(self, data: st.DataObject, abort: bool) -> None:
        in_flight = [rid for rid, r in self.requests.items() if not r.ended]
        if not in_flight:
            return
        request_id = data.draw(st.sampled_from(in_flight))
        request = self.requests[request_id]
        peer = self.core.frontends.registry.get(request.frontend)
        assert peer is not None
        if abort:
            replies = self.driver.request(peer.identity,
                                          fp.Abort(self.driver.call_id(), [request_id]))
            (reply,) = [r for r in replies if isinstance(r, fp.Aborted)]
            assert reply.request_ids == [request_id]
        else:
            self.driver.request(peer.identity, fp.Finished([request_id]))
        request.ended = True

    @rule(command=st.sampled_from(["cordon", "uncordon", "drain"]), data=st.data())
    def operator_command(self, command: str, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        self.driver.operator(fp.Admin(self.driver.call_id(), command, rank))

    # ---- time ------------------------------------------------------------------------------

    @rule(data=st.data())
    def frontend_heartbeats(self, data: st.DataObject) -> None:
        registered = [peer.client_index for peer in self.core.frontends.registry.peers()]
        if not registered:
            return
        index = data.draw(st.sampled_from(registered))
        identity = self.core.frontends.registry.get(index).identity  # type: ignore[union-attr]
        (reply,) = self.driver.request(identity, fp.Heartbeat(self.driver.call_id(), index))
        assert isinstance(reply, fp.Alive)

    @rule(command=st.sampled_from(["cordon", "uncordon", "drain"]), data=st.data())
    def frontend_tries_an_admin_command(self, command: str, data: st.DataObject) -> None:
        # Changing membership is an operator's: from a frontend connection, nothing changes.
        rank = data.draw(st.integers(0, self.ranks - 1))
        before = [(lease.rank, lease.state) for lease in self.core.membership.leases()]
        replies = self.driver.request(self.connection(0), fp.Admin(self.driver.call_id(),
                                                                   command, rank))  # type: ignore[arg-type]
        assert [r.code for r in replies if isinstance(r, fp.ErrorReply)] == [
            fp.ERR_NOT_AUTHORIZED]
        assert [(lease.rank, lease.state) for lease in self.core.membership.leases()] == before

    def tick(self, now: float) -> None:
        """The timer; a frontend registration it expired takes its requests with it."""
        before = {peer.client_index for peer in self.core.frontends.registry.peers()}
        self.driver.tick(now)
        gone = before - {peer.client_index for peer in self.core.frontends.registry.peers()}
        if gone:
            event("a frontend registration expired")
        for request in self.requests.values():
            if request.frontend in gone:
                request.ended = True

    @rule(step=st.sampled_from([0.0, 0.1, 0.3, 1.1, 2.5, 3.5]))
    def time_passes(self, step: float) -> None:
        # Tick at every deadline on the way, looking at the output after each, so that
        # what was sent is stamped with when it was sent.
        target = self.driver.now + step
        while self.core.next_deadline() < target:
            self.tick(max(self.driver.now, self.core.next_deadline()))
            self.check_new_output()
        self.tick(target)

    @rule()
    def a_dead_rank_whose_engine_lives_comes_back(self) -> None:
        """Dead is revisable: an engine that never stopped, reachable again on dispatch
        after a blip that killed its lease, is ready again once the timer ran twice."""
        back = []
        for rank, engine in self.engines.items():
            lease = self.core.membership.lease(rank)
            if (self.live(engine) and engine.greeted and engine.engine_id is not None
                    and ("dispatch", rank_to_identity(rank)) not in self.driver.unreachable
                    and lease is not None and lease.engine_id == engine.engine_id
                    and lease.state is RankState.DEAD and lease.died_from is not None):
                back.append(rank)
        if not back:
            return
        self.time_passes(2 * liveness.check_interval_s(self.core.config.lease_ttl_s) + 0.01)
        for rank in back:
            event("a dead rank revived")
            assert self.core.membership.lease(rank).state is not RankState.DEAD, rank  # type: ignore[union-attr]

    @rule(seconds=st.sampled_from([2.0, 20.0]))
    def coordinator_stalls(self, seconds: float) -> None:
        """SIGSTOP, then SIGCONT: nobody's silence, so nobody dies of it."""
        before = {lease.rank: lease.state for lease in self.core.membership.leases()}
        self.driver.stall(self.driver.now + seconds)
        event("coordinator stalled")
        for lease in self.core.membership.leases():
            if before.get(lease.rank) not in (None, RankState.DEAD):
                assert lease.state is not RankState.DEAD, (lease, before)

    @precondition(lambda self: self.core.next_deadline() < float("inf"))
    @rule()
    def timer_fires(self) -> None:
        self.tick(max(self.driver.now, self.core.next_deadline()))

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def output_keeps_the_promises(self) -> None:
        self.check_new_output()

    @invariant()
    def the_wave_never_goes_back(self) -> None:
        wave = self.core.waves.table.current_wave
        assert wave >= self.seen.max_wave
        self.seen.max_wave = wave

    @invariant()
    def one_wake_per_wave_while_it_counts(self) -> None:
        # Concurrent first requests cost one wake per wave: another wake for the same
        # wave needs the first to have expired, or the group to have changed since.
        self.check_new_output()
        wakes = self.seen.wakes
        for i, (wave, at, epoch) in enumerate(wakes):
            for later_wave, later_at, later_epoch in wakes[i + 1:]:
                if later_wave == wave and later_epoch == epoch:
                    assert later_at - at >= REWAKE, wakes

    @invariant()
    def a_wake_the_wave_machine_counts_on_went_out(self) -> None:
        # Believing in a wake that never left would suppress the next one, and the relay
        # of an engine's start, leaving the woken group short of peers.
        self.check_new_output()
        pending = self.core.waves.table.wake_pending_for
        if pending is None:
            return
        held = self.core.waves.gate.held_wake
        if held is not None and vllm.decode_start_dp_wave(held) == (pending, None):
            return
        assert any(wave == pending for wave, _, _ in self.seen.wakes), (pending, self.seen.wakes)

    @invariant()
    def the_ledger_is_the_models(self) -> None:
        core = self.core
        open_requests = {rid: r for rid, r in self.requests.items() if not r.ended}
        per_rank: dict[int, int] = {}
        for rid, request in open_requests.items():
            entry = core.dispatch.requests.get(rid)
            assert entry is not None and entry.rank == request.rank, rid
            per_rank[request.rank] = per_rank.get(request.rank, 0) + 1
        assert len(core.dispatch.requests) == len(open_requests)
        assert core.dispatch.requests.per_rank() == per_rank

    @invariant()
    def registrations_are_bounded(self) -> None:
        assert len(self.core.frontends.registry) <= max(self.expected, MAX_FRONTENDS)

    @invariant()
    def nothing_in_flight_on_a_dead_rank(self) -> None:
        for rank in range(self.ranks):
            lease = self.core.membership.lease(rank)
            if lease is None or lease.state is RankState.DEAD:
                assert self.core.dispatch.requests.count(rank) == 0

    @invariant()
    def dispatchable_ranks_are_ready_and_greeted(self) -> None:
        for rank in self.core.membership.dispatchable():
            lease = self.core.membership.lease(rank)
            assert lease is not None and lease.state is RankState.READY
            assert lease.dispatch_connected

    @invariant()
    def the_state_file_follows(self) -> None:
        saves = self.driver.saves
        if saves:
            assert saves[-1].wave <= self.core.waves.table.current_wave
            assert saves[-1].version == 1


TestCoreGroup = CoreGroup.TestCase
TestCoreGroup.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
)


def test_a_wake_held_at_the_gate_is_retried_a_full_rewake_after_it_left() -> None:
    """Found by this model: wakes ``[(0, 0.1, 0), (0, 1.0, 0)]`` (wave, when it was
    published, group epoch). A submit at 0.0 woke wave 0 while the start-up gate was
    closed, the gate opened at 0.1 and let the wake out, and the timer retried it at
    1.0, 0.9 s after it was sent: the wave table counted the wake from when it was
    decided (see ``WaveState.on_wake_released``)."""
    driver = Driver.start(engines=2, frontends=0, lease_ttl_s=TTL, rewake_after_s=REWAKE,
                          watchdog_stall_s=0.0)
    driver.register(0)  # before the INITs, so that they carry its outputs
    for rank in range(2):
        driver.join(rank, f"e{rank}.0")
    reply = driver.submit("r0")
    assert isinstance(reply, fp.Submitted) and reply.woke
    assert driver.back_publish() == []  # held: READY must come first
    driver.tick(0.1)
    driver.subscribe(2)
    assert driver.back_publish() == ["READY", (0, None)]
    driver.tick(0.1 + REWAKE - 0.01)
    assert driver.wakes() == [(0, None)]
    driver.tick(0.1 + REWAKE + 0.5)  # a full rewake_after_s after it left, and a tick
    assert driver.wakes() == [(0, None), (0, None)]


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9], [5, 5, 5, 5, 5]]


class PrefixCoreGroup(CoreGroup):
    """The same group routed by ``--policy prefix``: each live engine also publishes KV
    events (some lost on the way), and submits name their prompts. On top of every
    promise above: an index never holds blocks for a rank whose engine is gone for good
    (a dead rank that may come back keeps its index: the same engine and cache return),
    and routing never picks a rank that cannot take requests."""

    @initialize(engines=st.integers(2, 4), expected=st.integers(0, 2), seed=st.integers(0, 9),
                up=st.booleans())
    def start(self, engines: int, expected: int, seed: int, up: bool) -> None:
        self.ranks = engines
        self.expected = expected
        self.driver = Driver.start(
            engines=engines, frontends=expected, max_frontends=MAX_FRONTENDS,
            max_in_flight=MAX_IN_FLIGHT, lease_ttl_s=TTL, rewake_after_s=REWAKE,
            watchdog_stall_s=0.0, persist=True, seed=seed, policy="prefix",
            kv=KVSettings(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600",
                          block_size=4),
        )
        self.engines = {rank: Engine(rank, 0, f"e{rank}.0") for rank in range(engines)}
        self.frontend_connections: dict[int, bytes] = {}
        self.requests: dict[str, Request] = {}
        self.next_request = 0
        self.seen = Seen()
        self.published: dict[tuple[int, int], int] = {}  # (rank, generation) -> next seq
        if up:
            self.expected_frontends_register()
            self.engines_come_up()

    def prompt_keys(self, data: st.DataObject) -> fp.PromptKeys | None:
        tokens = data.draw(st.sampled_from(PROMPTS))
        return fp.PromptKeys(tokens, session_id=data.draw(st.sampled_from([None, "a", "b"])))

    @rule(data=st.data(), delivered=st.booleans())
    def engine_publishes(self, data: st.DataObject, delivered: bool) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        engine = self.engines[rank]
        if engine.phase != "ready":
            return  # an engine publishes once it serves, after its handshake
        key = (rank, engine.generation)
        seq = self.published.get(key, 0)
        self.published[key] = seq + 1
        tokens = data.draw(st.sampled_from(PROMPTS))[:8]
        event = BlockStored([f"{rank}.{engine.generation}.{seq}.{i}".encode() for i in (0, 1)],
                            None, tokens, 4, None, "GPU", None)
        if delivered:
            self.driver.feed(KVBatchReceived(rank, seq, KVEventBatch(0.0, [event])))
        self.driver.feed(KV_DRAIN)

    @rule(data=st.data())
    def replay_answers_nothing(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        self.driver.feed(KVReplayEnded(rank))

    @invariant()
    def a_gone_rank_holds_nothing_in_the_index(self) -> None:
        kv = self.core.kv.plane
        assert kv is not None and kv.index is not None
        for rank in range(self.ranks):
            lease = self.core.membership.lease(rank)
            if lease is not None and lease.state is RankState.DEAD and lease.died_from is None:
                assert kv.index.blocks(rank) == 0, rank
        assert kv.pending_blocks >= 0


TestPrefixCoreGroup = PrefixCoreGroup.TestCase
TestPrefixCoreGroup.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None,
)
