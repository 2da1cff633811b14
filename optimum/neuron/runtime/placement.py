"""Where a sequence's positions live in the paged KV cache: the blocks it holds and how many of its tokens are already
there when it is admitted. Two placements, one per kind of caller:

* `PooledPlacement`, the engine's own (``generate()``, `NeuronModelForCausalLM`): blocks come from a `blocks.BlockPool`;
  a new sequence takes the cached blocks of its prompt's longest cached prefix and prefills only the rest; its blocks
  grow as its tokens need them; every block it fills is registered under its hash (prefix caching);
* `CallerPlacement` (the vLLM runner): vLLM's KV cache manager chose the blocks and the tokens already computed (its
  prefix-cache hits); the engine takes them as given and only checks that they cover what a step writes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from ..config import NeuronConfig
from ..errors import InputError
from .blocks import BlockPool, block_hash
from .sequence import Sequence

FIX = "release a sequence, generate fewer or shorter sequences at once, or re-export with a larger --kv_cache_tokens."


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks holding positions ``[0, tokens)``."""
    return -(-tokens // block_size)


class PooledPlacement:
    """Blocks from the engine's own pool, with prefix caching (off for an artifact without a chunked-prefill graph:
    context encoding always starts at position 0)."""

    def __init__(self, pool: BlockPool, reuse: bool) -> None:
        self.pool, self.block_size, self.reuse = pool, pool.block_size, reuse

    def admit(self, sequence: Sequence, reserve: int, reuse: bool) -> None:
        """Place a new (or resumed) ``sequence``: the cached blocks of its longest cached prefix (unless ``reuse`` is
        off, its prompt logprobs are asked, or the artifact cannot start a prefill past position 0), at least one
        prompt token left to compute; then new blocks for ``reserve`` positions (at least its tokens so far). Holds
        nothing when it raises."""
        hits: list[int] = []
        if reuse and self.reuse and sequence.scorer is None:
            hashes = self._hashes(sequence, (len(sequence.tokens) - 1) // self.block_size)
            hits = self.pool.lookup(hashes)
            sequence.block_hashes = hashes[: len(hits)]
        wanted = blocks_for(min(max(reserve, len(sequence.tokens)), sequence.capacity), self.block_size)
        try:
            fresh = self.pool.allocate(max(wanted - len(hits), 0), FIX)
        except Exception:
            self.pool.release(hits)
            sequence.block_hashes = []
            raise
        sequence.blocks, sequence.computed = hits + fresh, len(hits) * self.block_size

    def ensure(self, sequence: Sequence, positions: int) -> None:
        """Give ``sequence`` the blocks its positions ``[0, positions)`` need."""
        missing = blocks_for(positions, self.block_size) - len(sequence.blocks)
        if missing > 0:
            sequence.blocks.extend(self.pool.allocate(missing, FIX))

    def commit(self, sequence: Sequence) -> None:
        """Register the blocks ``sequence`` has filled (every position computed) under their hashes."""
        full = sequence.computed // self.block_size
        if len(sequence.block_hashes) < full:
            hashes = self._hashes(sequence, full)
            for index in range(len(sequence.block_hashes), full):
                self.pool.register(sequence.blocks[index], hashes[index])
            sequence.block_hashes = hashes

    def free(self, sequence: Sequence) -> None:
        """Give back ``sequence``'s blocks (their registered contents stay reusable until needed)."""
        self.pool.release(sequence.blocks)
        sequence.blocks, sequence.block_hashes = [], []

    def _hashes(self, sequence: Sequence, count: int) -> list[bytes]:
        """The hashes of ``sequence``'s first ``count`` blocks of tokens (those already known are reused)."""
        hashes = list(sequence.block_hashes[:count])
        size = self.block_size
        root = block_hash(None, (), (("adapter", sequence.adapter_key),)) if sequence.adapter_key else None
        for index in range(len(hashes), count):
            extra = None if sequence.images is None else sequence.images.keys(index * size, (index + 1) * size)
            tokens = sequence.tokens[index * size : (index + 1) * size]
            hashes.append(block_hash(hashes[-1] if hashes else root, tokens, extra))
        return hashes


class CallerPlacement:
    """Blocks chosen by the caller (vLLM's KV cache manager), which also frees them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def admit(self, sequence: Sequence, blocks: Seq[int], computed: int) -> None:
        """Place ``sequence`` in ``blocks`` with its first ``computed`` tokens already in them (a prefix-cache hit)."""
        self._check(sequence, blocks)
        if not 0 <= computed < len(sequence.tokens) or computed > len(blocks) * self.block_size:
            raise InputError(
                f"sequence {sequence.seq_id!r}: {computed} computed tokens of {len(sequence.tokens)} in "
                f"{len(blocks)} blocks of {self.block_size}: at least one token must be left to compute, and the "
                "computed ones must lie in the given blocks."
            )
        if sequence.images is not None and not sequence.images.unsent_before(computed):
            raise InputError(
                f"sequence {sequence.seq_id!r} has an image without pixels at or past position {computed}, the first "
                "one it computes: only images inside the cached prefix may come without pixels."
            )
        if computed and sequence.scorer is not None:
            raise InputError(
                f"sequence {sequence.seq_id!r} asks its prompt logprobs, which need every prompt row computed: admit "
                "it with computed=0 (vLLM skips the prefix cache for such requests)."
            )
        sequence.blocks, sequence.computed = list(blocks), computed

    def extend(self, sequence: Sequence, blocks: Seq[int]) -> None:
        """Append ``blocks`` to ``sequence``'s (vLLM allocated them for its next tokens)."""
        self._check(sequence, blocks)
        sequence.blocks.extend(blocks)

    def ensure(self, sequence: Sequence, positions: int) -> None:
        """`InputError` unless ``sequence``'s blocks hold positions ``[0, positions)``."""
        if positions > len(sequence.blocks) * self.block_size:
            raise InputError(
                f"sequence {sequence.seq_id!r} holds {len(sequence.blocks)} blocks of {self.block_size} positions, but "
                f"this step writes up to position {positions - 1}: give it its blocks first (add_blocks)."
            )

    def commit(self, sequence: Sequence) -> None:
        """Nothing: the caller keeps its own prefix cache."""

    def free(self, sequence: Sequence) -> None:
        """Forget ``sequence``'s blocks (the caller frees them)."""
        sequence.blocks, sequence.block_hashes = [], []

    def _check(self, sequence: Sequence, blocks: Seq[int]) -> None:
        bad = [b for b in blocks if not isinstance(b, int) or not 0 < b < self.num_blocks]
        if bad:
            raise InputError(
                f"sequence {sequence.seq_id!r}: blocks {bad[:4]} are not blocks of this cache (1 .. "
                f"{self.num_blocks - 1}; block 0 is the scratch block)."
            )


Placement = PooledPlacement | CallerPlacement


def placement_for(config: NeuronConfig, caller_blocks: bool, prefix_cache: bool) -> Placement:
    """The placement of an engine serving ``config``: the caller's blocks, or the engine's own pool of the artifact's
    blocks, with prefix caching when asked and the artifact can use it (a chunked-prefill graph: context encoding
    always starts at position 0)."""
    if caller_blocks:
        return CallerPlacement(config.kv_blocks, config.block_size)
    chunked = config.prefill_chunk_size > 0
    return PooledPlacement(BlockPool(config.kv_blocks, config.block_size), reuse=prefix_cache and chunked)


def place(
    placement: Placement, sequence: Sequence, blocks: Seq[int] | None, computed: int, reserve: int, reuse: bool
) -> None:
    """Give a new or resumed ``sequence`` its blocks: the caller's ``blocks`` with ``computed`` tokens in them, or the
    engine's own (``reserve`` positions, a cached prefix reused unless ``reuse`` is off); `InputError` when the
    arguments do not fit the placement."""
    if isinstance(placement, CallerPlacement):
        if blocks is None:
            raise InputError(f"sequence {sequence.seq_id!r}: this engine's caller places blocks; pass blocks=.")
        placement.admit(sequence, blocks, computed)
    elif blocks is not None or computed:
        raise InputError("this engine places sequences itself: admit without blocks= or computed=.")
    else:
        placement.admit(sequence, reserve, reuse)
