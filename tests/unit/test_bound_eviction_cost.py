"""Every bounded structure a peer can fill evicts in O(1) at its bound.

A plain dict evicting its oldest with ``next(iter(d))`` scans the slots left
by earlier deletions from its front, so at the bound each eviction costs more
the longer the structure has been full (issue 20, case 4). Each test measures
the per-operation cost below the bound and at it, in the same test, and asks
only for a wide ratio so a loaded machine cannot make it flake.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from coordinator.core.dispatch.prefix_policy import SessionPrompts
from coordinator.core.dispatch.prefix_rule import SessionAffinity
from coordinator.core.kv.prefix_index import PrefixIndex, PromptBlocks
from coordinator.protocol.kv_events import BlockStored

BOUND = 1 << 18  # the prefix index default cap, where the dict pattern showed (189 us against 3)
MARGIN = 10.0


def per_op(ops: Callable[[int, int], None], start: int, count: int) -> float:
    """Seconds per operation for ``ops(start, count)``, the best of three batches."""
    best = float("inf")
    step = count // 3
    for batch in range(3):
        began = time.perf_counter()
        ops(start + batch * step, step)
        best = min(best, (time.perf_counter() - began) / step)
    return best


def assert_o1(fill: Callable[[int, int], None], bound: int = BOUND) -> None:
    below = per_op(fill, 0, bound // 2)          # half full, nothing evicted
    fill(bound // 2, bound // 2)                 # now at the bound
    fill(bound, bound)                           # long at the bound: many front deletions
    at_bound = per_op(fill, 2 * bound, bound // 4)  # every operation evicts
    assert at_bound < MARGIN * below, (at_bound * 1e6, below * 1e6)


def test_prefix_index_evicts_in_constant_time_at_its_per_rank_cap() -> None:
    bound = BOUND
    index = PrefixIndex(1, max_blocks_per_rank=bound)

    def fill(start: int, count: int) -> None:
        for n in range(start, start + count):
            index.apply(0, BlockStored(block_hashes=[n], parent_block_hash=None,
                                       token_ids=[n], block_size=1,
                                       lora_id=None, lora_name=None, medium="GPU"))

    assert_o1(fill, bound)
    assert index.blocks(0) == bound
    assert index.counters.evicted_at_cap >= bound


def test_session_affinity_evicts_in_constant_time_at_its_bound() -> None:
    affinity = SessionAffinity(max_sessions=BOUND)

    def fill(start: int, count: int) -> None:
        for n in range(start, start + count):
            affinity.note(str(n), n & 7)

    assert_o1(fill)
    assert len(affinity) == BOUND


def test_session_prompts_evict_in_constant_time_at_their_bound() -> None:
    blocks = PromptBlocks(4, list(range(9)), None)
    prompts = SessionPrompts(max_bytes=BOUND * blocks.nbytes)

    def fill(start: int, count: int) -> None:
        for n in range(start, start + count):
            prompts.put(str(n), blocks)

    assert_o1(fill)
    assert len(prompts) == BOUND
