"""The simulated engine's block pool: prefix hits by content, LRU eviction, and its KV events.

The events are checked against the coordinator's own `PrefixIndex`: whatever
the pool publishes, the index must come to believe exactly what the pool holds.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.kv.prefix_index import PrefixIndex, prompt_extras
from coordinator.protocol.engine_request import MultiModalPlaceholder, PlaceholderRange
from coordinator.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_kv_batch,
    encode_kv_batch,
)
from coordinator.sim.prefix_cache import BlockPool, CacheRequest, MultiModalSpan

BS = 4


def run(pool: BlockPool, request: CacheRequest, decode_tokens: int = 1) -> int:
    """Admit, compute the whole prompt plus `decode_tokens - 1` tokens, commit; the hits."""
    hits = pool.lookup(request)
    total = pool.blocks_for(len(request.tokens) + decode_tokens - 1)
    assert pool.admit(request, hits, total)
    computed = len(request.tokens) + decode_tokens - 1
    request.tokens.extend(range(900, 900 + decode_tokens - 1))
    pool.allocate(request, computed)
    pool.commit(request, computed)
    return hits


def fresh(pool: BlockPool, tokens: list[int], **extras: object) -> CacheRequest:
    return CacheRequest(f"r{len(tokens)}-{id(tokens)}", list(tokens), **extras)  # type: ignore[arg-type]


def test_a_prompt_hits_the_blocks_an_earlier_one_computed_but_never_its_last_token() -> None:
    pool = BlockPool(16, BS, record_events=True)
    first = fresh(pool, list(range(12)))
    assert run(pool, first) == 0
    pool.free(first)
    # Same 12 tokens: only 2 blocks can hit, the last token is always computed.
    assert pool.lookup(fresh(pool, list(range(12)))) == 2
    assert pool.lookup(fresh(pool, list(range(13)))) == 3
    assert pool.lookup(fresh(pool, [*range(8), 99, 99, 99, 99, 5])) == 2
    assert pool.lookup(fresh(pool, [1, *range(12)])) == 0
    pool.check()


def test_lora_salt_and_multimodal_items_are_part_of_a_blocks_identity() -> None:
    pool = BlockPool(32, BS)
    tokens = list(range(13))
    base = fresh(pool, tokens, lora_name="sql", lora_path="/a", lora_id=3, cache_salt="s1",
                 mm=(MultiModalSpan("img", 5, 2),))
    run(pool, base)
    pool.free(base)
    same = dict(lora_name="sql", lora_path="/a", lora_id=3, cache_salt="s1",
                mm=(MultiModalSpan("img", 5, 2),))
    assert pool.lookup(fresh(pool, tokens, **same)) == 3
    for key, other in (("lora_name", "chat"), ("lora_path", "/b"), ("cache_salt", "s2"),
                       ("mm", (MultiModalSpan("img", 6, 2),)),
                       ("mm", (MultiModalSpan("pic", 5, 2),))):
        changed = {**same, key: other}
        hits = pool.lookup(fresh(pool, tokens, **changed))
        # An adapter or a salt changes block 0 and so, by chaining, every block; a
        # multimodal item changes the block it sits in (block 1) and those after.
        expected = 1 if key == "mm" else 0
        assert hits == expected, (key, other)
    # The adapter's id is not part of the hash, as in vLLM (only name and path).
    assert pool.lookup(fresh(pool, tokens, **{**same, "lora_id": 9})) == 3


def test_eviction_is_lru_and_a_prompts_tail_goes_before_its_head() -> None:
    pool = BlockPool(6, BS, record_events=True)
    a = fresh(pool, list(range(12)))  # 3 blocks
    run(pool, a)
    pool.free(a)
    b = fresh(pool, list(range(100, 112)))  # 3 more: the pool is full of cached blocks
    run(pool, b)
    pool.free(b)
    pool.take_events()
    assert pool.num_free == 6 and pool.num_cached == 6
    # a's first two blocks are hit again (and so taken out of the free queue); a
    # 3-block newcomer then evicts, oldest first: a's tail, then b's tail, then
    # b's middle block. b's head survives.
    hits = pool.lookup(a2 := fresh(pool, list(range(9))))
    assert hits == 2 and pool.admit(a2, hits, 2)
    newcomer = fresh(pool, list(range(200, 211)))
    assert pool.admit(newcomer, 0, 3)
    pool.allocate(newcomer, 11)
    events = pool.take_events()
    assert events == [BlockRemoved([h], "GPU", group_idx=0)
                      for h in (a.hashes[2], b.hashes[2], b.hashes[1])]
    assert pool.lookup(fresh(pool, list(range(100, 113)))) == 1
    assert pool.lookup(fresh(pool, list(range(13)))) == 2
    assert pool.evictions == 3
    pool.check()


def test_admission_counts_what_running_requests_reserved() -> None:
    pool = BlockPool(5, BS)
    a = fresh(pool, list(range(8)))
    assert pool.admit(a, 0, 3)
    assert pool.reserved == 3 and pool.num_free == 5
    b = fresh(pool, list(range(50, 58)))
    assert not pool.admit(b, 0, 3)  # 5 free, 3 promised to a
    assert b.block_table == [] and pool.reserved == 3
    assert pool.admit(b, 0, 2)
    pool.allocate(a, 8)
    assert pool.reserved == 3 and pool.num_free == 3
    with pytest.raises(ValueError, match="reserved"):
        pool.allocate(a, 13)  # a 4th block was never reserved
    pool.free(a)
    assert pool.reserved == 2 and pool.num_free == 5
    pool.check()
    with pytest.raises(ValueError, match="already admitted"):
        pool.admit(b, 0, 1)
    with pytest.raises(ValueError, match="lookup"):
        pool.admit(fresh(pool, list(range(30))), 2, 3)


def test_reset_waits_until_no_block_is_in_use_then_clears_everything() -> None:
    pool = BlockPool(8, BS, record_events=True)
    a = fresh(pool, list(range(9)))
    run(pool, a)
    assert not pool.reset()
    assert pool.num_cached == 2
    pool.free(a)
    pool.take_events()
    assert pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached == 0 and pool.lookup(fresh(pool, list(range(9)))) == 0
    pool.check()


def test_usage_counts_referenced_blocks_only() -> None:
    pool = BlockPool(4, BS)
    a = fresh(pool, list(range(8)))
    run(pool, a)
    assert pool.usage == 0.5
    pool.free(a)
    assert pool.usage == 0.0 and pool.num_cached == 2


def test_without_caching_nothing_hits_and_nothing_is_published() -> None:
    pool = BlockPool(8, BS, enable_caching=False, record_events=True)
    a = fresh(pool, list(range(9)))
    run(pool, a)
    pool.free(a)
    assert pool.lookup(fresh(pool, list(range(9)))) == 0
    assert pool.take_events() == [] and pool.num_cached == 0


def test_stored_events_carry_what_vllm_fills_in() -> None:
    pool = BlockPool(16, BS, record_events=True)
    request = fresh(pool, list(range(10)), lora_name="sql", lora_path="/l", lora_id=7,
                    cache_salt="salt", session_id="chat-1",
                    mm=(MultiModalSpan("img-1", 3, 3),))
    run(pool, request, decode_tokens=3)  # 12 tokens computed: 3 full blocks
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == request.hashes[:3]
    assert stored.parent_block_hash is None
    assert stored.token_ids == [*range(10), 900, 901]
    assert (stored.block_size, stored.lora_id, stored.lora_name, stored.medium) == (
        BS, 7, "sql", "GPU")
    assert stored.group_idx == 0 and stored.session_id == "chat-1"
    # One entry per block: the adapter's name, the items overlapping it, the salt on block 0.
    assert stored.extra_keys == [["sql", ["img-1", 3], "salt"], ["sql", ["img-1", -1]], ["sql"]]
    # A later commit names the block before its first as parent.
    request.tokens.extend([902, 903, 904])
    pool.free(request)
    again = fresh(pool, [*request.tokens, 905], lora_name="sql", lora_path="/l", lora_id=7,
                  cache_salt="salt", session_id="chat-1", mm=(MultiModalSpan("img-1", 3, 3),))
    assert run(pool, again) == 3
    (later,) = pool.take_events()
    assert isinstance(later, BlockStored) and later.parent_block_hash == request.hashes[2]
    # The batch encodes as vLLM's and decodes back.
    batch = KVEventBatch(ts=1.0, events=[stored, later], data_parallel_rank=0)
    assert decode_kv_batch(encode_kv_batch(batch)).batch == batch


def test_the_coordinators_index_matches_the_pool_for_prompts_with_extras() -> None:
    pool = BlockPool(64, BS, record_events=True)
    index = PrefixIndex(BS)
    mm = [MultiModalPlaceholder("img", PlaceholderRange(6, 5))]
    spans = (MultiModalSpan("img", 6, 5),)
    prompts = [list(range(23)), [*range(14), 70, 71, 72, 73, 74, 75], list(range(40, 57))]
    for tokens in prompts:
        request = fresh(pool, tokens, lora_name="a", lora_path="/a", lora_id=1,
                        cache_salt="x", mm=spans)
        run(pool, request, decode_tokens=2)
        pool.free(request)
    for event in pool.take_events():
        index.apply(0, event)
    assert index.blocks(0) == pool.num_cached
    for tokens in [*prompts, list(range(30)), [*range(14), 70, 71, 72, 73]]:
        extras = prompt_extras((len(tokens) - 1) // BS, BS, lora_name="a", mm_features=mm,
                               cache_salt="x")
        expected = pool.lookup(fresh(pool, tokens, lora_name="a", lora_path="/a",
                                     lora_id=1, cache_salt="x", mm=spans))
        assert index.cached_blocks(index.prompt(tokens, extras), [0]) == [expected]


class PoolMachine(RuleBasedStateMachine):
    """Random admissions, progress, frees, resets; the index follows the events."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, BS, record_events=True)
        self.index = PrefixIndex(BS)
        self.running: list[tuple[CacheRequest, int, int]] = []  # request, computed, target
        self.count = 0
        self.ever_duplicated = False

    def _publish(self) -> None:
        events = self.pool.take_events()
        if events:
            payload = encode_kv_batch(KVEventBatch(ts=0.0, events=events, data_parallel_rank=0))
            for event in decode_kv_batch(payload).batch.events:
                self.index.apply(0, event)

    @rule(prefix=st.integers(0, 3), extra=st.lists(st.integers(0, 3), max_size=9),
          decode=st.integers(1, 6), salt=st.sampled_from([None, "s"]))
    def admit(self, prefix: int, extra: list[int], decode: int, salt: str | None) -> None:
        # Prompts share 0-3 blocks of a common head, then go their own way.
        tokens = [*range(prefix * BS), *extra, 77]
        self.count += 1
        request = CacheRequest(f"r{self.count}", tokens, cache_salt=salt)
        hits = self.pool.lookup(request)
        target = len(tokens) + decode - 1
        if self.pool.admit(request, hits, self.pool.blocks_for(target)):
            self.running.append((request, hits * BS, target))

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100), tokens=st.integers(1, 8))
    def progress(self, which: int, tokens: int) -> None:
        position = which % len(self.running)
        request, computed, target = self.running[position]
        computed = min(target, computed + tokens)
        while len(request.tokens) < computed:
            request.tokens.append(500 + len(request.tokens))
        self.pool.allocate(request, computed)
        self.pool.commit(request, computed)
        self.running[position] = (request, computed, target)
        self._publish()

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish(self, which: int) -> None:
        request, _, _ = self.running.pop(which % len(self.running))
        self.pool.free(request)
        self._publish()

    @rule()
    def reset(self) -> None:
        done = self.pool.reset()
        assert done == (not self.running or all(not r.block_table for r, _, _ in self.running))
        self._publish()

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check()

    @invariant()
    def index_holds_what_the_pool_holds(self) -> None:
        # Exactly, until two requests compute the same block at once: vLLM keeps
        # both copies under one hash, and the first copy's BlockRemoved makes a
        # consumer forget the hash while the second copy lives on.
        cached = self.pool.cached_hashes()
        self.ever_duplicated |= self.pool.num_cached != len(cached)
        assert self.index.blocks(0) <= len(cached)
        if not self.ever_duplicated:
            assert self.index.blocks(0) == len(cached)


PoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPoolMachine = PoolMachine.TestCase


def test_event_batches_round_trip_through_msgpack() -> None:
    pool = BlockPool(4, BS, record_events=True)
    run(pool, fresh(pool, list(range(9))))
    raw = msgspec.msgpack.decode(encode_kv_batch(KVEventBatch(1.0, pool.take_events(), 0)))
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["group_idx"] == 0
    assert raw[1][0]["extra_keys"] == [None, None]


def test_block_hashes_are_seeded_per_process_unless_pythonhashseed_is_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.sim.prefix_cache import process_root_hash

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert process_root_hash() != process_root_hash()
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert process_root_hash() == process_root_hash()
    seeded = [BlockPool(4, BS, root_hash=process_root_hash()) for _ in range(2)]
    requests = [fresh(pool, list(range(9))) for pool in seeded]
    assert [pool.lookup(r) for pool, r in zip(seeded, requests, strict=True)] == [0, 0]
    assert requests[0].hashes == requests[1].hashes


def test_bad_sizes_and_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    pool = BlockPool(4, BS)
    with pytest.raises(ValueError, match="hit_blocks"):
        pool.admit(fresh(pool, [1, 2]), 2, 1)
