"""Random sequences of membership events, with time moving on, keep the lease invariants.

Besides the invariants, each HELLO and READY is checked against an outcome the
test works out on its own from the lease as it stood before the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from coordinator.core.membership import (
    Accepted,
    EngineLease,
    Membership,
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
    return value


def alive(lease: EngineLease | None, now: float) -> bool:
    return lease is not None and lease.state is not S.DEAD and now <= lease.last_seen + TTL


def outcome(result: object) -> str:
    if isinstance(result, Refused):
        return result.reason.value
    if isinstance(result, Accepted):
        return "duplicate" if result.duplicate else ("replaced" if result.replaced else "new")
    return "changed"


class MembershipMachine(RuleBasedStateMachine):
    # Ranks that have been said HELLO for: later events aim at them more often.
    greeted_ranks = Bundle("greeted_ranks")

    def __init__(self) -> None:
        super().__init__()
        self.m = Membership(rank_start=START, rank_count=3, lease_ttl_s=TTL)
        self.now = 0.0
        self.incarnations: dict[int, int] = {}

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
    )
    def hello(self, rank: int, engine_id: str | None, local: bool, headless: bool) -> int:
        prior = self.m.lease(rank)
        before = self.state()
        result = self.m.hello(
            rank, engine_id=engine_id, local=local, headless=headless, now=self.now
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
                return rank
            if not (prior.engine_id is None and engine_id is None):
                assert isinstance(result, Refused) and result.reason is R.ENGINE_ID_MISMATCH
                assert result.message.startswith(
                    f"Engine ID mismatch for dp_rank={rank}: expected {prior.engine_id}, "
                    f"got {engine_id}. "
                )
                return rank
        assert isinstance(result, Accepted) and not result.duplicate
        assert result.replaced == prior
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
        pinned = [
            lease.parallel_config_hash
            for lease in self.m.leases()
            if lease.state in (S.READY, S.CORDONED, S.DRAINING)
            and lease.parallel_config_hash is not None
            and alive(lease, self.now)
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

    @rule(rank=greeted_ranks | RANKS)
    def greeted(self, rank: int) -> None:
        prior = self.m.lease(rank)
        before = self.state()
        ok = self.m.greeted(rank, self.now)
        assert ok == alive(prior, self.now)
        if not ok:
            assert self.state() == before
        else:
            lease = self.m.lease(rank)
            assert lease is not None and lease.dispatch_connected and lease.last_seen == self.now

    @rule(rank=greeted_ranks | RANKS)
    def touch(self, rank: int) -> None:
        prior = self.m.lease(rank)
        before = self.state()
        self.m.touch(rank, self.now)
        if not alive(prior, self.now):
            assert self.state() == before

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
        # Without `now` the answer is cached between changes: it must equal a fresh one.
        assert self.m.dispatchable() == [
            rank for rank in sorted(by_rank)
            if by_rank[rank].state is S.READY and by_rank[rank].dispatch_connected
        ]
        assert set(self.m.dispatchable(now=self.now)) <= set(self.m.dispatchable())

    @invariant()
    def live_joined_hashes_agree_with_the_group(self) -> None:
        for lease in self.m.leases():
            if (
                lease.state in (S.READY, S.CORDONED, S.DRAINING)
                and lease.parallel_config_hash is not None
                and alive(lease, self.now)
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
