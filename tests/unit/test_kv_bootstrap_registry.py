"""The KV bootstrap registry's rule (``core.bootstrap.registry``), case by case.

Each test is one row of the rule's table, plus the payload bounds, the query's
view, the state file's round trip and the membership's evidence reaching the
registry through the core's fan-out.
"""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from coordinator.core.bootstrap.payload import (
    MAX_ENGINE_ID_CHARS,
    PayloadBounds,
    PayloadError,
    RegisterWorkerPayload,
    decode_payload,
)
from coordinator.core.bootstrap.registry import (
    BootstrapRegistry,
    Conflict,
    ProbeNeeded,
    Registered,
)
from coordinator.core.config import BootstrapSettings
from coordinator.core.events import Restore
from coordinator.core.persisted import SavedState
from coordinator.protocol.identity import rank_to_identity
from coordinator.server.config import ServerConfig
from tests.unit.core_driver import Driver

BOUNDS = PayloadBounds(range(0, 2), tp_size=2, pp_size=1)


def worker(engine: str, dp: int, tp: int = 0, port: int = 5000, pp: int = 0
           ) -> RegisterWorkerPayload:
    return RegisterWorkerPayload(engine, dp, tp, pp, f"tcp://10.0.0.1:{port}")


def registry(bounds: PayloadBounds = BOUNDS) -> BootstrapRegistry:
    return BootstrapRegistry(bounds, Counter())


def full_engine(reg: BootstrapRegistry, engine: str, dp: int, base_port: int) -> None:
    for tp in range(reg.bounds.tp_size):
        assert reg.register(worker(engine, dp, tp, base_port + tp), 0.0) == Registered()


def query_ids(reg: BootstrapRegistry) -> dict[int, str]:
    return {dp: entry.engine_id for dp, entry in reg.query().items()}


# ---- the rule's rows --------------------------------------------------------------------


def test_a_new_rank_gets_an_entry_and_a_full_engine_is_queried() -> None:
    reg = registry()
    assert reg.register(worker("A", 0, 0, 5000), 0.0) == Registered()
    assert query_ids(reg) == {}  # tp_rank 1 has not registered: not complete yet
    assert reg.register(worker("A", 0, 1, 5001), 0.0) == Registered()
    assert query_ids(reg) == {0: "A"}
    assert reg.query()[0].workers == {0: {0: "tcp://10.0.0.1:5000"}, 1: {0: "tcp://10.0.0.1:5001"}}
    assert reg.counters["kv_bootstrap.registrations"] == 2


def test_an_identical_retry_is_ok_and_changes_nothing() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    before = reg.saved()
    assert reg.register(worker("A", 0, 1, 5001), 1.0) == Registered(retry=True)
    assert reg.saved() == before
    assert reg.counters["kv_bootstrap.retries"] == 1


def test_another_engine_on_a_held_rank_asks_for_a_probe_of_every_side_channel() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    decision = reg.register(worker("B", 0, 0, 6000), 1.0)
    assert isinstance(decision, ProbeNeeded)
    assert decision.dp_rank == 0
    assert decision.addresses == ("tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001")
    assert query_ids(reg) == {0: "A"}  # asking changes nothing


def test_the_old_holder_proven_gone_by_the_probe_is_replaced_whole() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    probe = reg.register(worker("B", 0, 0, 6000), 1.0)
    assert isinstance(probe, ProbeNeeded)
    assert reg.probe_answered(probe, alive=False)
    assert query_ids(reg) == {}  # the gone engine is no longer shown
    decision = reg.register(worker("B", 0, 0, 6000), 1.1, probed=True)
    assert isinstance(decision, Registered) and decision.replaced is not None
    assert (decision.replaced.old_engine_id, decision.replaced.new_engine_id) == ("A", "B")
    # Nothing of A is left: B's second worker completes an entry of B's alone.
    assert reg.entries[0].workers == {0: {0: "tcp://10.0.0.1:6000"}}
    assert reg.register(worker("B", 0, 1, 6001), 1.2) == Registered()
    assert query_ids(reg) == {0: "B"}
    assert reg.counters["kv_bootstrap.replacements"] == 1


def test_a_live_old_holder_is_a_conflict_naming_both_engines_and_the_remedy() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    before = reg.saved()
    probe = reg.register(worker("B", 0, 0, 6000), 1.0)
    assert isinstance(probe, ProbeNeeded)
    assert not reg.probe_answered(probe, alive=True)
    decision = reg.register(worker("B", 0, 0, 6000), 1.1, probed=True)
    assert isinstance(decision, Conflict)
    for part in ("dp_rank=0", "engine A", "engine B", "tcp://10.0.0.1:5000",
                 "--data-parallel-rank", "--kv-bootstrap-port"):
        assert part in decision.detail
    assert reg.saved() == before
    assert query_ids(reg) == {0: "A"}
    assert reg.counters["kv_bootstrap.conflicts"] == 1


def test_the_same_engine_at_a_new_address_replaces_its_entry_once_the_old_is_gone() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    probe = reg.register(worker("A", 0, 1, 7001), 1.0)
    assert isinstance(probe, ProbeNeeded)
    assert probe.addresses == ("tcp://10.0.0.1:5001",)  # only the slot's old holder
    reg.probe_answered(probe, alive=False)
    decision = reg.register(worker("A", 0, 1, 7001), 1.1, probed=True)
    assert isinstance(decision, Registered) and decision.replaced is not None
    assert reg.entries[0].workers == {1: {0: "tcp://10.0.0.1:7001"}}  # tp 0 must come again


def test_the_same_slot_at_a_live_other_address_is_refused_as_vllm_would() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    probe = reg.register(worker("A", 0, 1, 7001), 1.0)
    assert isinstance(probe, ProbeNeeded)
    reg.probe_answered(probe, alive=True)
    decision = reg.register(worker("A", 0, 1, 7001), 1.1, probed=True)
    assert isinstance(decision, Conflict)
    assert "tcp://10.0.0.1:5001" in decision.detail and "tcp://10.0.0.1:7001" in decision.detail


def test_a_probe_about_an_entry_replaced_meanwhile_is_ignored() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    stale = reg.register(worker("B", 0, 0, 6000), 1.0)
    assert isinstance(stale, ProbeNeeded)
    reg.rank_superseded(0, "a new incarnation said HELLO")
    assert isinstance(reg.register(worker("C", 0, 0, 8000), 1.1), Registered)
    assert not reg.probe_answered(stale, alive=False)  # about A's entry, not C's
    assert reg.entries[0].gone is None and reg.entries[0].engine_id == "C"


def test_different_dp_ranks_never_interfere() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    full_engine(reg, "B", 1, 6000)
    assert query_ids(reg) == {0: "A", 1: "B"}


# ---- evidence from membership -----------------------------------------------------------


def test_a_dead_rank_is_hidden_replaceable_without_a_probe_and_shown_again_on_revival() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    assert reg.rank_died(0)
    assert query_ids(reg) == {}
    assert reg.rank_revived(0)
    assert query_ids(reg) == {0: "A"}
    reg.rank_died(0)
    decision = reg.register(worker("B", 0, 0, 6000), 1.0)
    assert isinstance(decision, Registered) and decision.replaced is not None
    assert "die" in decision.replaced.evidence


def test_a_superseded_rank_is_replaced_without_a_probe() -> None:
    reg = registry()
    full_engine(reg, "A", 0, 5000)
    assert reg.rank_superseded(0, "a new incarnation said HELLO")
    assert query_ids(reg) == {}
    decision = reg.register(worker("B", 0, 0, 6000), 1.0)
    assert isinstance(decision, Registered) and decision.replaced is not None
    assert decision.replaced.evidence == "a new incarnation said HELLO"


def core_with_registry() -> Driver:
    return Driver.start(engines=2, lease_ttl_s=3.0, persist=True,
                        kv_bootstrap=BootstrapSettings(1, 1))


def test_the_core_fans_a_new_incarnation_out_to_the_registry() -> None:
    driver = core_with_registry()
    driver.join(0)
    core = driver.core
    _, actions = core.bootstrap_register(worker("A", 0), driver.now)
    driver.execute(actions)
    assert core.bootstrap is not None and query_ids(core.bootstrap.registry) == {0: "A"}
    # The engine restarts (its old connection gone): its new incarnation says HELLO
    # before its workers register.
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.hello(0)
    assert query_ids(core.bootstrap.registry) == {}
    decision, actions = core.bootstrap_register(worker("B", 0, port=6000), driver.now)
    driver.execute(actions)
    assert isinstance(decision, Registered) and decision.replaced is not None
    assert query_ids(core.bootstrap.registry) == {0: "B"}
    assert core.counter_values()["kv_bootstrap.replacements"] == 1
    assert "engine B replaces A" in driver.log_text()


def test_the_core_fans_a_death_and_a_revival_out_to_the_registry() -> None:
    driver = Driver.start(engines=2, lease_ttl_s=3.0, kv_bootstrap=BootstrapSettings(1, 1))
    for rank in range(2):
        driver.hello(rank, conn=100 + rank)
        driver.greet(rank, conn=200 + rank)
        driver.ready(rank, conn=100 + rank)
        driver.disconnected("handshake", 100 + rank)
    driver.subscribe(2)
    core = driver.core
    assert core.bootstrap is not None
    driver.execute(core.bootstrap_register(worker("A", 0), driver.now)[1])
    driver.unreachable.add(("dispatch", rank_to_identity(0)))
    driver.disconnected("dispatch", 200)
    driver.tick(1.5)
    assert query_ids(core.bootstrap.registry) == {}  # dead: hidden
    driver.unreachable.clear()
    driver.tick(4.5)  # the same incarnation answers again
    assert query_ids(core.bootstrap.registry) == {0: "A"}


def test_the_registry_is_in_the_state_file_and_restored_unverified() -> None:
    driver = core_with_registry()
    core = driver.core
    driver.execute(core.bootstrap_register(worker("A", 0), driver.now)[1])
    saved = driver.saves[-1]
    assert saved.kv_bootstrap is not None
    # Through the file's own encoding, as the server writes and reads it.
    saved = msgspec.json.decode(msgspec.json.encode(saved), type=SavedState)
    other = core_with_registry()
    other.feed(Restore(saved, "state.json"))
    assert other.core.bootstrap is not None
    registry_ = other.core.bootstrap.registry
    assert query_ids(registry_) == {0: "A"}  # shown while its probe is under way
    [probe] = registry_.unverified()
    assert registry_.unverified() == []  # asked for once
    assert [item["state"] for item in other.core.bootstrap.view()] == ["unverified"]
    other.execute(other.core.bootstrap_probe_answered(probe, False, other.now))
    assert query_ids(registry_) == {}
    assert other.saves[-1].kv_bootstrap == []


def test_a_restored_entry_whose_side_channel_answers_is_live_again() -> None:
    driver = core_with_registry()
    driver.execute(driver.core.bootstrap_register(worker("A", 0), driver.now)[1])
    other = core_with_registry()
    other.feed(Restore(driver.saves[-1], "state.json"))
    assert other.core.bootstrap is not None
    [probe] = other.core.bootstrap.unverified()
    other.execute(other.core.bootstrap_probe_answered(probe, True, other.now))
    assert [item["state"] for item in other.core.bootstrap.view()] == ["live"]
    assert query_ids(other.core.bootstrap.registry) == {0: "A"}


def test_a_state_file_without_the_registry_still_loads() -> None:
    text = (b'{"version":1,"wave":0,"gate_open":false,"inits_sent":false,"leases":[],'
            b'"frontends":[],"addresses":{}}')
    state = msgspec.json.decode(text, type=SavedState)
    assert state.kv_bootstrap is None
    assert b"kv_bootstrap" not in msgspec.json.encode(state)


# ---- the payload's bounds ---------------------------------------------------------------


@pytest.mark.parametrize(("body", "says"), [
    (b"{garbage", "not JSON"),
    (b"[]", "RegisterWorkerPayload"),
    (b'{"engine_id": "A", "dp_rank": "0", "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}',
     "dp_rank"),
    (b'{"engine_id": "A", "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}', "dp_rank"),
    (b'{"engine_id": "", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}',
     "engine_id"),
    (b'{"engine_id": "' + b"x" * (MAX_ENGINE_ID_CHARS + 1)
     + b'", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}', "engine_id"),
    (b'{"engine_id": "A", "dp_rank": 2, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}',
     "not a rank of this coordinator's group"),
    (b'{"engine_id": "A", "dp_rank": 0, "tp_rank": 2, "pp_rank": 0, "addr": "tcp://h:1"}',
     "--kv-bootstrap-tp-size"),
    (b'{"engine_id": "A", "dp_rank": 0, "tp_rank": 0, "pp_rank": 1, "addr": "tcp://h:1"}',
     "--kv-bootstrap-pp-size"),
    (b'{"engine_id": "A", "dp_rank": 0, "tp_rank": -1, "pp_rank": 0, "addr": "tcp://h:1"}',
     "tp_rank=-1"),
    (b'{"engine_id": "A", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "http://h:1"}',
     "addr"),
    (b'{"engine_id": "A", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:99999"}',
     "addr"),
    (b'{"engine_id": "A", "dp_rank": 99999999999999999999999, "tp_rank": 0, "pp_rank": 0, '
     b'"addr": "tcp://h:1"}', "dp_rank"),
])
def test_a_bad_payload_is_refused_with_what_is_wrong(body: bytes, says: str) -> None:
    with pytest.raises(PayloadError, match=None) as info:
        decode_payload(body, BOUNDS)
    assert says in str(info.value)


def test_vllms_payload_is_read_and_unknown_fields_ignored() -> None:
    body = (b'{"engine_id": "7c1f", "dp_rank": 1, "tp_rank": 1, "pp_rank": 0, '
            b'"addr": "tcp://[::1]:5555", "extra": true}')
    assert decode_payload(body, BOUNDS) == RegisterWorkerPayload("7c1f", 1, 1, 0,
                                                                 "tcp://[::1]:5555")


# ---- a stateful check of the invariants -------------------------------------------------


class RegistryMachine(RuleBasedStateMachine):
    """Random registrations, probes and membership evidence: whatever happens, at most one
    engine per DP rank, never more workers than the group has slots, a query shows only
    complete entries with no evidence against them, and a conflict changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.reg = registry(PayloadBounds(range(0, 2), tp_size=2, pp_size=2))

    @rule(engine=st.sampled_from("ABC"), dp=st.integers(0, 1), tp=st.integers(0, 1),
          pp=st.integers(0, 1), port=st.integers(5000, 5003), alive=st.booleans())
    def register(self, engine: str, dp: int, tp: int, pp: int, port: int,
                 alive: bool) -> None:
        payload = worker(engine, dp, tp, port, pp)
        decision = self.reg.register(payload, 0.0)
        if isinstance(decision, ProbeNeeded):
            self.reg.probe_answered(decision, alive)
            before = self.reg.saved()
            decision = self.reg.register(payload, 0.0, probed=True)
            if isinstance(decision, Conflict):
                assert self.reg.saved() == before
        if isinstance(decision, Registered):
            assert self.reg.entries[dp].engine_id == engine
            assert self.reg.entries[dp].workers[tp][pp] == payload.addr

    @rule(dp=st.integers(0, 1), kind=st.sampled_from(["died", "revived", "superseded"]))
    def membership(self, dp: int, kind: str) -> None:
        if kind == "died":
            self.reg.rank_died(dp)
        elif kind == "revived":
            self.reg.rank_revived(dp)
        else:
            self.reg.rank_superseded(dp, "new incarnation")

    @invariant()
    def bounded_and_current(self) -> None:
        reg = self.reg
        assert sum(entry.worker_count() for entry in reg.entries.values()) <= 8
        for entry in reg.query().values():
            assert entry.evidence() is None and entry.worker_count() == 4


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=60, stateful_step_count=30,
                                        deadline=None)


# ---- the flags ----------------------------------------------------------------------------


@pytest.mark.parametrize(("settings_", "says"), [
    ({"kv_bootstrap_port": 70000}, "--kv-bootstrap-port"),
    ({"kv_bootstrap_port": 0, "kv_bootstrap_tp_size": 0}, "--kv-bootstrap-tp-size"),
    ({"kv_bootstrap_port": 0, "kv_bootstrap_pp_size": 5000}, "--kv-bootstrap-pp-size"),
    ({"kv_bootstrap_port": 0, "kv_bootstrap_probe_timeout_s": 0.0},
     "--kv-bootstrap-probe-timeout-s"),
    ({"kv_bootstrap_host": "127.0.0.1"}, "needs --kv-bootstrap-port"),
])
def test_bad_registry_flags_are_refused_with_the_flag_named(settings_: dict[str, object],
                                                            says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ServerConfig(engines=2, **settings_).validate()  # type: ignore[arg-type]


def test_the_registry_is_off_by_default_and_listens_where_the_coordinator_does() -> None:
    assert ServerConfig(engines=2).core_config().kv_bootstrap is None
    on = ServerConfig(engines=2, kv_bootstrap_port=0, kv_bootstrap_tp_size=4)
    assert on.core_config().kv_bootstrap == BootstrapSettings(4, 1)
    assert on.bootstrap_host() == "127.0.0.1"  # ipc sockets: loopback
    assert ServerConfig(engines=2, host="127.0.0.2", kv_bootstrap_port=0).bootstrap_host() \
        == "127.0.0.2"
    assert ServerConfig(engines=2, host="127.0.0.2", kv_bootstrap_port=0,
                        kv_bootstrap_host="::1").bootstrap_host() == "::1"
