"""The KV event plane and the prefix policy in the composed core, event by event."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from coordinator.core.actions import KVRequestReplay, KVSubscribe, KVUnsubscribe
from coordinator.core.events import (
    KV_DRAIN,
    TICK,
    EngineGreeted,
    KVBadMessage,
    KVBatchReceived,
    KVPublisherConnected,
    KVPublisherDisconnected,
    KVReplayEnded,
    KVReplayUnsent,
    KVSubscribeFailed,
)
from coordinator.core.kv.plane import KVSettings
from coordinator.core.ranks.membership import RankState
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GreetingKV,
    KVEventBatch,
    PublisherSettings,
)
from tests.unit.core_driver import Driver, frontend_identity
from tests.unit.test_engine_request import add_fields

BLOCK = 4
F0 = frontend_identity(0)
PROMPT = list(range(100, 116))  # four blocks of four


def add_payload(request_id: str, tokens: list[int], **fields: Any) -> bytes:
    return msgspec.msgpack.encode(add_fields(request_id=request_id, prompt_token_ids=tokens,
                                             **fields))


def stored(tokens: list[int], *, first_hash: int = 1, parent: int | None = None,
           **fields: Any) -> BlockStored:
    count = len(tokens) // BLOCK
    return BlockStored(block_hashes=[first_hash + i for i in range(count)],
                       parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=None, **fields)


def batch(*events: Any) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


def start(*, engines: int = 2, endpoint: str | None = "tcp://*:5557",
          replay: str | None = "tcp://*:5657", policy: str = "prefix",
          block_size: int | None = BLOCK, **config: Any) -> Driver:
    kv = KVSettings(endpoint=endpoint, replay_endpoint=replay, block_size=block_size)
    driver = Driver.start(engines=engines, policy=policy, kv=kv, **config)
    driver.register(0)
    driver.start_group(range(engines))
    return driver


def publish(driver: Driver, rank: int, seq: int, *events: Any, replayed: bool = False) -> None:
    driver.feed(KVBatchReceived(rank, seq, batch(*events), replayed=replayed))
    driver.feed(KV_DRAIN)


def submit(driver: Driver, request_id: str, tokens: list[int], **fields: Any) -> fp.FrontendReply:
    replies = driver.request(F0, fp.Submit(driver.call_id(), request_id, 0),
                             [add_payload(request_id, tokens, **fields)])
    (reply,) = [r for r in replies if isinstance(r, (fp.Submitted, fp.ErrorReply))]
    return reply


def cached(driver: Driver, rank: int) -> int:
    kv = driver.core.kv.plane
    assert kv is not None and kv.index is not None
    return kv.index.blocks(rank)


# ---- following the publishers ---------------------------------------------------------------


def test_every_rank_is_followed_at_its_offset_endpoint_from_the_start() -> None:
    driver = start(engines=3)
    assert driver.kv_actions == [
        KVSubscribe(0, "tcp://127.0.0.1:5557", False, "tcp://127.0.0.1:5657"),
        KVSubscribe(1, "tcp://127.0.0.1:5558", False, "tcp://127.0.0.1:5658"),
        KVSubscribe(2, "tcp://127.0.0.1:5559", False, "tcp://127.0.0.1:5659"),
    ]


def test_where_the_publisher_connects_the_coordinator_binds() -> None:
    driver = start(endpoint="tcp://10.0.0.1:5557", replay=None)
    assert driver.kv_actions == [KVSubscribe(0, "tcp://10.0.0.1:5557", True, None),
                                 KVSubscribe(1, "tcp://10.0.0.1:5558", True, None)]


def test_a_greeting_moves_the_subscription_to_the_engines_host_and_its_real_endpoints() -> None:
    driver = start()
    driver.kv_actions.clear()
    settings = PublisherSettings(True, "zmq", "tcp://*:6001", "tcp://*:6101")
    driver.feed(EngineGreeted(1, kv=GreetingKV(BLOCK, settings, 1), host="10.1.2.3"))
    assert driver.kv_actions == [KVSubscribe(1, "tcp://10.1.2.3:6001", False,
                                             "tcp://10.1.2.3:6101")]
    # The same greeting again changes nothing; the host alone moves a configured one.
    driver.feed(EngineGreeted(1, kv=GreetingKV(BLOCK, settings, 1), host="10.1.2.3"))
    driver.feed(EngineGreeted(0, host="10.9.9.9"))
    assert driver.kv_actions[1:] == [KVSubscribe(0, "tcp://10.9.9.9:5557", False,
                                                 "tcp://10.9.9.9:5657")]


def test_a_greeting_teaches_the_block_size_and_an_unreachable_publisher_is_reported() -> None:
    driver = start(endpoint=None, replay=None, block_size=None)
    assert driver.kv_actions == [] and driver.core.kv.plane is not None
    assert driver.core.kv.plane.index is None
    inproc = PublisherSettings(True, "zmq", "inproc://kv", None)
    driver.feed(EngineGreeted(0, kv=GreetingKV(32, inproc, 0)))
    assert driver.core.kv.plane.index is not None and driver.core.kv.plane.index.block_size == 32
    assert driver.kv_actions == []
    assert driver.core.counter_values()["kv.unreachable_publishers"] == 1
    assert "inproc" in driver.log_text()


def test_an_unreadable_greeting_is_counted_and_the_configured_publisher_kept() -> None:
    driver = start()
    driver.kv_actions.clear()
    driver.feed(EngineGreeted(0, kv_unreadable=True))
    assert driver.core.counter_values()["kv.unreadable_greetings"] == 1
    assert driver.kv_actions == []


def test_without_a_block_size_the_first_stored_block_sets_it() -> None:
    driver = start(block_size=None)
    publish(driver, 0, 0, stored(PROMPT))
    assert cached(driver, 0) == 4


def test_an_endpoint_vllm_cannot_offset_is_followed_for_rank_0_only() -> None:
    driver = start(endpoint="ipc:///tmp/kv", replay=None)
    assert driver.kv_actions == [KVSubscribe(0, "ipc:///tmp/kv", False, None)]
    assert "cannot follow dp_rank=1's KV events" in driver.log_text()
    driver.kv_actions.clear()
    driver.feed(vllm.ScaleElasticEP(3))
    assert driver.kv_actions == []


def test_the_least_loaded_policy_follows_no_publisher_unless_told() -> None:
    driver = Driver.start(engines=2, policy="least-loaded")
    driver.start_group([0, 1])
    assert driver.core.kv.plane is None and driver.kv_actions == []


# ---- routing by cache ---------------------------------------------------------------------------


def test_the_rank_holding_the_prefix_gets_the_request() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    reply = submit(driver, "r1", [*PROMPT, 7])
    assert isinstance(reply, fp.Submitted) and reply.rank == 1
    counters = driver.core.counter_values()
    assert counters["route.decisions.prefix"] == 1
    assert counters["route.cached_tokens"] == 16 and counters["route.prompt_tokens"] == 17


def test_the_busiest_rank_is_not_chosen_however_much_it_caches() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    driver.report(1, wave=0, step=1, waiting=10, running=4)
    driver.report(0, wave=0, step=1, running=1)
    for index in range(3):
        reply = submit(driver, f"r{index}", [*PROMPT, index])
        assert isinstance(reply, fp.Submitted) and reply.rank == 0


def test_a_session_stays_on_its_rank_and_new_sessions_spread() -> None:
    driver = start(engines=3)
    ranks = [getattr(submit(driver, f"s{i}", [i], session_id=f"chat-{i}"), "rank", None)
             for i in range(3)]
    assert sorted(ranks) == [0, 1, 2]
    for turn in range(3):
        driver.report(0, wave=0, step=turn + 2)
        driver.report(1, wave=0, step=turn + 2)
        driver.report(2, wave=0, step=turn + 2)
        reply = submit(driver, f"s1-{turn}", [1, turn], session_id="chat-1")
        assert isinstance(reply, fp.Submitted) and reply.rank == ranks[1]


def test_prompt_keys_route_payloads_that_are_not_vllms() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    keys = fp.PromptKeys([*PROMPT, 1])
    (reply,) = driver.request(F0, fp.Submit(driver.call_id(), "k1", 0, prompt=keys),
                              [b"sim-payload"])
    assert isinstance(reply, fp.Submitted) and reply.rank == 1
    assert "route.unreadable_payloads" not in driver.core.counter_values()


def test_prompts_with_embeddings_or_without_tokens_are_routed_by_load() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    driver.report(1, wave=0, step=1, running=1)
    embeds = submit(driver, "e", [*PROMPT, 1], prompt_embeds=["float16", [1, 2], 1])
    no_tokens = submit(driver, "n", None)  # type: ignore[arg-type]
    assert isinstance(embeds, fp.Submitted) and embeds.rank == 0
    assert isinstance(no_tokens, fp.Submitted)
    counters = driver.core.counter_values()
    assert "route.cached_tokens" not in counters and counters["route.unmatched"] == 1


def test_multimodal_items_in_prompt_keys_must_match() -> None:
    driver = start()
    image = [["img-1", 1]]
    publish(driver, 1, 0, stored(PROMPT, extra_keys=[image, None, None, None]))
    item = fp.MultiModalItem("img-1", 1, 2)
    for index, (items, rank) in enumerate([(None, 0), ([item], 1)]):
        driver.report(0, wave=0, step=index + 1)
        driver.report(1, wave=0, step=index + 1)
        keys = fp.PromptKeys([*PROMPT, 1], mm_items=items)
        (reply,) = driver.request(F0, fp.Submit(driver.call_id(), f"m{index}", 0, prompt=keys),
                                  [b"p"])
        assert isinstance(reply, fp.Submitted) and reply.rank == rank, items


def test_an_unreadable_payload_is_routed_by_load_alone_and_counted() -> None:
    driver = start()
    driver.report(0, wave=0, step=1, running=3)
    (reply,) = driver.request(F0, fp.Submit(driver.call_id(), "x", 0), [b"\xc1"])
    assert isinstance(reply, fp.Submitted) and reply.rank == 1
    counters = driver.core.counter_values()
    assert counters["route.unreadable_payloads"] == 1 and counters["route.unmatched"] == 1


def test_lora_and_salt_must_match_for_a_hit() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT, extra_keys=[["salt-a"], None, None, None]))
    plain = submit(driver, "p", [*PROMPT, 1])
    salted = submit(driver, "s", [*PROMPT, 1], cache_salt="salt-a")
    assert isinstance(plain, fp.Submitted) and isinstance(salted, fp.Submitted)
    assert salted.rank == 1
    assert driver.core.counter_values()["route.cached_tokens"] == 16  # only the salted one


def test_a_failed_dispatch_takes_its_cost_back_and_tries_the_next_rank() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    driver.unreachable.add(("dispatch", (1).to_bytes(2, "little")))
    reply = submit(driver, "r", [*PROMPT, 1])
    assert isinstance(reply, fp.Submitted) and reply.rank == 0
    router = driver.core.dispatch.choice.router
    assert router is not None and router.token_load.pending(1) == 0
    assert router.token_load.pending(0) > 0


def test_an_explicit_rank_counts_an_estimate_of_its_work() -> None:
    driver = start()
    (reply,) = driver.request(F0, fp.Submit(driver.call_id(), "e", 0, 1),
                              [add_payload("e", PROMPT, session_id="chat")])
    assert isinstance(reply, fp.Submitted) and reply.rank == 1
    assert driver.core.dispatch.choice.router is not None
    assert driver.core.dispatch.choice.router.sessions.rank_for("chat") == 1
    router = driver.core.dispatch.choice.router
    assert router is not None and router.token_load.pending(1) > 0
    driver.report(1, wave=0, step=1)
    assert router.token_load.pending(1) == 0


# ---- the stream: order, gaps, replays, losses ------------------------------------------------


def test_a_gap_is_filled_by_a_replay_and_the_index_ends_up_whole() -> None:
    driver = start()
    publish(driver, 0, 0, stored(PROMPT[:8], first_hash=1))
    driver.kv_actions.clear()
    publish(driver, 0, 2, stored(PROMPT[12:], first_hash=4, parent=3))
    assert driver.kv_actions == [KVRequestReplay(0, 1)]
    assert cached(driver, 0) == 2
    publish(driver, 0, 1, stored(PROMPT[8:12], first_hash=3, parent=2), replayed=True)
    driver.feed(KVReplayEnded(0))
    driver.feed(KV_DRAIN)
    assert cached(driver, 0) == 4
    assert driver.core.counter_values()["kv.replays_filled"] == 1


def test_a_new_connection_asks_for_what_went_by() -> None:
    driver = start()
    driver.kv_actions.clear()
    driver.feed(KVPublisherConnected(0))
    driver.feed(KVPublisherConnected(9))  # not followed: nothing
    assert driver.kv_actions == [KVRequestReplay(0, 0)]
    publish(driver, 0, 0, stored(PROMPT), replayed=True)
    driver.feed(KVReplayEnded(0))
    driver.feed(KV_DRAIN)
    assert cached(driver, 0) == 4
    assert driver.core.counter_values()["kv.connections"] == 1


def test_a_publisher_whose_connection_ends_starts_again_from_scratch() -> None:
    driver = start()
    publish(driver, 0, 0, stored(PROMPT))
    publish(driver, 0, 1, stored([3] * BLOCK, first_hash=50))
    driver.feed(KVPublisherDisconnected(0))
    driver.feed(KVPublisherDisconnected(9))  # not followed: nothing
    assert cached(driver, 0) == 0
    assert driver.core.counter_values()["kv.resets.publisher_disconnected"] == 1
    # A new process numbers from 0 again, and may have lost its first batches to the
    # new subscription: whatever comes first starts the stream afresh.
    driver.kv_actions.clear()
    publish(driver, 0, 2, stored(PROMPT, first_hash=70))
    assert driver.kv_actions == [KVRequestReplay(0, 0)]


def test_a_replay_that_never_ends_is_given_up_at_the_timer() -> None:
    driver = start()
    publish(driver, 0, 0, stored(PROMPT[:8]))
    publish(driver, 0, 5, stored([1, 2, 3, 4], first_hash=50))
    plane = driver.core.kv.plane
    assert plane is not None and plane.streams.next_deadline() == pytest.approx(1.0)
    assert driver.core.next_deadline() <= 1.0
    driver.tick(0.9)
    assert "kv.replays_timed_out" not in driver.core.counter_values()
    driver.tick(1.0)
    driver.feed(KV_DRAIN)
    counters = driver.core.counter_values()
    assert counters["kv.replays_timed_out"] == 1 and counters["kv.resets.replay_timeout"] == 1
    assert cached(driver, 0) == 1  # only the held batch, on an emptied index


def test_a_replay_request_that_could_not_be_sent_is_given_up_without_waiting() -> None:
    driver = start()
    publish(driver, 0, 0, stored(PROMPT[:8]))
    publish(driver, 0, 5, stored([1, 2, 3, 4], first_hash=50))  # a gap: a replay goes out
    assert driver.kv_actions[-1] == KVRequestReplay(0, 1)
    driver.feed(KVReplayUnsent(0, "Connection refused"))
    driver.feed(KV_DRAIN)
    plane = driver.core.kv.plane
    assert plane is not None and plane.streams.next_deadline() is None
    counters = driver.core.counter_values()
    assert counters["kv.replay_request_failed"] == 1 and counters["kv.replays_unsent"] == 1
    assert counters["kv.resets.replay_unavailable"] == 1
    assert "kv.replays_timed_out" not in counters
    assert cached(driver, 0) == 1  # only the held batch, on an emptied index
    assert "cannot ask for a KV event replay: Connection refused" in driver.log_text()


def test_a_subscription_that_could_not_be_made_is_not_believed() -> None:
    driver = start()
    driver.feed(KVSubscribeFailed(1, "tcp://127.0.0.1:5558", "cannot connect to it: bad"))
    plane = driver.core.kv.plane
    assert plane is not None and 1 not in plane.subscriptions and 1 not in plane.streams
    assert driver.core.counter_values()["kv.subscribe_failed"] == 1
    # Batches from there are not applied; the rank's next greeting tries again.
    publish(driver, 1, 0, stored(PROMPT))
    assert cached(driver, 1) == 0
    driver.kv_actions.clear()
    driver.feed(EngineGreeted(1, host="127.0.0.1"))
    assert driver.kv_actions == [KVSubscribe(1, "tcp://127.0.0.1:5558", False,
                                             "tcp://127.0.0.1:5658")]
    publish(driver, 1, 0, stored(PROMPT))
    assert cached(driver, 1) == 4


def test_all_blocks_cleared_empties_the_rank() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    publish(driver, 1, 1, AllBlocksCleared())
    assert cached(driver, 1) == 0
    reply = submit(driver, "r", [*PROMPT, 1])
    assert isinstance(reply, fp.Submitted) and reply.rank == 0
    assert driver.core.counter_values()["kv.events.cleared"] == 1


def test_removed_blocks_stop_matching() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    publish(driver, 1, 1, BlockRemoved([1, 2, 3, 4], "GPU"))
    assert cached(driver, 1) == 0


def test_a_dead_rank_that_may_come_back_keeps_its_index_and_is_not_routed_to() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    held = cached(driver, 1)
    assert held > 0
    for rank in (0, 1):  # their connections are gone: the probes fail
        driver.unreachable.add(("dispatch", rank.to_bytes(2, "little")))
    driver.tick(5.0)
    assert driver.core.membership.state(1) is RankState.DEAD
    assert cached(driver, 1) == held
    assert "kv.resets.rank_gone" not in driver.core.counter_values()
    # Its publisher still runs and is still followed, in order.
    publish(driver, 1, 1, stored([9, 9, 9, 9], first_hash=90))
    assert cached(driver, 1) == held + 1
    reply = submit(driver, "while-dead", PROMPT)
    assert isinstance(reply, fp.ErrorReply) and reply.code == fp.ERR_NO_READY_ENGINE
    # The partition heals: the same engine, the same cache, the prefix routed to it.
    driver.unreachable.clear()
    driver.tick(20.0)
    assert driver.core.membership.state(1) is RankState.READY
    reply = submit(driver, "after", PROMPT)
    assert isinstance(reply, fp.Submitted) and reply.rank == 1


def test_a_replaced_engine_loses_its_index() -> None:
    driver = start()
    publish(driver, 0, 0, stored(PROMPT))
    # Stock engines carry no id: a restarted rank 0, its old connection gone.
    driver.unreachable.add(("dispatch", (0).to_bytes(2, "little")))
    driver.hello(0)
    assert cached(driver, 0) == 0
    assert driver.core.counter_values()["kv.resets.rank_replaced"] == 1


def test_a_publisher_restart_resets_and_starts_over() -> None:
    driver = start()
    publish(driver, 0, 0, stored(PROMPT[:8]))
    publish(driver, 0, 1, stored(PROMPT[8:], first_hash=3, parent=2))
    publish(driver, 0, 0, stored([5, 5, 5, 5], first_hash=70))
    assert cached(driver, 0) == 1
    assert driver.core.counter_values()["kv.publisher_restarts"] == 1


def test_a_bad_message_resets_the_rank_and_is_counted_by_reason() -> None:
    driver = start()
    publish(driver, 0, 0, stored(PROMPT))
    error = ProtocolError("bad KV event batch", reason="decode")
    driver.feed(KVBadMessage(0, error, seq=1))
    driver.feed(KVBadMessage(0, error))  # unreadable seq: counted, nothing else
    counters = driver.core.counter_values()
    assert counters["kv.bad_batches.decode"] == 2 and counters["kv.resets.bad_batch"] == 1
    assert cached(driver, 0) == 0
    publish(driver, 0, 2, stored(PROMPT))
    assert cached(driver, 0) == 4


def test_messages_for_ranks_not_followed_are_counted_and_ignored() -> None:
    driver = start(engines=2)
    driver.feed(KVBatchReceived(7, 0, batch(stored(PROMPT))))
    driver.feed(KVReplayEnded(7))
    driver.feed(KVBadMessage(7, ProtocolError("x", reason="decode"), 1))
    assert driver.core.counter_values()["kv.unfollowed_messages"] == 3


def test_applying_is_paid_in_bounded_slices() -> None:
    kv = KVSettings(endpoint="tcp://*:5557", block_size=BLOCK, apply_budget_blocks=3)
    driver = Driver.start(engines=1, policy="prefix", kv=kv)
    driver.feed(KVBatchReceived(0, 0, batch(stored(list(range(40))))))  # ten blocks
    plane = driver.core.kv.plane
    assert plane is not None and plane.pending_blocks == 10
    driver.feed(KV_DRAIN)
    assert cached(driver, 0) == 3 and plane.pending_blocks == 7
    driver.feed(KV_DRAIN)
    driver.feed(KV_DRAIN)
    driver.feed(KV_DRAIN)
    assert cached(driver, 0) == 10 and plane.pending_blocks == 0


def test_queued_batches_of_an_emptied_index_are_dropped() -> None:
    driver = start()
    driver.feed(KVBatchReceived(0, 0, batch(stored(PROMPT))))
    driver.unreachable.add(("dispatch", (0).to_bytes(2, "little")))
    driver.hello(0)  # a restarted rank 0, its old connection gone
    driver.feed(KV_DRAIN)
    plane = driver.core.kv.plane
    assert plane is not None and plane.pending_blocks == 0
    assert cached(driver, 0) == 0


def test_a_resize_follows_new_ranks_and_lets_go_of_removed_ones() -> None:
    driver = start(engines=2, min_engines=1, max_engines=3)
    driver.kv_actions.clear()
    driver.feed(vllm.ScaleElasticEP(3))
    driver.feed(vllm.ScaleElasticEP(1))
    assert driver.kv_actions == [
        KVSubscribe(2, "tcp://127.0.0.1:5559", False, "tcp://127.0.0.1:5659"),
        KVUnsubscribe(1), KVUnsubscribe(2),
    ]


# ---- route calls -------------------------------------------------------------------------------


def route(driver: Driver, request_id: str, ranks: list[int] | None = None,
          tokens: list[int] | None = None, session: str | None = None) -> fp.FrontendReply:
    keys = None if tokens is None else fp.PromptKeys(tokens, session_id=session)
    (reply,) = driver.request(F0, fp.Route(driver.call_id(), request_id, ranks, keys))
    return reply


def test_a_route_call_names_the_cached_rank_and_counts_it_like_a_dispatch() -> None:
    driver = start()
    publish(driver, 1, 0, stored(PROMPT))
    reply = route(driver, "q1", tokens=[*PROMPT, 3])
    assert reply == fp.Routed(reply.call_id, "q1", 1, "prefix")  # type: ignore[union-attr]
    assert driver.core.loads.load(1).dispatched_since_report == 1
    assert driver.adds(1) == []  # nothing was sent to the engine
    assert driver.core.counter_values()["route.answered"] == 1


def test_route_calls_choose_among_the_ranks_asked_for() -> None:
    driver = start(engines=3)
    publish(driver, 1, 0, stored(PROMPT))
    reply = route(driver, "q", ranks=[0, 2], tokens=[*PROMPT, 3])
    assert isinstance(reply, fp.Routed) and reply.rank in (0, 2)
    refused = route(driver, "q2", ranks=[5])
    assert isinstance(refused, fp.ErrorReply) and refused.code == fp.ERR_UNKNOWN_RANK


def test_route_calls_consider_ranks_registered_elsewhere_but_not_unavailable_ones() -> None:
    # The plugin route: engines registered with vLLM's launcher, so none here.
    driver = Driver.start(engines=2, policy="prefix",
                          kv=KVSettings(endpoint="tcp://*:5557", block_size=BLOCK))
    publish(driver, 1, 0, stored(PROMPT))
    reply = route(driver, "q", tokens=[*PROMPT, 3])
    assert isinstance(reply, fp.Routed) and reply.rank == 1
    driver.hello(1)  # handshaking here: not available
    reply = route(driver, "q2", tokens=[*PROMPT, 3])
    assert isinstance(reply, fp.Routed) and reply.rank == 0
    driver.hello(0)
    refused = route(driver, "q3")
    assert isinstance(refused, fp.ErrorReply) and refused.code == fp.ERR_NO_READY_ENGINE


def test_route_calls_with_the_plain_policy_keep_a_session_among_equals() -> None:
    driver = Driver.start(engines=3, policy="least-loaded")
    first = route(driver, "a", tokens=[1], session="chat")
    assert isinstance(first, fp.Routed) and first.reason == "load"
    for index in range(3):
        for rank in range(3):
            driver.report(rank, wave=0, step=index + 1)
        reply = route(driver, f"b{index}", tokens=[1], session="chat")
        assert isinstance(reply, fp.Routed) and reply.rank == first.rank
    for rank in range(3):
        driver.hello(rank)
    refused = route(driver, "c")
    assert isinstance(refused, fp.ErrorReply) and refused.code == fp.ERR_NO_READY_ENGINE


def test_route_calls_in_dense_mode_weigh_only_the_candidates() -> None:
    driver = start(engines=3, lockstep=False)
    driver.report(2, wave=0, step=1, waiting=50)
    reply = route(driver, "q", ranks=[0, 1], tokens=[1, 2, 3])
    assert isinstance(reply, fp.Routed) and reply.rank in (0, 1)


def test_route_calls_are_refused_while_shutting_down() -> None:
    driver = start()
    from coordinator.core.events import Shutdown

    driver.feed(Shutdown("stop"))
    reply = route(driver, "q")
    assert isinstance(reply, fp.ErrorReply) and reply.code == fp.ERR_SHUTTING_DOWN


def test_the_timer_is_due_for_replays_only_while_one_is_out() -> None:
    driver = start()
    idle = driver.core.next_deadline()
    publish(driver, 0, 3, stored(PROMPT))  # joined late: a replay goes out
    assert driver.core.next_deadline() <= min(idle, 1.0)
    driver.feed(KVReplayEnded(0))
    driver.feed(TICK)
    assert driver.core.next_deadline() == idle
