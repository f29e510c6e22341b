"""Which prompt prefixes each DP rank holds in its KV cache, from the ranks' KV events.

Theory of operation
-------------------
Every rank's engine publishes ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events (``coordinator.protocol.kv_events``). The index
turns them into one question answered for every rank at once: *for this
prompt, how many leading tokens would each rank find in its prefix cache?*

Keys. A block is keyed by the coordinator's own content hash, chained like
the engine's: ``key = hash((parent key, the block's tokens, its extras))``,
where the first block's parent is a fixed root, the tokens are their
uint32 bytes and the extras are whatever else the engine mixes into the
block's hash and also publishes (the LoRA adapter's name, multimodal items
with their offset inside the block, the cache salt on the first block),
in msgpack form. ``hash`` is Python's own: 64 bits, with the bytes hashed
by SipHash under the interpreter's per-process random key, so nobody
outside the process can aim a collision at the index (unless the
coordinator itself runs with ``PYTHONHASHSEED`` set), and the odds that a
lookup meets a chance collision among a million held keys are near 1 in
10^13. It is several times faster than a cryptographic digest, and prompts
are hashed on the request path. Keys never leave the process. The engine's own block hashes
are not usable as keys: they are seeded per process unless
``PYTHONHASHSEED`` is set, so the coordinator cannot compute them for a new
prompt. They are kept per rank only to find a stored block's parent and to
apply removals.

Per rank, ``by_hash`` maps each engine block hash to its key (dict order is
age, oldest first; storing a block again makes it the newest), and ``refs``
counts how many engine hashes name each key (an adapter re-pointed under
the same name gives two). Across ranks, ``owners`` maps a key to the bit
set of ranks holding it (bit ``r`` for rank ``r``), so a query hashes each
of the prompt's blocks once and looks it up once, whatever the number of
ranks.

Events, for rank ``r``:

===================  ==========================================================
event                effect
===================  ==========================================================
BlockStored          each block's key is chained from the parent's key (the root
                     if ``parent_block_hash`` is None) and stored; the blocks
                     are skipped (counted) if the parent is unknown on ``r``
                     (``orphan_blocks``), if the event is for another KV cache
                     group, another medium, a remote locality or another block
                     size, or if its token count is not ``block_size`` per hash
                     (a group that publishes only some of its blocks)
BlockRemoved         each named engine hash is forgotten on ``r``; a hash the
                     index does not hold is counted (``unknown_removals``)
AllBlocksCleared     everything ``r`` holds is forgotten (``clears``)
reset_rank(r)        the same, for the caller: rank death or replacement, a
                     publisher restart, a sequence gap replay cannot fill
===================  ==========================================================

A query counts, for each rank, the leading blocks it holds, over the full
blocks of ``tokens[:-1]``: the engine always computes the last prompt token,
so a prompt of ``n`` tokens can hit at most ``n - 1`` of them, in whole
blocks (a partial block never matches). Prompts with embeddings are not
queried (their keys hash the embeddings); see ``AddRequestHead.cacheable``.
Keys are computed lazily and the walk stops at the first block no rank
holds, so a prompt costs hashing only as far as some rank could hit.

Bounded memory. ``max_blocks_per_rank`` and ``max_blocks`` (the sum over
ranks) cap what the index holds. A store beyond a cap first evicts the
oldest block of that rank (per-rank cap) or of the rank holding the most
blocks (total cap; the storing rank on a tie, else the lowest), counted in
``evicted_at_cap``. Normally the engine's own ``BlockRemoved`` events keep
each rank near its KV cache size, far below the caps; the caps bound what
lost removals or a misbehaving publisher can make the coordinator hold.
``memory_estimate_bytes`` turns the counts into bytes with per-entry sizes
measured on CPython 3.11 (``BYTES_PER_RANK_BLOCK``, ``BYTES_PER_KEY``).

Known limits: with lookahead hashing (speculative decoding), the engine also
hashes the few tokens after each block, which the index ignores, so the
last block or two of a matched prefix can be counted although the engine
misses them. Partial-block entries (hybrid models that cache inside a block)
are never counted. Both make the estimate err in small, bounded ways.

This module does no IO and reads no clock.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

from coordinator.protocol.engine_request import AddRequestHead, MultiModalPlaceholder
from coordinator.protocol.identity import MAX_RANK
from coordinator.protocol.kv_events import (
    LOCALITY_REMOTE,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = [
    "BYTES_PER_KEY",
    "BYTES_PER_RANK_BLOCK",
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_MAX_BLOCKS_PER_RANK",
    "ROOT_KEY",
    "BlockKey",
    "BlockKeyer",
    "IndexCounters",
    "PrefixIndex",
    "PromptBlocks",
    "extra_key_bytes",
    "prompt_extras",
    "token_bytes",
]

BlockKey: TypeAlias = int
# The parent of a sequence's first block.
ROOT_KEY: BlockKey = 0

# A rank's KV cache rarely exceeds a few hundred thousand blocks; the caps
# are there for lost removals and misbehaving publishers, not for normal use.
DEFAULT_MAX_BLOCKS_PER_RANK = 1 << 18
DEFAULT_MAX_BLOCKS = 1 << 20

# Measured with tracemalloc on CPython 3.11 (64-bit): one (rank, block) entry
# (slots in `by_hash` and `refs`, the engine hash, the key) took 192 bytes
# with 32-byte engine hashes and 162 with integer ones; one distinct key's
# `owners` slot took 52, plus up to ~40 for the rank bit set of high ranks.
# So the default caps bound the index at about 300 MB.
BYTES_PER_RANK_BLOCK = 200
BYTES_PER_KEY = 90

_encode = msgspec.msgpack.Encoder().encode


def extra_key_bytes(entry: Sequence[Any] | None) -> bytes:
    """The canonical form of one block's extra keys: empty, or the entry as msgpack."""
    if not entry:
        return b""
    return _encode(entry)


def _mm_entries(
    features: Sequence[MultiModalPlaceholder], start: int, end: int
) -> list[list[Any]]:
    # Every item whose placeholder overlaps [start, end), with its offset
    # relative to the block's start (negative when it began in an earlier block).
    entries: list[list[Any]] = []
    for feature in features:
        offset = feature.mm_position.offset
        if offset < end and offset + feature.mm_position.length > start:
            entries.append([feature.identifier, offset - start])
    return entries


def prompt_extras(
    num_blocks: int,
    block_size: int,
    *,
    lora_name: str | None = None,
    mm_features: Sequence[MultiModalPlaceholder] | None = None,
    cache_salt: str | None = None,
) -> list[bytes] | None:
    """Per-block extra keys of a prompt, in the form the engine publishes them.

    Each block's entry is, in order: the LoRA name, the overlapping
    multimodal items as ``[identifier, offset]``, and the cache salt (first
    block only). Returns None when no block has any, the common case.
    """
    if lora_name is None and not mm_features and not cache_salt:
        return None
    extras: list[bytes] = []
    for index in range(num_blocks):
        entry: list[Any] = [] if lora_name is None else [lora_name]
        if mm_features:
            start = index * block_size
            entry.extend(_mm_entries(mm_features, start, start + block_size))
        if index == 0 and cache_salt:
            entry.append(cache_salt)
        extras.append(extra_key_bytes(entry))
    return extras


class BlockKeyer:
    """Computes chained block keys for one block size."""

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block size must be a positive int, got {block_size!r}")
        self.block_size = block_size

    @staticmethod
    def key(parent: BlockKey, block: bytes | memoryview, extra: bytes = b"") -> BlockKey:
        """The key of one block: its parent's key, its tokens as uint32 bytes, its extras."""
        return hash((parent, block, extra))

    def chain(
        self,
        tokens: Sequence[int],
        extras: Sequence[bytes] | None = None,
        parent: BlockKey = ROOT_KEY,
    ) -> list[BlockKey]:
        """Keys of every full block of ``tokens``, chained from ``parent``."""
        data = memoryview(token_bytes(tokens))
        step = 4 * self.block_size
        keys: list[BlockKey] = []
        for index in range(len(tokens) // self.block_size):
            extra = extras[index] if extras is not None else b""
            parent = hash((parent, data[index * step : (index + 1) * step], extra))
            keys.append(parent)
        return keys


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as native-endian uint32, the byte form block keys hash (keys stay in-process)."""
    try:
        data = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if data.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("array('I') is not 4 bytes wide here")
    return data.tobytes()


class PromptBlocks:
    """A prompt prepared for queries: its matchable blocks, keyed lazily and once.

    Build one per request (``PrefixIndex.prompt`` or ``PrefixIndex.prompt_for``)
    and query it as often as needed; keys computed by one query are reused.
    Given an earlier prompt (``reuse``, say the previous turn of the same
    conversation), the keys it computed for the blocks both share are taken
    over instead of hashed again: the blocks are compared as bytes, which is
    far cheaper than keying them.
    """

    __slots__ = ("_bytes", "_data", "_extras", "_step", "keys", "num_blocks")

    def __init__(
        self, block_size: int, tokens: Sequence[int], extras: Sequence[bytes] | None,
        reuse: PromptBlocks | None = None,
    ) -> None:
        # The engine always computes the last prompt token itself.
        self.num_blocks = max(0, len(tokens) - 1) // block_size
        self._bytes = token_bytes(tokens[: self.num_blocks * block_size])
        self._data = memoryview(self._bytes)
        self._step = 4 * block_size
        self._extras = extras
        self.keys: list[BlockKey] = []
        if reuse is not None and reuse._step == self._step and reuse.keys:
            self.keys = reuse.keys[: self._shared_blocks(reuse)]

    @property
    def nbytes(self) -> int:
        """Roughly what this prompt holds in memory (its token bytes and its keys)."""
        return len(self._bytes) + 36 * len(self.keys) + 200

    def _shared_blocks(self, other: PromptBlocks) -> int:
        """How many leading blocks, among those ``other`` keyed, both prompts share."""
        step = self._step
        limit = min(len(other.keys), self.num_blocks)
        # Bytes, not memoryviews: these compare with one memcmp, memoryviews item by item.
        mine, theirs = self._bytes, other._bytes
        if mine[: limit * step] != theirs[: limit * step]:
            # Bisect for the first differing block: each probe is one C comparison.
            low, high = 0, limit - 1
            while low < high:
                middle = (low + high + 1) // 2
                if mine[: middle * step] == theirs[: middle * step]:
                    low = middle
                else:
                    high = middle - 1
            limit = low
        extras, theirs_extras = self._extras, other._extras
        if extras is None and theirs_extras is None:
            return limit
        if extras is None or theirs_extras is None:
            return 0
        for index in range(limit):
            if extras[index] != theirs_extras[index]:
                return index
        return limit

    def key(self, index: int) -> BlockKey:
        """The key of block ``index`` (computing the keys before it as needed)."""
        keys = self.keys
        step = self._step
        extras = self._extras
        while len(keys) <= index:
            position = len(keys)
            parent = keys[-1] if keys else ROOT_KEY
            extra = extras[position] if extras is not None else b""
            keys.append(hash((parent, self._data[position * step : (position + 1) * step], extra)))
        return keys[index]


@dataclass
class IndexCounters:
    """What the index did, for metrics; every field only grows."""

    stored_blocks: int = 0  # blocks stored (or stored again)
    removed_blocks: int = 0  # blocks forgotten on BlockRemoved
    unknown_removals: int = 0  # BlockRemoved naming a hash the rank's index does not hold
    orphan_blocks: int = 0  # BlockStored blocks whose parent the rank's index does not hold
    skipped_blocks: int = 0  # other group, medium, locality or block size; ragged token counts
    evicted_at_cap: int = 0  # blocks evicted to stay within a cap
    clears: int = 0  # AllBlocksCleared applied
    resets: int = 0  # reset_rank calls


class _RankBlocks:
    __slots__ = ("by_hash", "refs")

    def __init__(self) -> None:
        self.by_hash: OrderedDict[BlockHash, BlockKey] = OrderedDict()
        self.refs: dict[BlockKey, int] = {}


class PrefixIndex:
    """Prefix-cache contents of every rank, keyed by content; see the module docstring."""

    def __init__(
        self,
        block_size: int,
        *,
        max_blocks_per_rank: int = DEFAULT_MAX_BLOCKS_PER_RANK,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        group_idx: int = 0,
        media: Iterable[str | None] = (None, MEDIUM_GPU),
    ) -> None:
        if max_blocks_per_rank < 1 or max_blocks < 1:
            raise ValueError("block caps must be >= 1")
        self.keyer = BlockKeyer(block_size)
        self.block_size = block_size
        self.max_blocks_per_rank = max_blocks_per_rank
        self.max_blocks = max_blocks
        self.group_idx = group_idx
        self.media = frozenset(media)
        self.counters = IndexCounters()
        self._ranks: dict[int, _RankBlocks] = {}
        self._owners: dict[BlockKey, int] = {}
        self._total = 0

    # --- sizes -----------------------------------------------------------

    @property
    def total_blocks(self) -> int:
        """(rank, block) entries held, summed over ranks; at most ``max_blocks``."""
        return self._total

    @property
    def distinct_blocks(self) -> int:
        """Distinct block keys held by any rank."""
        return len(self._owners)

    def blocks(self, rank: int) -> int:
        """Blocks ``rank`` holds according to the index."""
        state = self._ranks.get(rank)
        return 0 if state is None else len(state.by_hash)

    def blocks_per_rank(self) -> dict[int, int]:
        """Blocks held, for every rank that holds any."""
        return {rank: len(state.by_hash) for rank, state in self._ranks.items() if state.by_hash}

    def memory_estimate_bytes(self) -> int:
        """Approximate memory the index holds (see ``BYTES_PER_RANK_BLOCK``)."""
        return self._total * BYTES_PER_RANK_BLOCK + len(self._owners) * BYTES_PER_KEY

    # --- events ----------------------------------------------------------

    def apply(self, rank: int, event: KVEvent) -> None:
        """Apply one event published by ``rank``'s engine."""
        state = self._rank_state(rank)
        if isinstance(event, BlockStored):
            self._stored(rank, state, event)
        elif isinstance(event, BlockRemoved):
            self._removed(rank, state, event)
        elif isinstance(event, AllBlocksCleared):
            self.counters.clears += 1
            self._clear(rank)
        else:
            raise TypeError(f"not a KV event: {type(event).__name__}")

    def apply_events(self, rank: int, events: Iterable[KVEvent]) -> None:
        """Apply a batch's events in order."""
        for event in events:
            self.apply(rank, event)

    def reset_rank(self, rank: int) -> int:
        """Forget everything ``rank`` holds; returns how many blocks that was."""
        self.counters.resets += 1
        return self._clear(rank)

    def _rank_state(self, rank: int) -> _RankBlocks:
        state = self._ranks.get(rank)
        if state is None:
            if type(rank) is not int or not 0 <= rank <= MAX_RANK:
                raise ValueError(f"rank must be an int in [0, {MAX_RANK}], got {rank!r}")
            state = self._ranks[rank] = _RankBlocks()
        return state

    def _applies(self, group_idx: int | None, medium: str | None, locality: str | None) -> bool:
        return (
            (group_idx is None or group_idx == self.group_idx)
            and medium in self.media
            and locality != LOCALITY_REMOTE
        )

    def _stored(self, rank: int, state: _RankBlocks, event: BlockStored) -> None:
        hashes = event.block_hashes
        count = len(hashes)
        block_size = self.block_size
        extras = event.extra_keys
        if (
            not self._applies(event.group_idx, event.medium, event.locality)
            or event.block_size != block_size
            or len(event.token_ids) != count * block_size
            or (extras is not None and len(extras) != count)
        ):
            self.counters.skipped_blocks += count
            return
        if event.parent_block_hash is None:
            parent: BlockKey | None = ROOT_KEY
        else:
            parent = state.by_hash.get(event.parent_block_hash)
        if parent is None:
            self.counters.orphan_blocks += count
            return
        data = memoryview(token_bytes(event.token_ids))
        step = 4 * block_size
        for index, engine_hash in enumerate(hashes):
            extra = extra_key_bytes(extras[index]) if extras is not None else b""
            parent = hash((parent, data[index * step : (index + 1) * step], extra))
            self._store(rank, state, engine_hash, parent)
        self.counters.stored_blocks += count

    def _store(
        self, rank: int, state: _RankBlocks, engine_hash: BlockHash, key: BlockKey
    ) -> None:
        by_hash = state.by_hash
        old = by_hash.pop(engine_hash, None)
        if old is not None:
            self._total -= 1
            if old == key:
                # Stored again: same entry, now the newest.
                by_hash[engine_hash] = key
                self._total += 1
                return
            self._unref(rank, state, old)
        if len(by_hash) >= self.max_blocks_per_rank:
            self._evict_oldest(rank, state)
        if self._total >= self.max_blocks:
            victim = self._largest_rank(rank)
            self._evict_oldest(victim, self._ranks[victim])
        by_hash[engine_hash] = key
        self._total += 1
        refs = state.refs
        held = refs.get(key, 0)
        refs[key] = held + 1
        if held == 0:
            self._owners[key] = self._owners.get(key, 0) | (1 << rank)

    def _largest_rank(self, storing: int) -> int:
        largest = storing
        most = len(self._ranks[storing].by_hash)
        for rank, state in sorted(self._ranks.items()):
            if len(state.by_hash) > most:
                largest, most = rank, len(state.by_hash)
        return largest

    def _evict_oldest(self, rank: int, state: _RankBlocks) -> None:
        # OrderedDict: O(1) at the front however many were deleted before
        # (a plain dict's next(iter()) scans the deleted slots).
        _, key = state.by_hash.popitem(last=False)
        self._total -= 1
        self._unref(rank, state, key)
        self.counters.evicted_at_cap += 1

    def _unref(self, rank: int, state: _RankBlocks, key: BlockKey) -> None:
        held = state.refs[key] - 1
        if held:
            state.refs[key] = held
            return
        del state.refs[key]
        owners = self._owners[key] & ~(1 << rank)
        if owners:
            self._owners[key] = owners
        else:
            del self._owners[key]

    def _removed(self, rank: int, state: _RankBlocks, event: BlockRemoved) -> None:
        if not self._applies(event.group_idx, event.medium, event.locality):
            return
        by_hash = state.by_hash
        for engine_hash in event.block_hashes:
            key = by_hash.pop(engine_hash, None)
            if key is None:
                self.counters.unknown_removals += 1
                continue
            self._total -= 1
            self._unref(rank, state, key)
            self.counters.removed_blocks += 1

    def _clear(self, rank: int) -> int:
        state = self._ranks.pop(rank, None)
        if state is None:
            return 0
        bit = 1 << rank
        owners = self._owners
        for key in state.refs:
            remaining = owners[key] & ~bit
            if remaining:
                owners[key] = remaining
            else:
                del owners[key]
        self._total -= len(state.by_hash)
        return len(state.by_hash)

    # --- queries ---------------------------------------------------------

    def prompt(
        self, tokens: Sequence[int], extras: Sequence[bytes] | None = None,
        reuse: PromptBlocks | None = None,
    ) -> PromptBlocks:
        """Prepare ``tokens`` (with per-block ``extras`` from ``prompt_extras``) for queries,
        taking over the keys ``reuse`` computed for the blocks both share."""
        return PromptBlocks(self.block_size, tokens, extras, reuse)

    def prompt_for(self, request: AddRequestHead) -> PromptBlocks | None:
        """Prepare a decoded ADD request, or None if the index cannot match it."""
        tokens = request.prompt_token_ids
        if tokens is None or request.has_prompt_embeds:
            return None
        num_blocks = max(0, len(tokens) - 1) // self.block_size
        extras = prompt_extras(
            num_blocks,
            self.block_size,
            lora_name=request.lora_name,
            mm_features=request.mm_features,
            cache_salt=request.cache_salt,
        )
        return PromptBlocks(self.block_size, tokens, extras)

    def cached_blocks(self, prompt: PromptBlocks, ranks: Sequence[int]) -> list[int]:
        """For each of ``ranks``, how many of the prompt's leading blocks it holds."""
        alive = 0
        for rank in ranks:
            if rank in self._ranks:
                alive |= 1 << rank
        depth_of: dict[int, int] = {}
        get_owners = self._owners.get
        keys = prompt.keys
        limit = prompt.num_blocks
        index = 0
        # Keys computed before (by an earlier query, or taken over from an earlier
        # prompt): their owners are looked up in one C pass, and the walk visits
        # only the blocks where some rank drops out.
        known = min(len(keys), limit)
        if alive and known:
            owners = [get_owners(key, 0) for key in keys[:known]]
            while alive and index < known:
                # The next block that not every live rank holds, if any.
                drop = next((i for i in range(index, known) if owners[i] & alive != alive),
                            known)
                if drop == known:
                    index = known
                    break
                held = owners[drop] & alive
                gone = alive & ~held
                while gone:
                    low = gone & -gone
                    depth_of[low] = drop
                    gone ^= low
                alive = held
                index = drop + 1
        # Further blocks are keyed here as the walk goes (the hot loop of a first
        # query, so PromptBlocks.key is inlined).
        data, step, extras = prompt._bytes, prompt._step, prompt._extras
        parent = keys[index - 1] if index else ROOT_KEY
        while alive and index < limit:
            extra = extras[index] if extras is not None else b""
            key = hash((parent, data[index * step : (index + 1) * step], extra))
            keys.append(key)
            parent = key
            held = get_owners(key, 0) & alive
            if held != alive:
                gone = alive & ~held
                while gone:
                    low = gone & -gone
                    depth_of[low] = index
                    gone ^= low
                alive = held
            index += 1
        # Ranks still alive hold every block; ranks never alive hold none.
        result = []
        for rank in ranks:
            bit = 1 << rank
            if alive & bit:
                result.append(limit)
            else:
                result.append(depth_of.get(bit, 0))
        return result

    def cached_tokens(self, prompt: PromptBlocks, ranks: Sequence[int]) -> list[int]:
        """For each of ``ranks``, how many leading prompt tokens its cache would serve."""
        size = self.block_size
        return [blocks * size for blocks in self.cached_blocks(prompt, ranks)]
