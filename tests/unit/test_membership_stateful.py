"""Random sequences of membership events, with time moving on, keep the lease invariants.

Besides the invariants, each HELLO, READY and greeting is checked against an
outcome the test works out on its own from the lease as it stood before the call
and from the connections it opened and closed itself (every HELLO and greeting
comes on a numbered connection, as the server reports them).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from coordinator.core.ranks.connections import Connections
from coordinator.core.ranks.membership import (
    Accepted,
    EngineLease,
    Greeting,
    Membership,
    ProbeHolder,
    RankChanged,
    RankState,
    RefusalReason,
    Refused,
)

START = 1
TTL = 5.0
# Mostly ranks inside the range, sometimes ones just outside it.
RANKS = st.one_of(
    st.integers(min_value=START, max_value=START + 2),
    st.integers(min_value=START, max_value=START + 2),
    st.sampled_from([START - 1, START + 3, START + 4]),
)
ENGINE_IDS = st.sampled_from([None, "engine-a", "engine-b"])
HASHES = st.sampled_from([None, "h1", "h2"])
S = RankState
R = RefusalReason


def snapshot(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, EngineLease):
        return dataclasses.replace(value)
    if isinstance(value, Connections):
        return copy.deepcopy(value)
    return value


def alive(lease: EngineLease | None, now: float) -> bool:
    return lease is not None and lease.state is not S.DEAD and now <= lease.last_seen + TTL


def outcome(result: object) -> str:
    if isinstance(result, Refused):
        return result.reason.value
    if isinstance(result, Accepted):
        return "duplicate" if result.duplicate else ("replaced" if result.replaced else "new")
    if isinstance(result, ProbeHolder):
        return "probe the holder"
    return "changed"


class MembershipMachine(RuleBasedStateMachine):
    # Ranks that have been said HELLO for: later events aim at them more often.
    greeted_ranks = Bundle("greeted_ranks")

    def __init__(self) -> None:
        super().__init__()
        self.m = Membership(rank_start=START, rank_count=3, lease_ttl_s=TTL)
        self.now = 0.0
        self.incarnations: dict[int, int] = {}
        # The connections this test opened for each rank's current incarnation.
        self.next_conn = 1
        self.hello_conn: dict[int, int] = {}
        self.greet_conn: dict[int, int] = {}
        self.claimed: dict[int, int] = {}
        self.closed: set[int] = set()
        self.reachable: dict[int, bool] = {}

    # -- helpers --------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything the membership holds, copied (cheaper than deepcopy, same result)."""
        # `_dispatchable` is a cache of a derived answer, not state a refusal could change.
        return {
            name: snapshot(value)
            for name, value in vars(self.m).items()
            if name != "_dispatchable"
        }

    def in_range(self, rank: int) -> bool:
        return self.m.rank_start <= rank < self.m.rank_start + self.m.rank_count

    def new_conn(self) -> int:
        self.next_conn += 1
        return self.next_conn

    def connected(self, rank: int, prior: EngineLease) -> bool | None:
        """Whether the holder is still connected, from this test's own record."""
        hello = self.hello_conn.get(rank)
        if prior.state is S.HANDSHAKING and hello is not None and hello not in self.closed:
            return True
        if prior.dispatch_connected:
            return None  # what its dispatch connection carries decides: a probe
        if prior.state is S.HANDSHAKING and hello is not None:
            return False
        return None

    def forget_conns(self, rank: int) -> None:
        for table in (self.hello_conn, self.greet_conn, self.claimed, self.reachable):
            table.pop(rank, None)

    def check_refused_changed_nothing(self, before: dict[str, Any], result: object) -> None:
        if isinstance(result, Refused):
            assert result.message
            assert self.state() == before, result

    # -- rules ----------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 6.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(
        target=greeted_ranks,
        rank=RANKS,
        engine_id=ENGINE_IDS,
        local=st.booleans(),
        headless=st.booleans(),
        probed=st.sampled_from([None, None, True, False]),
    )
    def hello(self, rank: int, engine_id: str | None, local: bool, headless: bool,
              probed: bool | None = None) -> int:
        prior = self.m.lease(rank)
        before = self.state()
        conn = self.new_conn()
        result = self.m.hello(
            rank, engine_id=engine_id, local=local, headless=headless, now=self.now,
            conn=conn, holder_reachable=probed,
        )
        self.check_refused_changed_nothing(before, result)
        event(f"hello: {outcome(result)}")

        if not self.in_range(rank):
            assert isinstance(result, Refused) and result.reason is R.RANK_OUT_OF_RANGE
            return rank
        if alive(prior, self.now):
            assert prior is not None
            if prior.engine_id is not None and prior.engine_id == engine_id:
                assert isinstance(result, Accepted) and result.duplicate
                assert result.lease.incarnation == prior.incarnation
                assert result.lease.last_seen == self.now
                self.hello_conn[rank] = conn
                return rank
            unnamed = prior.engine_id is None and engine_id is None
            connected = self.connected(rank, prior) if probed is None else probed
            if connected is None and prior.dispatch_connected:
                assert isinstance(result, ProbeHolder) and result.holder == prior
                assert self.state() == before
                return rank
            if connected or (connected is None and not unnamed):
                assert isinstance(result, Refused)
                if unnamed:
                    assert result.reason is R.RANK_HELD
                    assert result.message.startswith(f"dp_rank={rank} is held by a live engine")
                else:
                    assert result.reason is R.ENGINE_ID_MISMATCH
                    assert result.message.startswith(
                        f"Engine ID mismatch for dp_rank={rank}: expected {prior.engine_id}, "
                        f"got {engine_id}. "
                    )
                return rank
            if connected is False:
                assert isinstance(result, Accepted) and result.released is not None
                assert result.released.new is S.DEAD
        assert isinstance(result, Accepted) and not result.duplicate
        self.forget_conns(rank)
        self.hello_conn[rank] = conn
        if result.released is not None:
            assert result.replaced is not None and result.replaced.state is S.DEAD
            return self.checked_new_lease(rank, result, engine_id, local, headless)
        assert result.replaced == prior
        return self.checked_new_lease(rank, result, engine_id, local, headless)

    def checked_new_lease(self, rank: int, result: Accepted, engine_id: str | None,
                          local: bool, headless: bool) -> int:
        lease = result.lease
        assert (lease.rank, lease.engine_id, lease.state) == (rank, engine_id, S.HANDSHAKING)
        assert (lease.local, lease.headless, lease.dispatch_connected) == (local, headless, False)
        # Replacement always makes a new, higher incarnation for the rank.
        assert lease.incarnation > self.incarnations.get(rank, 0)
        self.incarnations[rank] = lease.incarnation
        return rank

    @rule(rank=greeted_ranks | RANKS, config_hash=HASHES)
    def ready(self, rank: int, config_hash: str | None) -> None:
        prior = self.m.lease(rank)
        # Every joined lease that is not DEAD pins, live or past its TTL: until expire
        # judges it, its next traffic or probe answer renews it.
        pinned = [
            lease.parallel_config_hash
            for lease in self.m.leases()
            if lease.state in (S.READY, S.CORDONED, S.DRAINING)
            and lease.parallel_config_hash is not None
        ]
        before = self.state()
        result = self.m.ready(rank, parallel_config_hash=config_hash, now=self.now)
        event(f"ready: {outcome(result)}")

        if not self.in_range(rank):
            assert isinstance(result, Refused) and result.reason is R.RANK_OUT_OF_RANGE
        elif not alive(prior, self.now) or (prior is not None and prior.state is not S.HANDSHAKING):
            assert isinstance(result, Refused) and result.reason is R.OUT_OF_ORDER
        elif config_hash is not None and pinned and pinned[0] != config_hash:
            assert isinstance(result, Refused) and result.reason is R.CONFIG_HASH_MISMATCH
            assert pinned[0] in result.message and config_hash in result.message
            # The one allowed side effect of a refusal: this rank is released.
            after = self.m.lease(rank)
            assert after is not None and after.state is S.DEAD
            before["_leases"][rank].state = S.DEAD
            assert self.state() == before
            return
        else:
            assert isinstance(result, Accepted)
            assert result.lease.state is S.READY
            assert result.lease.parallel_config_hash == config_hash
            if config_hash is not None:
                assert self.m.group_config_hash == config_hash
        self.check_refused_changed_nothing(before, result)

    @rule(target=greeted_ranks, rank=RANKS, engine_id=ENGINE_IDS, config_hash=HASHES)
    def join(self, rank: int, engine_id: str | None, config_hash: str | None) -> int:
        """A whole startup at one instant, so that short runs reach the later states."""
        self.hello(rank, engine_id, False, True)
        self.greeted(rank)
        self.ready(rank, config_hash)
        return rank

    @rule(rank=greeted_ranks | RANKS, fresh=st.booleans())
    def greeted(self, rank: int, fresh: bool = True) -> None:
        prior = self.m.lease(rank)
        before = self.state()
        bound = self.greet_conn.get(rank)
        conn = bound if bound is not None and not fresh else self.new_conn()
        greeting = self.m.greeted(rank, self.now, conn)
        event(f"greeting: {greeting.value}")
        if not alive(prior, self.now):
            assert greeting is Greeting.UNREGISTERED
            assert self.state() == before
            return
        lease = self.m.lease(rank)
        assert lease is not None
        if bound is not None and conn != bound:
            # Someone else's connection: no new requests while it is open, not renewed.
            assert greeting is Greeting.SECOND_CLAIM
            assert lease.dispatch_claimed_by == conn and lease.last_seen == prior.last_seen
            assert rank not in self.m.dispatchable()
            self.claimed[rank] = conn
            return
        assert greeting is (Greeting.BOUND if bound is None else Greeting.REPEATED)
        assert lease.dispatch_connected and lease.last_seen == self.now
        self.greet_conn[rank] = conn
        self.reachable[rank] = True

    @rule(rank=greeted_ranks | RANKS)
    def touch(self, rank: int) -> None:
        prior = self.m.lease(rank)
        before = self.state()
        self.m.touch(rank, self.now)
        if prior is None or prior.state is S.DEAD:
            assert self.state() == before
        else:  # traffic renews a lease whatever its age
            assert self.m.lease(rank).last_seen == self.now  # type: ignore[union-attr]

    @rule(data=st.data())
    def connection_closes(self, data: st.DataObject) -> None:
        mine = {conn: rank for table in (self.hello_conn, self.greet_conn, self.claimed)
                for rank, conn in table.items() if conn not in self.closed}
        if not mine:
            return
        conn = data.draw(st.sampled_from(sorted(mine)))
        rank = mine[conn]
        self.closed.add(conn)
        assert self.m.connection_closed(conn) == rank
        assert self.m.connection_closed(conn) is None  # reported once
        if self.greet_conn.get(rank) == conn or self.claimed.get(rank) == conn:
            self.reachable[rank] = False
            self.claimed.pop(rank, None)
            assert rank not in self.m.dispatchable()

    @rule(rank=greeted_ranks | RANKS, back=st.sampled_from([0.0, 1.0, 3.0]))
    def probe_answered(self, rank: int, back: float) -> None:
        """A probe reached the rank: it proves the engine heard ``back`` seconds ago."""
        prior = self.m.lease(rank)
        self.m.renew(rank, self.now - back)
        lease = self.m.lease(rank)
        if prior is None or prior.state is S.DEAD:
            assert lease == prior
            return
        assert lease is not None
        assert lease.last_seen == max(prior.last_seen, self.now - back)
        assert not lease.dispatch_lost
        self.reachable[rank] = True

    @rule(rank=greeted_ranks | RANKS)
    def probe_failed(self, rank: int) -> None:
        self.m.mark_unreachable(rank)
        if self.m.lease(rank) is not None:
            self.reachable[rank] = False
            assert rank not in self.m.dispatchable()

    @rule(rank=greeted_ranks | RANKS)
    def revive(self, rank: int) -> None:
        prior = self.m.lease(rank)
        change = self.m.revive(rank, self.now, "evidence")
        lease = self.m.lease(rank)
        if prior is None or prior.state is not S.DEAD or prior.died_from is None:
            assert change is None and lease == prior
            return
        pinned = {other.parallel_config_hash for other in self.m.leases()
                  if other.rank != rank and other.state in (S.READY, S.CORDONED, S.DRAINING)
                  and other.parallel_config_hash is not None}
        if prior.parallel_config_hash is not None and pinned - {prior.parallel_config_hash}:
            # The group was redeployed with other settings while this rank was away.
            event("revival refused: another config hash")
            assert isinstance(change, Refused)
            assert change.reason is RefusalReason.CONFIG_HASH_MISMATCH
            assert lease == prior
            return
        event("revived")
        assert change == RankChanged(rank, S.DEAD, prior.died_from, "evidence")
        assert lease is not None and lease.state is prior.died_from
        assert lease.incarnation == prior.incarnation and lease.died_from is None
        assert prior.died_from in (S.READY, S.CORDONED, S.DRAINING)
        self.reachable[rank] = True

    @rule(seconds=st.sampled_from([1.0, 4.0, 30.0]))
    def coordinator_paused(self, seconds: float) -> None:
        prior = {lease.rank: lease for lease in self.m.leases()}
        self.now += seconds
        self.m.credit_pause(seconds, self.now)
        for lease in self.m.leases():
            before = prior[lease.rank]
            if before.state is not S.DEAD:
                # The pause is nobody's silence: every live lease is as fresh as before.
                assert lease.last_seen == min(self.now, before.last_seen + seconds)
                assert alive(lease, self.now) == alive(before, self.now - seconds)

    @rule(rank=greeted_ranks | RANKS, which=st.sampled_from(["any", "current", "older"]))
    def disconnected(self, rank: int, which: str) -> None:
        prior = self.m.lease(rank)
        incarnation: int | None = None
        if which != "any":
            incarnation = (prior.incarnation if prior else 1) - (which == "older")
        changes = self.m.disconnected(rank, self.now, incarnation=incarnation)
        after = self.m.lease(rank)
        if prior is None or prior.state is S.DEAD or which == "older":
            assert changes == []
            assert after == prior
        else:
            assert changes == [RankChanged(rank, prior.state, S.DEAD, changes[0].cause)]
            assert changes[0].cause.startswith("engine disconnected")
            assert after is not None and after.state is S.DEAD
            settled = prior.state in (S.READY, S.CORDONED, S.DRAINING)
            assert after.died_from == (prior.state if settled else None)

    @rule()
    def expire(self) -> None:
        changes = self.m.expire(self.now)
        for change in changes:
            assert change.new is S.DEAD and change.old is not S.DEAD
            assert change.cause.startswith("lease expired (last seen ")
        # No lease outlives its ttl once expire(now) has run.
        for lease in self.m.leases():
            assert lease.state is S.DEAD or self.now <= lease.last_seen + TTL

    @rule(rank=greeted_ranks | RANKS, pass_now=st.booleans())
    def cordon(self, rank: int, pass_now: bool) -> None:
        self.command("cordon", rank, pass_now)

    @rule(rank=greeted_ranks | RANKS, pass_now=st.booleans())
    def uncordon(self, rank: int, pass_now: bool) -> None:
        self.command("uncordon", rank, pass_now)

    @rule(rank=greeted_ranks | RANKS, pass_now=st.booleans())
    def drain(self, rank: int, pass_now: bool) -> None:
        self.command("drain", rank, pass_now)

    def command(self, command: str, rank: int, pass_now: bool) -> None:
        prior = self.m.lease(rank)
        before = self.state()
        now = self.now if pass_now else None
        result: RankChanged | Refused = getattr(self.m, command)(rank, now=now)
        event(f"{command}: {outcome(result)}")
        self.check_refused_changed_nothing(before, result)
        if isinstance(result, RankChanged):
            assert prior is not None and prior.state is not S.DEAD
            assert not pass_now or alive(prior, self.now)
            assert result.old is prior.state and result.cause
            expected = {"cordon": S.CORDONED, "uncordon": S.READY, "drain": S.DRAINING}[command]
            assert result.new is expected
        elif prior is None or prior.state is S.DEAD:
            assert result.reason in (R.UNKNOWN_RANK, R.RANK_OUT_OF_RANGE)

    @rule(new_count=st.sampled_from([0, 2, 3, 3, 4]))
    def resize(self, new_count: int) -> None:
        prior = self.m.leases()
        changes = self.m.resize(new_count)
        end = START + new_count
        dropped = [lease for lease in prior if lease.rank >= end]
        assert [(c.rank, c.old, c.new) for c in changes] == [
            (lease.rank, lease.state, None) for lease in dropped
        ]
        assert all(c.cause.startswith("rank removed") for c in changes)
        assert self.m.leases() == [lease for lease in prior if lease.rank < end]
        for lease in dropped:
            self.forget_conns(lease.rank)

    # -- invariants -----------------------------------------------------------

    @invariant()
    def one_lease_per_rank_inside_the_range(self) -> None:
        ranks = [lease.rank for lease in self.m.leases()]
        assert len(ranks) == len(set(ranks))
        assert all(self.in_range(rank) for rank in ranks)

    @invariant()
    def dispatchable_ranks_are_ready_connected_and_alive(self) -> None:
        by_rank = {lease.rank: lease for lease in self.m.leases()}
        for rank in self.m.dispatchable(now=self.now):
            lease = by_rank[rank]
            assert lease.state is S.READY and lease.dispatch_connected and alive(lease, self.now)
            # Reachable on dispatch by what this test told it, and nobody else's.
            assert self.reachable.get(rank, True) and rank not in self.claimed
        # Without `now` the answer is cached between changes: it must equal a fresh one.
        assert self.m.dispatchable() == [
            rank for rank in sorted(by_rank)
            if by_rank[rank].state is S.READY and by_rank[rank].dispatch_connected
            and not by_rank[rank].dispatch_lost and not by_rank[rank].dispatch_claimed_by
        ]
        assert set(self.m.dispatchable(now=self.now)) <= set(self.m.dispatchable())

    @invariant()
    def joined_hashes_agree_with_the_group(self) -> None:
        # Not only the live leases: one past its TTL is live again after its next
        # traffic or probe answer, without a look at its hash.
        for lease in self.m.leases():
            if (
                lease.state in (S.READY, S.CORDONED, S.DRAINING)
                and lease.parallel_config_hash is not None
            ):
                assert lease.parallel_config_hash == self.m.group_config_hash

    @invariant()
    def each_lease_is_its_ranks_newest_incarnation(self) -> None:
        for lease in self.m.leases():
            assert lease.incarnation == self.incarnations[lease.rank]

    @invariant()
    def all_ready_matches_the_leases(self) -> None:
        count = self.m.rank_count
        ready = [lease.rank for lease in self.m.leases() if lease.state is S.READY]
        assert self.m.all_ready() == (count > 0 and len(ready) == count)


TestMembershipMachine = MembershipMachine.TestCase
TestMembershipMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def replay(*steps: tuple[str, tuple[Any, ...]]) -> None:
    """Run one sequence of the model's rules by hand, checking every invariant after each
    (inside a one-example hypothesis test, where the rules may record their events)."""

    @settings(max_examples=1, database=None, deadline=None)
    @given(st.just(steps))
    def run(steps: tuple[tuple[str, tuple[Any, ...]], ...]) -> None:
        _replay(steps)

    run()


def _replay(steps: tuple[tuple[str, tuple[Any, ...]], ...]) -> None:
    machine = MembershipMachine()
    invariants = [
        machine.one_lease_per_rank_inside_the_range,
        machine.dispatchable_ranks_are_ready_connected_and_alive,
        machine.joined_hashes_agree_with_the_group,
        machine.each_lease_is_its_ranks_newest_incarnation,
        machine.all_ready_matches_the_leases,
    ]
    for name, args in steps:
        getattr(machine, name)(*args)
        for check in invariants:
            check()


def test_a_lease_past_its_ttl_that_a_probe_renews_still_carries_the_groups_hash() -> None:
    # Found by this model: rank 1 joined with h1 and went unheard past its TTL, rank 2's
    # READY with h2 was accepted meanwhile, then a probe answered for rank 1: two live
    # leases with different hashes. Now rank 2 is refused until rank 1 is judged.
    replay(
        ("join", (START, None, "h1")),
        ("advance", (5.0,)),
        ("advance", (0.5,)),
        ("join", (START + 1, None, "h2")),
        ("probe_answered", (START, 0.0)),
    )
