"""The engine's block pool and its prefix cache: the block-hash rule (vLLM's), all-or-nothing allocation, holds
counted per block, registered blocks reused by prefix and evicted least recently released first, and the pooled
placement of a sequence (at least one token left to compute, no reuse when asked not to or for prompt logprobs)."""

from __future__ import annotations

import pytest

from optimum.neuron.runtime.blocks import BlockPool, KVCacheFullError, block_hash
from optimum.neuron.runtime.placement import PooledPlacement
from optimum.neuron.runtime.sampling import SamplingParams, SequenceSampler
from optimum.neuron.runtime.sequence import Sequence

BLOCK = 4


def chain(tokens: list[int], block: int = BLOCK) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - len(tokens) % block, block):
        hashes.append(block_hash(hashes[-1] if hashes else None, tokens[start : start + block]))
    return hashes


def test_block_hash_is_vllms_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our hashes equal vLLM's ``hash_block_tokens`` with its default sha256 and seed, block after block, so both
    caches agree on which token lists share blocks."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # vLLM's seed is then its fixed default
    kv_cache_utils.init_none_hash(sha256)
    for tokens in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], list(range(100, 120))):
        theirs: list[bytes] = []
        for start in range(0, len(tokens), BLOCK):
            parent = theirs[-1] if theirs else None
            theirs.append(kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start : start + BLOCK]))
        assert chain(tokens) == theirs
    extra = (("image-digest", 3),)
    assert block_hash(None, [1, 2, 3, 4], extra) == kv_cache_utils.hash_block_tokens(sha256, None, [1, 2, 3, 4], extra)
    assert block_hash(None, [1, 2, 3, 4], extra) != block_hash(None, [1, 2, 3, 4])


def test_hashes_depend_on_every_earlier_block() -> None:
    a, b = chain([1, 2, 3, 4, 5, 6, 7, 8]), chain([1, 2, 3, 5, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1], "the same second block after another first one must not share a hash"


def test_allocation_is_all_or_nothing_and_never_gives_the_scratch_block() -> None:
    pool = BlockPool(num_blocks=5, block_size=BLOCK)
    assert pool.allocate(2, "fix it") == [1, 2]
    with pytest.raises(KVCacheFullError, match=r"2 free blocks .* 3 are needed: fix it"):
        pool.allocate(3, "fix it")
    assert pool.free_count == 2 and pool.held == 2, "a refused allocation took blocks"
    assert sorted(pool.allocate(2, "")) == [3, 4]
    pool.release([1, 2, 3, 4])
    assert pool.free_count == 4 and pool.held == 0


def test_registered_blocks_are_reused_by_prefix_and_counted_per_holder() -> None:
    pool = BlockPool(num_blocks=6, block_size=BLOCK)
    keys = chain(list(range(12)))
    blocks = pool.allocate(3, "")
    for block, key in zip(blocks, keys, strict=True):
        pool.register(block, key)
    assert pool.lookup(keys) == blocks, "a holder's registered blocks are found while it holds them"
    pool.release(blocks)  # the first holder goes; the second still holds them
    assert pool.held == 3
    pool.release(blocks)
    assert pool.held == 0 and pool.free_count == 5
    assert pool.lookup([keys[0], b"other", keys[2]]) == blocks[:1], "lookup stops at the first miss"
    pool.release(blocks[:1])


def test_released_blocks_are_evicted_least_recently_released_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)  # blocks 1..3
    old, new = chain([1] * 8), chain([2] * 4)
    first = pool.allocate(2, "")
    for block, key in zip(first, old, strict=True):
        pool.register(block, key)
    pool.release(first)  # cached, the tail (block 2) released first
    second = pool.allocate(1, "")  # the never-used block 3 comes first
    pool.register(second[0], new[0])
    pool.release(second)
    taken = pool.allocate(1, "")
    assert taken == [first[1]], "the least recently released cached block is evicted first"
    assert pool.lookup(old) == first[:1], "an evicted block is no longer found"
    assert pool.lookup(new) == second


def sequence(tokens: list[int], logprobs: bool = False) -> Sequence:
    params = SamplingParams(prompt_logprobs=0 if logprobs else None)
    seq = Sequence("s", None, tokens, len(tokens), 32, SequenceSampler(params))
    if logprobs:
        from optimum.neuron.runtime.logprobs import PromptScorer

        seq.scorer = PromptScorer(tokens, 0)
    return seq


def test_placement_reuses_a_cached_prefix_and_leaves_a_token_to_compute() -> None:
    placement = PooledPlacement(BlockPool(num_blocks=17, block_size=BLOCK), reuse=True)
    first = sequence(list(range(12)))
    placement.admit(first, reserve=0, reuse=True)
    assert (first.computed, len(first.blocks)) == (0, 3)
    first.computed = 12
    placement.commit(first)
    computed_blocks = list(first.blocks)
    placement.free(first)
    again = sequence(list(range(12)))  # the whole prompt is cached: its last block is computed again
    placement.admit(again, reserve=20, reuse=True)
    assert again.computed == 8 and again.blocks[:2] == computed_blocks[:2]
    assert len(again.blocks) == 5, "blocks for the reserved 20 positions"
    longer = sequence([*range(12), 50, 51])
    placement.admit(longer, reserve=0, reuse=True)
    assert longer.computed == 12 and longer.blocks[:3] == computed_blocks, "a longer prompt takes all 3 blocks"
    unused = sequence(list(range(12)))
    placement.admit(unused, reserve=0, reuse=False)
    assert unused.computed == 0, "reuse off must prefill from position 0"
    scored = sequence(list(range(12)), logprobs=True)
    placement.admit(scored, reserve=0, reuse=True)
    assert scored.computed == 0, "prompt logprobs need every prompt row: prefill from position 0"


def test_a_refused_placement_holds_nothing() -> None:
    pool = BlockPool(num_blocks=5, block_size=BLOCK)
    placement = PooledPlacement(pool, reuse=True)
    first = sequence(list(range(9)))
    placement.admit(first, reserve=0, reuse=True)
    first.computed = 8
    placement.commit(first)
    placement.free(first)
    big = sequence(list(range(9)))
    with pytest.raises(KVCacheFullError, match="--kv_cache_tokens"):
        placement.admit(big, reserve=32, reuse=True)  # hits 2 blocks, needs 6 more of 2 free
    assert pool.held == 0 and pool.free_count == 4 and big.blocks == []
