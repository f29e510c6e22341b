"""The per-rank prefix index, event by event.

Events are built as vLLM 0.33's block pool builds them: one BlockStored per
run of newly cached full blocks (tokens back to back, parent = the block
before), extra keys untagged per block, engine hashes opaque (here short
byte strings, as the index must not read anything into them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.kv.prefix_index import (
    BYTES_PER_KEY,
    BYTES_PER_RANK_BLOCK,
    BlockKeyer,
    PrefixIndex,
    PromptBlocks,
    extra_key_bytes,
    prompt_extras,
    token_bytes,
)
from coordinator.protocol.engine_request import (
    AddRequestHead,
    MultiModalPlaceholder,
    PlaceholderRange,
    decode_add_request,
)
from coordinator.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

BS = 4


def stored(
    hashes: Sequence[bytes | int],
    tokens: Sequence[int],
    parent: bytes | int | None = None,
    *,
    block_size: int = BS,
    extra_keys: list[list[Any] | None] | None = None,
    lora_name: str | None = None,
    medium: str | None = "GPU",
    group_idx: int | None = 0,
    locality: str | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None if lora_name is None else 1,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
        group_idx=group_idx,
        locality=locality,
    )


def removed(hashes: Sequence[bytes | int], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=0)


A = [1, 2, 3, 4]
B = [5, 6, 7, 8]
C = [9, 10, 11, 12]
D = [13, 14, 15, 16]


def prompt_of(*blocks: list[int], tail: int = 1) -> list[int]:
    """A prompt made of whole blocks plus `tail` more tokens (the engine computes the last)."""
    return [token for block in blocks for token in block] + list(range(100, 100 + tail))


def cached(
    index: PrefixIndex, tokens: list[int], ranks: Sequence[int], **extras: Any
) -> list[int]:
    blocks = max(0, len(tokens) - 1) // index.block_size
    return index.cached_tokens(
        index.prompt(tokens, prompt_extras(blocks, index.block_size, **extras)), ranks
    )


def apply(index: PrefixIndex, rank: int, *events: KVEvent) -> None:
    index.apply_events(rank, events)


# --- storing and matching ---------------------------------------------------------


def test_the_rank_holding_a_prefix_is_found() -> None:
    index = PrefixIndex(BS)
    apply(index, 1, stored([b"a", b"b", b"c"], A + B + C))
    assert cached(index, prompt_of(A, B, C), [0, 1, 2]) == [0, 12, 0]
    assert cached(index, prompt_of(A, B, D), [0, 1, 2]) == [0, 8, 0]
    assert cached(index, prompt_of(B, C), [1]) == [0]
    assert index.counters.stored_blocks == 3


def test_the_last_prompt_token_and_partial_blocks_never_match() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b", b"c"], A + B + C))
    # 12 tokens: the engine computes the 12th itself, so only two whole blocks can hit.
    assert cached(index, A + B + C, [0]) == [8]
    assert cached(index, A + B + C[:3], [0]) == [8]
    assert cached(index, A + B[:1], [0]) == [4]
    assert cached(index, A, [0]) == [0]
    assert cached(index, [], [0]) == [0]


def test_chains_continue_across_events_through_the_parent_hash() -> None:
    index = PrefixIndex(BS)
    apply(index, 2, stored([b"a", b"b"], A + B), stored([b"c"], C, parent=b"b"))
    assert cached(index, prompt_of(A, B, C), [2]) == [12]
    # The same tokens under another parent are another block.
    apply(index, 3, stored([b"a"], A), stored([b"x"], C, parent=b"a"))
    assert cached(index, prompt_of(A, C), [2, 3]) == [4, 8]


def test_integer_engine_hashes_link_the_same_way() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([(1 << 64) - 1, 5], A + B), stored([6], C, parent=5))
    assert cached(index, prompt_of(A, B, C), [0]) == [12]
    apply(index, 0, removed([5]))
    assert cached(index, prompt_of(A, B, C), [0]) == [4]


def test_a_block_whose_parent_is_unknown_is_skipped_and_counted() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"c", b"d"], C + D, parent=b"never-seen"))
    assert index.blocks(0) == 0
    assert index.counters.orphan_blocks == 2
    # A parent known on another rank does not count: engine hashes are per rank.
    apply(index, 1, stored([b"a"], A))
    apply(index, 0, stored([b"b"], B, parent=b"a"))
    assert index.counters.orphan_blocks == 3


def test_each_rank_is_matched_to_its_own_depth() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b"], A + B))
    apply(index, 1, stored([b"a", b"b", b"c", b"d"], A + B + C + D))
    apply(index, 2, stored([b"a", b"x"], A + D))
    apply(index, 3, stored([b"b"], B))
    tokens = prompt_of(A, B, C, D)
    assert cached(index, tokens, [0, 1, 2, 3, 4]) == [8, 16, 4, 0, 0]
    assert cached(index, tokens, [3, 1]) == [0, 16]
    assert index.distinct_blocks == 6  # A, AB, ABC, ABCD, AD and B


def test_keys_are_hashed_only_as_far_as_some_rank_matches() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b"], A + B))
    prompt = index.prompt(prompt_of(A, B, C, D, A, B))
    assert prompt.num_blocks == 6
    assert index.cached_blocks(prompt, [0]) == [2]
    assert len(prompt.keys) == 3  # A, AB, then ABC which nobody holds
    assert index.cached_blocks(prompt, [5]) == [0]
    assert len(prompt.keys) == 3  # no rank alive: nothing more to hash
    # A later query reuses the keys already computed and extends them.
    apply(index, 1, stored([b"a", b"b", b"c", b"d"], A + B + C + D))
    assert index.cached_blocks(prompt, [0, 1]) == [2, 4]
    assert len(prompt.keys) == 5
    assert prompt.keys == index.keyer.chain(A + B + C + D + A)


def test_a_later_prompt_takes_over_the_keys_of_the_blocks_it_shares() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b", b"c"], A + B + C))
    first = index.prompt(prompt_of(A, B, C))
    assert index.cached_blocks(first, [0]) == [3]
    # The next turn repeats A, B, C and adds D: only D needs hashing.
    second = index.prompt(prompt_of(A, B, C, D), reuse=first)
    assert second.keys == first.keys
    assert index.cached_blocks(second, [0]) == [3]
    assert second.keys == index.keyer.chain(A + B + C + D)
    # A prompt that parts from it after A keeps A's key only.
    third = index.prompt(prompt_of(A, D, C), reuse=second)
    assert third.keys == second.keys[:1]
    assert index.cached_blocks(third, [0]) == [1]
    # Other extras: nothing is taken over past the first block they differ in.
    salted = index.prompt(prompt_of(A, B), prompt_extras(2, BS, cache_salt="s"), reuse=second)
    assert salted.keys == []
    lora = prompt_extras(3, BS, lora_name="x")
    with_lora = index.prompt(prompt_of(A, B, C), lora)
    index.cached_blocks(with_lora, [0])
    assert index.prompt(prompt_of(A, B, C), lora, reuse=with_lora).keys == with_lora.keys
    assert index.prompt(prompt_of(A, B, C), prompt_extras(3, BS, lora_name="y"),
                        reuse=with_lora).keys == []
    assert index.prompt(prompt_of(A), reuse=with_lora).keys == []  # extras only on one side
    # A prompt keyed for another block size is not reused.
    assert PrefixIndex(2).prompt(prompt_of(A, B), reuse=first).keys == []


@settings(max_examples=200, deadline=None)
@given(stored_blocks=st.lists(st.integers(0, 3), min_size=1, max_size=8),
       earlier=st.lists(st.integers(0, 3), max_size=8),
       later=st.lists(st.integers(0, 3), max_size=8), ranks=st.integers(1, 3))
def test_taking_keys_over_changes_no_answer(stored_blocks: list[int], earlier: list[int],
                                            later: list[int], ranks: int) -> None:
    blocks = [A, B, C, D]
    index = PrefixIndex(BS)
    for rank in range(ranks):
        held = stored_blocks[: len(stored_blocks) - rank]
        tokens = [t for b in held for t in blocks[b]]
        apply(index, rank, stored([bytes([rank, i]) for i in range(len(held))], tokens))
    first = index.prompt(prompt_of(*(blocks[b] for b in earlier)))
    index.cached_blocks(first, range(ranks))
    tokens = prompt_of(*(blocks[b] for b in later))
    fresh, reused = index.prompt(tokens), index.prompt(tokens, reuse=first)
    assert index.cached_blocks(reused, range(ranks)) == index.cached_blocks(fresh, range(ranks))
    assert reused.keys == fresh.keys


# --- extra keys ------------------------------------------------------------------------


def test_a_lora_block_matches_only_a_request_for_that_adapter() -> None:
    index = PrefixIndex(BS)
    apply(
        index,
        0,
        stored([b"a", b"b"], A + B, lora_name="sql", extra_keys=[["sql"], ["sql"]]),
    )
    tokens = prompt_of(A, B)
    assert cached(index, tokens, [0], lora_name="sql") == [8]
    assert cached(index, tokens, [0]) == [0]
    assert cached(index, tokens, [0], lora_name="chat") == [0]


def test_the_cache_salt_keys_the_first_block_and_so_the_chain() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b"], A + B, extra_keys=[["tenant-1"], None]))
    tokens = prompt_of(A, B)
    assert cached(index, tokens, [0], cache_salt="tenant-1") == [8]
    assert cached(index, tokens, [0], cache_salt="tenant-2") == [0]
    assert cached(index, tokens, [0]) == [0]


def test_multimodal_items_key_every_block_they_overlap() -> None:
    index = PrefixIndex(BS)
    # An image whose placeholder covers tokens 2..6 overlaps blocks 0 and 1; its offset
    # is counted from each block's start. Block 2 has no extra keys.
    # vLLM publishes each (identifier, offset) pair as a 2-element array.
    event = stored(
        [b"a", b"b", b"c"],
        A + B + C,
        extra_keys=[[["img-1", 2]], [["img-1", -2]], None],
    )
    apply(index, 0, event)
    image = [MultiModalPlaceholder("img-1", PlaceholderRange(offset=2, length=5))]
    tokens = prompt_of(A, B, C)
    assert cached(index, tokens, [0], mm_features=image) == [12]
    moved = [MultiModalPlaceholder("img-1", PlaceholderRange(offset=3, length=4))]
    assert cached(index, tokens, [0], mm_features=moved) == [0]
    other = [MultiModalPlaceholder("img-2", PlaceholderRange(offset=2, length=5))]
    assert cached(index, tokens, [0], mm_features=other) == [0]


def test_extras_are_published_in_lora_image_salt_order() -> None:
    image = [MultiModalPlaceholder("img", PlaceholderRange(offset=1, length=2))]
    extras = prompt_extras(2, BS, lora_name="sql", mm_features=image, cache_salt="s")
    assert extras == [extra_key_bytes(["sql", ["img", 1], "s"]), extra_key_bytes(["sql"])]
    assert prompt_extras(3, BS) is None
    assert prompt_extras(1, BS, cache_salt="") is None
    assert extra_key_bytes(None) == extra_key_bytes([]) == b""


def test_a_decoded_add_request_is_prepared_with_its_extras() -> None:
    index = PrefixIndex(BS)
    apply(
        index,
        0,
        stored([b"a", b"b"], A + B, lora_name="sql", extra_keys=[["sql", "salt"], ["sql"]]),
    )

    def request(**fields: Any) -> AddRequestHead:
        values: list[Any] = ["r", prompt_of(A, B), None, {}, None, 0.0, None, None, None]
        values[6] = fields.get("lora", ["sql", 1, "/sql", None, False, False])
        values[7] = fields.get("salt", "salt")
        if "embeds" in fields:
            values.append(fields["embeds"])
        return decode_add_request(msgspec.msgpack.encode(values))

    prompt = index.prompt_for(request())
    assert isinstance(prompt, PromptBlocks)
    assert index.cached_tokens(prompt, [0]) == [8]
    other = index.prompt_for(request(salt=None))
    assert other is not None and index.cached_tokens(other, [0]) == [0]
    assert index.prompt_for(request(embeds=["float16", [1], 1])) is None


# --- removal, clearing and resets ---------------------------------------------------------


def test_a_removed_block_cuts_the_prefix_there() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b", b"c"], A + B + C))
    apply(index, 0, removed([b"b"]))
    # The engine's lookup stops at the first missing block, whatever follows it.
    assert cached(index, prompt_of(A, B, C), [0]) == [4]
    assert index.blocks(0) == 2
    assert index.counters.removed_blocks == 1
    apply(index, 0, removed([b"b", b"zz"]))
    assert index.counters.unknown_removals == 2


def test_a_block_held_by_two_ranks_survives_removal_from_one() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a"], A))
    apply(index, 1, stored([b"a"], A))
    apply(index, 0, removed([b"a"]))
    assert cached(index, prompt_of(A), [0, 1]) == [0, 4]
    assert index.distinct_blocks == 1


def test_two_engine_hashes_for_the_same_content_are_both_needed_to_forget_it() -> None:
    # An adapter name re-pointed at another path: new engine hash, same published content.
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"old"], A), stored([b"new"], A))
    assert index.blocks(0) == 2 and index.distinct_blocks == 1
    apply(index, 0, removed([b"old"]))
    assert cached(index, prompt_of(A), [0]) == [4]
    apply(index, 0, removed([b"new"]))
    assert cached(index, prompt_of(A), [0]) == [0]
    assert index.distinct_blocks == 0


def test_an_engine_hash_stored_again_with_other_content_replaces_it() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"h"], A), stored([b"h"], B))
    assert cached(index, prompt_of(A), [0]) == [0]
    assert cached(index, prompt_of(B), [0]) == [4]
    assert index.blocks(0) == 1 and index.distinct_blocks == 1


def test_all_blocks_cleared_empties_that_rank_only() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b"], A + B))
    apply(index, 1, stored([b"a", b"b"], A + B))
    apply(index, 0, AllBlocksCleared())
    assert cached(index, prompt_of(A, B), [0, 1]) == [0, 8]
    assert index.blocks(0) == 0 and index.total_blocks == 2
    assert index.counters.clears == 1
    # A parent forgotten with the rest: later blocks under it are orphans.
    apply(index, 0, stored([b"c"], C, parent=b"b"))
    assert index.counters.orphan_blocks == 1


def test_reset_rank_is_the_callers_way_to_forget_a_rank() -> None:
    index = PrefixIndex(BS)
    apply(index, 4, stored([b"a", b"b"], A + B))
    assert index.reset_rank(4) == 2
    assert index.reset_rank(4) == 0
    assert index.reset_rank(9) == 0
    assert index.counters.resets == 3
    assert index.total_blocks == 0 and index.distinct_blocks == 0
    assert index.blocks_per_rank() == {}


# --- what the index ignores ----------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        stored([b"a"], A, group_idx=1),
        stored([b"a"], A, medium="CPU"),
        stored([b"a"], A, locality="REMOTE"),
        stored([b"a"], A[:2], block_size=2),
        # A group that publishes only some of its blocks: tokens do not line up with hashes.
        stored([b"a"], A + B),
        stored([b"a", b"b"], A + B, extra_keys=[None]),
    ],
)
def test_events_the_index_cannot_use_are_skipped_and_counted(event: BlockStored) -> None:
    index = PrefixIndex(BS)
    apply(index, 0, event)
    assert index.total_blocks == 0
    assert index.counters.skipped_blocks == len(event.block_hashes)


def test_events_without_group_or_medium_apply_and_local_locality_applies() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a"], A, group_idx=None, medium=None, locality="LOCAL"))
    assert index.blocks(0) == 1


def test_a_removal_from_another_medium_leaves_the_gpu_block() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a"], A))
    apply(index, 0, removed([b"a"], medium="CPU"))
    assert index.blocks(0) == 1
    index = PrefixIndex(BS, media=("CPU",))
    apply(index, 0, stored([b"a"], A, medium="CPU"))
    assert index.blocks(0) == 1


def test_another_group_can_be_followed() -> None:
    index = PrefixIndex(BS, group_idx=2)
    apply(index, 0, stored([b"a"], A, group_idx=2), stored([b"b"], B, group_idx=0))
    assert index.blocks(0) == 1


# --- bounds ----------------------------------------------------------------------------


def test_the_per_rank_cap_evicts_that_ranks_oldest_block() -> None:
    index = PrefixIndex(BS, max_blocks_per_rank=2)
    apply(index, 0, stored([b"a"], A), stored([b"b"], B), stored([b"a"], A))  # a is newest now
    apply(index, 0, stored([b"c"], C))
    assert index.blocks(0) == 2
    assert index.counters.evicted_at_cap == 1
    assert cached(index, prompt_of(B), [0]) == [0]  # b was the oldest
    assert cached(index, prompt_of(A), [0]) == [4]
    assert cached(index, prompt_of(C), [0]) == [4]


def test_the_total_cap_evicts_from_the_rank_holding_most() -> None:
    index = PrefixIndex(BS, max_blocks=4)
    apply(index, 0, stored([b"a"], A), stored([b"b"], B))
    apply(index, 1, stored([b"c"], C))
    apply(index, 2, stored([b"d"], D))
    apply(index, 2, stored([b"e"], A))  # rank 0 holds most: it loses its oldest, a
    assert index.blocks_per_rank() == {0: 1, 1: 1, 2: 2}
    assert cached(index, prompt_of(A), [0, 2]) == [0, 4]
    assert index.counters.evicted_at_cap == 1


def test_ties_at_the_total_cap_go_to_the_storing_rank_else_the_lowest() -> None:
    index = PrefixIndex(BS, max_blocks=4)
    apply(index, 0, stored([b"a"], A), stored([b"b"], B))
    apply(index, 1, stored([b"c"], C), stored([b"d"], D))
    apply(index, 1, stored([b"e"], A))  # ranks 0 and 1 tie: rank 1 is storing, it gives up c
    assert index.blocks_per_rank() == {0: 2, 1: 2}
    assert cached(index, prompt_of(C), [1]) == [0]
    apply(index, 2, stored([b"f"], C))  # ranks 0 and 1 tie again: the lower gives up a
    assert index.blocks_per_rank() == {0: 1, 1: 2, 2: 1}
    assert cached(index, prompt_of(A), [0, 1]) == [0, 4]


def test_sizes_and_the_memory_estimate() -> None:
    index = PrefixIndex(BS)
    apply(index, 0, stored([b"a", b"b"], A + B))
    apply(index, 1, stored([b"a"], A))
    assert index.blocks(0) == 2 and index.blocks(1) == 1 and index.blocks(2) == 0
    assert index.total_blocks == 3
    assert index.distinct_blocks == 2
    assert index.blocks_per_rank() == {0: 2, 1: 1}
    assert index.memory_estimate_bytes() == 3 * BYTES_PER_RANK_BLOCK + 2 * BYTES_PER_KEY


# --- keys and arguments ---------------------------------------------------------------------


def test_keys_chain_over_tokens_and_extras() -> None:
    keyer = BlockKeyer(BS)
    first, second = keyer.chain(A + B + [1])
    assert keyer.chain(A + B) == [first, second]
    assert keyer.chain(B) != [second]  # a block's key depends on what came before it
    assert keyer.chain(B, parent=first) == [second]
    assert keyer.chain(A, [extra_key_bytes(["x"])]) != [first]
    assert keyer.key(first, token_bytes(B)) == second
    # The prompt's lazily computed keys are the same chain.
    prompt = PrefixIndex(BS).prompt(A + B + [1])
    assert prompt.key(1) == second and prompt.keys == [first, second]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BlockKeyer(0)
    with pytest.raises(ValueError):
        PrefixIndex(BS, max_blocks=0)
    with pytest.raises(ValueError):
        PrefixIndex(BS).prompt([1, -1, 3, 4, 5])
    with pytest.raises(ValueError):
        PrefixIndex(BS).apply(-1, AllBlocksCleared())
    with pytest.raises(ValueError):
        PrefixIndex(BS).apply(70_000, AllBlocksCleared())
    with pytest.raises(TypeError):
        PrefixIndex(BS).apply(0, "BlockStored")  # type: ignore[arg-type]
