"""The engine's own KV block allocator, with prefix caching: what ``generate()`` and `NeuronModelForCausalLM` place
sequences with (under vLLM, vLLM's KV cache manager places them and the engine only receives the block ids).

A sequence holds blocks of the paged cache (`models.layers.kv_cache`); block 0, the scratch block, is never handed out.
When a block of a sequence is full and computed, it gets a **block hash** (`block_hash`: its tokens, the hash of the
block before it, and the keys of the images it holds) and is registered under it. A released block keeps its hash
and contents until the block is needed again (least recently released first): a later sequence whose prompt starts
with the same blocks (same tokens, same images) takes them as they are and prefills only the rest.

The hash rule is vLLM's default one (``hash_block_tokens`` with ``sha256``: SHA-256 of the pickled ``(parent hash,
token ids, extra keys)``, the first block's parent being the hash of vLLM's default seed), so the two caches agree on
which token lists share blocks; `tests/unit/test_blocks.py` compares them.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..errors import SlotError
from ..models.layers.kv_cache import SCRATCH_BLOCK

BlockHash = bytes
ROOT_SEED = "vllm-none-hash"
"""What the parent hash of a sequence's first block is the hash of (vLLM's default ``NONE_HASH`` seed)."""


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


ROOT_HASH: BlockHash = _sha256(ROOT_SEED)


def block_hash(parent: BlockHash | None, tokens: Sequence[int], extra: tuple[Any, ...] | None = None) -> BlockHash:
    """The hash of a full block holding ``tokens`` after the block hashed ``parent`` (None: the first block), with
    ``extra`` keys (the images it holds): the one block-hash rule."""
    return _sha256((parent or ROOT_HASH, tuple(tokens), extra))


class KVCacheFullError(SlotError):
    """The KV pool has no free block left for a sequence."""


class BlockPool:
    """Hands out the blocks ``1 .. num_blocks - 1`` of the cache, counts who holds each, and keeps full blocks under
    their hash for reuse (prefix caching) until they are needed again."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # popped from the end: lowest first
        self._cached: OrderedDict[int, None] = OrderedDict()
        """Blocks nobody holds that keep their registered hash, least recently released first."""
        self._refs: dict[int, int] = {}
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}

    @property
    def free_count(self) -> int:
        """Blocks a sequence can take now (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def held(self) -> int:
        """Blocks held by at least one sequence."""
        return len(self._refs)

    def allocate(self, count: int, fix: str) -> list[int]:
        """``count`` blocks, taken whole or not at all (evicting the least recently released cached ones);
        `KVCacheFullError` saying ``fix`` when the pool has fewer."""
        if count > self.free_count:
            raise KVCacheFullError(
                f"the KV cache has {self.free_count} free blocks of {self.block_size} positions, {count} are needed: "
                f"{fix}"
            )
        taken = [self._take_one() for _ in range(count)]
        for block in taken:
            self._refs[block] = 1
        return taken

    def _take_one(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._cached.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block)]
        return block

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (each now held once more)."""
        found = []
        for key in hashes:
            block = self._by_hash.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._cached.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        return found

    def register(self, block: int, key: BlockHash) -> None:
        """Remember that held block ``block`` is full and hashes to ``key`` (unless another block already does)."""
        if key not in self._by_hash and block not in self._hash_of:
            self._by_hash[key] = block
            self._hash_of[block] = key

    def release(self, blocks: Sequence[int]) -> None:
        """Give back one hold of each of ``blocks`` (last first, so a sequence's tail is evicted first); a block nobody
        holds any more is free again, kept under its hash if it has one."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)
