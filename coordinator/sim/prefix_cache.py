"""A simulated engine's KV cache: fixed blocks, prefix caching by content, LRU eviction.

Theory of operation
-------------------
The cache is ``num_blocks`` blocks of ``block_size`` tokens, shaped like vLLM
0.33's block pool wherever a consumer of its KV events or stats could tell
the difference. A request holds a *block table*: the blocks its tokens' KV
lives in. Each block has a reference count (how many requests hold it) and,
once it is full and computed, a *block hash* that names its content.

Block hashes are chained like vLLM's: ``sha256(parent hash, the block's
tokens, its extra keys)``, where the first block's parent is a root drawn
at random per process (derived from ``PYTHONHASHSEED`` when that is set, as
vLLM does), the tokens are uint32 and the extra keys are what
else the engine mixes in: the LoRA adapter (name and path), the multimodal
items overlapping the block (identifier and offset inside the block) and the
cache salt (first block only), in that order. So two requests share a block
exactly when vLLM would let them.

The free queue holds every block with no reference, in eviction order: a
freed block without a hash goes to the front (reused first), a freed block
with a hash to the back (kept as long as possible: LRU). A block taken from
the front that still has a hash is evicted: its hash is forgotten and a
``BlockRemoved`` event says so. As in vLLM, equal blocks computed by two
requests at once are both kept under the same hash (no de-duplication), and
each publishes its own ``BlockStored`` and later ``BlockRemoved``.

===================  ==========================================================
operation            effect
===================  ==========================================================
lookup(request)      the longest run of leading blocks of ``tokens[:-1]`` whose
                     hashes are cached (the engine always computes the last
                     token itself, so a prompt of n tokens hits at most n - 1)
admit(request, hit,  takes a reference on the hit blocks (leaving the free queue
      total)         if they were in it) and reserves the rest of the request's
                     ``total`` blocks; refused (False) when the free blocks, less
                     what running requests have reserved, do not cover it
allocate(request,    gives the request blocks until ``n`` tokens fit, from the
         n)          front of the free queue (evicting hashed ones: BlockRemoved)
commit(request, n)   hashes the request's blocks that ``n`` computed tokens fill
                     and caches them: one BlockStored with all of them, parent =
                     the block before the first (None at the start)
free(request)        drops the request's references, last block first (so a
                     prompt's tail is evicted before its head), and its reservation
reset()              forgets every hash (AllBlocksCleared), only when no block is
                     referenced; False otherwise, as vLLM's reset_prefix_cache
===================  ==========================================================

``usage`` is vLLM's ``kv_cache_usage``: the share of blocks that are not free
(cached but unreferenced blocks count as free, since they can be evicted).

This module does no IO and reads no clock.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from coordinator.protocol.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = ["BlockPool", "CacheRequest", "MultiModalSpan", "process_root_hash"]

_pack = msgspec.msgpack.Encoder().encode


def process_root_hash() -> bytes:
    """The parent hash of every first block: random per process unless PYTHONHASHSEED is set."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(b"coordinator.sim root " + seed.encode()).digest()


@dataclass(frozen=True)
class MultiModalSpan:
    """A multimodal item's placeholder in the prompt: its identifier and token span."""

    identifier: str
    offset: int
    length: int


@dataclass(eq=False)
class CacheRequest:
    """One request's view of the cache: its tokens, extras and block table.

    ``tokens`` grows as the request generates; the pool only reads it.
    """

    request_id: str
    tokens: list[int]
    lora_name: str | None = None
    lora_path: str = ""
    lora_id: int | None = None
    mm: tuple[MultiModalSpan, ...] = ()
    cache_salt: str | None = None
    session_id: str | None = None
    # Maintained by the pool.
    hashes: list[bytes] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    committed: int = 0
    reserved: int = 0

    def extras(self, index: int, block_size: int) -> tuple[bytes, list[Any] | None]:
        """Block ``index``'s extra keys: (what its hash covers, the entry its event carries)."""
        tagged: list[Any] = []
        published: list[Any] = []
        if self.lora_name is not None:
            tagged.append(("lora", self.lora_name, self.lora_path))
            published.append(self.lora_name)
        if self.mm:
            start = index * block_size
            end = start + block_size
            for item in self.mm:
                if item.offset < end and item.offset + item.length > start:
                    tagged.append(("mm", item.identifier, item.offset - start))
                    published.append([item.identifier, item.offset - start])
        if index == 0 and self.cache_salt:
            tagged.append(("cache_salt", self.cache_salt))
            published.append(self.cache_salt)
        if not tagged:
            return b"", None
        return _pack(tagged), published


class _Block:
    __slots__ = ("block_hash", "block_id", "refs")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.refs = 0
        self.block_hash: bytes | None = None


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens; see the module docstring."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        record_events: bool = False,
        root_hash: bytes | None = None,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.root_hash = root_hash if root_hash is not None else process_root_hash()
        self.medium = medium
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # hash -> the blocks cached under it (several when computed twice at once).
        self._cached: dict[bytes, dict[int, None]] = {}
        self._reserved = 0
        self._events: list[KVEvent] = []
        self.evictions = 0

    # --- sizes -----------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks nobody references (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a hash (referenced or not)."""
        return sum(len(blocks) for blocks in self._cached.values())

    @property
    def reserved(self) -> int:
        """Blocks admitted requests will still take."""
        return self._reserved

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage: the share of blocks that are not free."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    def cached_hashes(self) -> set[bytes]:
        return set(self._cached)

    # --- hashing ---------------------------------------------------------

    def _hash_blocks(self, request: CacheRequest, count: int) -> list[bytes]:
        """The hashes of the request's first ``count`` blocks (computed once, kept)."""
        hashes = request.hashes
        size = self.block_size
        tokens = request.tokens
        while len(hashes) < count:
            index = len(hashes)
            parent = hashes[-1] if hashes else self.root_hash
            # Native-order uint32: the hashes name blocks, nobody recomputes them.
            data = array("I", tokens[index * size : (index + 1) * size])
            extra, _ = request.extras(index, size)
            hashes.append(hashlib.sha256(parent + data.tobytes() + extra).digest())
        return hashes

    # --- operations ------------------------------------------------------

    def lookup(self, request: CacheRequest) -> int:
        """How many leading blocks of ``tokens[:-1]`` are cached (0 without caching)."""
        if not self.enable_caching:
            return 0
        limit = max(0, len(request.tokens) - 1) // self.block_size
        hits = 0
        cached = self._cached
        for block_hash in self._hash_blocks(request, limit)[:limit]:
            if block_hash not in cached:
                break
            hits += 1
        return hits

    def admit(self, request: CacheRequest, hit_blocks: int, total_blocks: int) -> bool:
        """Take the hit blocks, reserve the rest of ``total_blocks``; False if they do not fit."""
        if request.block_table or request.reserved:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        if not 0 <= hit_blocks <= total_blocks:
            raise ValueError("need 0 <= hit_blocks <= total_blocks")
        if hit_blocks > len(request.hashes) or not all(
            h in self._cached for h in request.hashes[:hit_blocks]
        ):
            raise ValueError("admit() takes the hit count of a lookup() made just before")
        hits = [next(iter(self._cached[h])) for h in request.hashes[:hit_blocks]]
        reviving = sum(1 for block_id in hits if self._blocks[block_id].refs == 0)
        reserve = total_blocks - hit_blocks
        if len(self._free) - reviving - self._reserved < reserve:
            return False
        for block_id in hits:
            block = self._blocks[block_id]
            if block.refs == 0:
                del self._free[block_id]
            block.refs += 1
        request.block_table = hits
        request.committed = hit_blocks
        request.reserved = reserve
        self._reserved += reserve
        return True

    def allocate(self, request: CacheRequest, num_tokens: int) -> None:
        """Give the request blocks until ``num_tokens`` tokens fit (within its reservation)."""
        needed = self.blocks_for(num_tokens) - len(request.block_table)
        if needed > request.reserved:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} more blocks, "
                f"reserved {request.reserved}"
            )
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:
                self._forget(block)
                self.evictions += 1
            block.refs = 1
            request.block_table.append(block_id)
        request.reserved -= max(0, needed)
        self._reserved -= max(0, needed)

    def commit(self, request: CacheRequest, num_computed: int) -> None:
        """Cache the request's blocks that ``num_computed`` computed tokens fill."""
        if not self.enable_caching:
            return
        full = min(num_computed // self.block_size, len(request.block_table))
        first = request.committed
        if full <= first:
            return
        hashes = self._hash_blocks(request, full)
        for index in range(first, full):
            block = self._blocks[request.block_table[index]]
            if block.block_hash is not None:  # pragma: no cover - hit blocks are committed
                continue
            block.block_hash = hashes[index]
            self._cached.setdefault(hashes[index], {})[block.block_id] = None
        request.committed = full
        if self.record_events:
            size = self.block_size
            extras = [request.extras(index, size)[1] for index in range(first, full)]
            stored: list[BlockHash] = list(hashes[first:full])
            self._events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=request.tokens[first * size : full * size],
                    block_size=size,
                    lora_id=request.lora_id if request.lora_name is not None else None,
                    medium=self.medium,
                    lora_name=request.lora_name,
                    extra_keys=extras,
                    group_idx=0,
                    session_id=request.session_id,
                )
            )

    def free(self, request: CacheRequest) -> None:
        """Drop the request's blocks (last first) and its unused reservation."""
        for block_id in reversed(request.block_table):
            block = self._blocks[block_id]
            block.refs -= 1
            if block.refs:
                continue
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)
        request.block_table = []
        request.committed = 0
        self._reserved -= request.reserved
        request.reserved = 0

    def reset(self) -> bool:
        """Forget every cached hash; False (and nothing changes) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def _forget(self, block: _Block) -> None:
        block_hash = block.block_hash
        if block_hash is None:  # pragma: no cover - callers check
            return
        owners = self._cached[block_hash]
        del owners[block.block_id]
        if not owners:
            del self._cached[block_hash]
        block.block_hash = None
        if self.record_events:
            self._events.append(
                BlockRemoved(block_hashes=[block_hash], medium=self.medium, group_idx=0)
            )

    def check(self) -> None:
        """Raise AssertionError if an internal invariant does not hold (for tests)."""
        refs = [0] * self.num_blocks
        for block in self._blocks:
            if not (block.refs >= 0):
                raise AssertionError('internal invariant broken: block.refs >= 0')
            if not ((block.refs == 0) == (block.block_id in self._free)):
                raise AssertionError(block.block_id)
            refs[block.block_id] = block.refs
        for block_hash, owners in self._cached.items():
            if not (owners):
                raise AssertionError('internal invariant broken: owners')
            for block_id in owners:
                if not (self._blocks[block_id].block_hash == block_hash):
                    raise AssertionError(f"block {block_id} cached under another hash")
        hashed = sum(1 for b in self._blocks if b.block_hash is not None)
        if not (hashed == self.num_cached):
            raise AssertionError('internal invariant broken: hashed == self.num_cached')
        if not (0 <= self._reserved <= len(self._free)):
            raise AssertionError(f"reserved {self._reserved} of {len(self._free)} free")
