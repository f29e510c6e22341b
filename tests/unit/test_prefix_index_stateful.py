"""Random event sequences against a plain model of what each rank caches.

The model keeps, per rank, an insertion-ordered dict from engine hash to the
block's whole content path from the root (a tuple of `(tokens, extras)`),
and answers a query by walking the prompt's path prefixes. It knows nothing
of keys, bit sets or reference counts. Caps are small so that evictions
happen often; the model applies the documented eviction order itself.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.kv.prefix_index import PrefixIndex, extra_key_bytes
from coordinator.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 2
RANKS = (0, 1, 2)
PER_RANK_CAP = 5
TOTAL_CAP = 8

# A small alphabet of blocks and extras so that prefixes are shared often.
BLOCKS = st.sampled_from([(0, 0), (0, 1), (1, 0), (1, 1)])
EXTRAS = st.sampled_from([None, None, None, ["lora-a"], ["salt"]])
ENGINE_HASHES = st.sampled_from([b"h0", b"h1", b"h2", b"h3", b"h4", b"h5", b"h6", 7, 8, 9])

Path = tuple[tuple[tuple[int, ...], Any], ...]


def canonical(extra: list[Any] | None) -> Any:
    return tuple(extra) if extra else None


class PrefixIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(BS, max_blocks_per_rank=PER_RANK_CAP, max_blocks=TOTAL_CAP)
        self.model: dict[int, dict[bytes | int, Path]] = {rank: {} for rank in RANKS}

    # -- the model ----------------------------------------------------------

    def _model_store(self, rank: int, engine_hash: bytes | int, path: Path) -> None:
        held = self.model[rank]
        if engine_hash in held:
            old = held.pop(engine_hash)
            if old == path:
                held[engine_hash] = path
                return
        if len(held) >= PER_RANK_CAP:
            held.pop(next(iter(held)))
            event("per-rank cap")
        if sum(len(blocks) for blocks in self.model.values()) >= TOTAL_CAP:
            most = max(len(blocks) for blocks in self.model.values())
            victim = rank if len(held) == most else min(
                r for r in RANKS if len(self.model[r]) == most
            )
            self.model[victim].pop(next(iter(self.model[victim])))
            event("total cap")
        held[engine_hash] = path

    def _model_cached(self, blocks: list[tuple[tuple[int, ...], Any]], rank: int) -> int:
        paths = set(self.model[rank].values())
        depth = 0
        while depth < len(blocks) and tuple(blocks[: depth + 1]) in paths:
            depth += 1
        return depth

    # -- rules ----------------------------------------------------------------

    @rule(
        rank=st.sampled_from(RANKS),
        parent=st.none() | st.none() | ENGINE_HASHES,
        blocks=st.lists(st.tuples(ENGINE_HASHES, BLOCKS, EXTRAS), min_size=1, max_size=3),
        with_extras=st.booleans(),
    )
    def store(
        self,
        rank: int,
        parent: bytes | int | None,
        blocks: list[tuple[bytes | int, tuple[int, int], list[Any] | None]],
        with_extras: bool,
    ) -> None:
        extras = [extra for _, _, extra in blocks] if with_extras else None
        self.index.apply(
            rank,
            BlockStored(
                block_hashes=[engine_hash for engine_hash, _, _ in blocks],
                parent_block_hash=parent,
                token_ids=[token for _, tokens, _ in blocks for token in tokens],
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=extras,
                group_idx=0,
            ),
        )
        if parent is None:
            path: Path = ()
        elif parent in self.model[rank]:
            path = self.model[rank][parent]
        else:
            event("orphan")
            return
        for engine_hash, tokens, extra in blocks:
            path = (*path, (tokens, canonical(extra) if with_extras else None))
            self._model_store(rank, engine_hash, path)

    @rule(rank=st.sampled_from(RANKS), hashes=st.lists(ENGINE_HASHES, min_size=1, max_size=3))
    def remove(self, rank: int, hashes: list[bytes | int]) -> None:
        self.index.apply(rank, BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0))
        for engine_hash in hashes:
            self.model[rank].pop(engine_hash, None)

    @rule(rank=st.sampled_from(RANKS))
    def clear(self, rank: int) -> None:
        self.index.apply(rank, AllBlocksCleared())
        self.model[rank] = {}

    @rule(rank=st.sampled_from(RANKS))
    def reset(self, rank: int) -> None:
        assert self.index.reset_rank(rank) == len(self.model[rank])
        self.model[rank] = {}

    def _check_query(
        self, blocks: list[tuple[tuple[int, ...], list[Any] | None]], ranks: list[int]
    ) -> None:
        tokens = [token for block, _ in blocks for token in block] + [99]
        extras = [extra_key_bytes(extra) for _, extra in blocks]
        prompt = self.index.prompt(tokens, extras)
        path = [(block, canonical(extra)) for block, extra in blocks]
        expected = [
            self._model_cached(path, rank) if rank in self.model else 0 for rank in ranks
        ]
        assert self.index.cached_blocks(prompt, ranks) == expected
        if any(expected):
            event("query hit")

    @rule(
        blocks=st.lists(st.tuples(BLOCKS, EXTRAS), max_size=5),
        ranks=st.lists(st.sampled_from((*RANKS, 3)), max_size=4),
    )
    def query(
        self, blocks: list[tuple[tuple[int, int], list[Any] | None]], ranks: list[int]
    ) -> None:
        self._check_query(list(blocks), ranks)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data(), more=st.lists(st.tuples(BLOCKS, EXTRAS), max_size=2))
    def query_a_stored_prefix(
        self, data: Any, more: list[tuple[tuple[int, int], list[Any] | None]]
    ) -> None:
        paths = sorted(
            {path for blocks in self.model.values() for path in blocks.values()}, key=repr
        )
        path = data.draw(st.sampled_from(paths))
        blocks = [(tokens, None if extra is None else list(extra)) for tokens, extra in path]
        self._check_query(blocks + list(more), [*RANKS, 3])

    # -- invariants -----------------------------------------------------------

    @invariant()
    def sizes_match_the_model(self) -> None:
        for rank in RANKS:
            assert self.index.blocks(rank) == len(self.model[rank])
        assert self.index.total_blocks == sum(len(blocks) for blocks in self.model.values())
        assert self.index.total_blocks <= TOTAL_CAP
        distinct = {path for blocks in self.model.values() for path in blocks.values()}
        assert self.index.distinct_blocks == len(distinct)


PrefixIndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
TestPrefixIndex = PrefixIndexMachine.TestCase
