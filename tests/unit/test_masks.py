"""Attention masks (invariants 4 and 7): actual-tokens mask, chunk mask, decode mask, their sliding-window
forms, finite softmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimum.neuron.models.layers.masks import (
    actual_tokens_mask,
    chunk_mask,
    chunk_window_mask,
    decode_mask,
    decode_window_mask,
)
from optimum.neuron.runtime.padding import pad_chunk

S, C = 16, 8


def keys(window: int) -> torch.Tensor:
    """The positions of a KV window ``[0, window)`` (`attention.window_keys`)."""
    return torch.arange(window)


def test_actual_tokens_from_position_ids() -> None:
    positions = torch.tensor([[4, 5, 6, 6, 6], [0, 1, 2, 3, 4], [9, 9, 9, 9, 9]])
    expected = [[True, True, True, False, False], [True] * 5, [True, False, False, False, False]]
    assert actual_tokens_mask(positions).tolist() == expected


def test_first_token_always_real() -> None:
    assert actual_tokens_mask(torch.tensor([[0]])).tolist() == [[True]]
    assert actual_tokens_mask(torch.tensor([[7, 3]])).tolist() == [[True, False]]


def reference_chunk_mask(positions: list[int], cache_len: int) -> torch.Tensor:
    """The rule written out key by key: prior cache positions OR (causal AND real chunk key)."""
    real = [j == 0 or positions[j] > positions[j - 1] for j in range(len(positions))]
    rows = []
    for i in range(len(positions)):
        prior = [key < positions[0] for key in range(cache_len)]
        inside = [j <= i and real[j] for j in range(len(positions))]
        rows.append(prior + inside)
    return torch.tensor(rows)[None, None]


@pytest.mark.parametrize(("count", "start"), [(1, 0), (3, 0), (3, 5), (C, 8), (C - 1, 9)])
def test_chunk_mask_matches_rule(count: int, start: int) -> None:
    _, positions = pad_chunk(list(range(count)), start, C)
    mask = chunk_mask(positions, keys(S))
    assert mask.shape == (1, 1, C, S + C) and mask.dtype == torch.bool
    assert torch.equal(mask, reference_chunk_mask(positions[0].tolist(), S))


@pytest.mark.parametrize("count", [1, 3, C - 1])
def test_padded_queries_see_exactly_the_last_real_tokens_keys(count: int) -> None:
    _, positions = pad_chunk(list(range(count)), 4, C)
    mask = chunk_mask(positions, keys(S))[0, 0]
    for row in range(count, C):
        assert torch.equal(mask[row], mask[count - 1])
    assert not mask[:, S + count :].any(), "a padded key was visible"


def test_no_query_reads_a_position_at_or_after_its_chunk_from_the_cache() -> None:
    """Cache keys at or past the chunk's first position (stale rows of the sequence's blocks, the scratch block's
    positions a short table is padded with) are never read: the chunk's own keys come from the chunk."""
    for count, start in ((1, 0), (C, 8), (3, S - 3)):
        _, positions = pad_chunk(list(range(count)), start, C)
        assert not chunk_mask(positions, keys(S))[0, 0, :, start:S].any()
    live = torch.arange(S)[:, None]  # every position a live token can decode at
    mask = decode_mask(live, keys(S))[:, 0, 0]
    assert all(not mask[p, p + 1 :].any() for p in range(S))


def test_chunk_mask_without_prior_cache() -> None:
    _, positions = pad_chunk([1, 2, 3], 0, C)
    mask = chunk_mask(positions, None)
    assert mask.shape == (1, 1, C, C)
    assert torch.equal(mask, reference_chunk_mask(positions[0].tolist(), 0))


def test_decode_mask_reads_up_to_own_position() -> None:
    mask = decode_mask(torch.tensor([[0], [3], [S - 1]]), keys(S))
    assert mask.shape == (3, 1, 1, S)
    assert mask[0, 0, 0].tolist() == [True] + [False] * (S - 1)
    assert mask[1, 0, 0].tolist() == [True] * 4 + [False] * (S - 4)
    assert mask[2, 0, 0].all()


def attention_weights(scores_scale: float, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention weights as SDPA computes them with ``mask``: values are the identity, so the
    output rows are the weights. Large ``scores_scale`` makes the logits huge."""
    queries, keys = mask.shape[-2:]
    generator = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 1, queries, 8, generator=generator) * scores_scale).to(dtype)
    k = (torch.randn(1, 1, keys, 8, generator=generator) * scores_scale).to(dtype)
    v = torch.eye(keys, dtype=dtype)[None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_masked_softmax_is_finite_with_zero_weight_on_masked_keys(dtype: torch.dtype, scale: float) -> None:
    _, positions = pad_chunk([5, 6, 7], 2, C)
    mask = chunk_mask(positions, keys(S))
    weights = attention_weights(scale, mask, dtype)
    assert torch.isfinite(weights).all()
    assert (weights[~mask.expand_as(weights)] == 0).all()
    assert torch.allclose(weights.sum(-1), torch.ones(C), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_softmax_is_finite_at_position_zero(dtype: torch.dtype) -> None:
    mask = decode_mask(torch.tensor([[0]]), keys(S))[0:1]
    weights = attention_weights(100.0, mask, dtype)
    assert torch.isfinite(weights).all()
    assert weights[0, 0, 0, 0].item() == pytest.approx(1.0, abs=1e-2)
    assert (weights[0, 0, 0, 1:] == 0).all()


# --- sliding window: a query at position p sees keys in (p - window, p] ------------------------------------

WINDOWS = [3, C, C + 4]  # smaller than a chunk, equal to it, between one and two chunks
WINDOW_CHUNKS = [(1, 0), (C, 0), (3, 5), (C, 8), (C - 1, 9), (5, S - 5)]


def reference_window_mask(positions: list[int], cache_len: int, window: int) -> torch.Tensor:
    """The sliding-window rule key by key, with keys ``[cache positions | chunk positions]``: the chunk rule
    of `reference_chunk_mask`, and the key's position above the query's minus the window."""
    full = reference_chunk_mask(positions, cache_len)[0, 0]
    keys = list(range(cache_len)) + positions
    rows = [
        [bool(full[i, j]) and keys[j] > positions[i] - window for j in range(len(keys))] for i in range(len(positions))
    ]
    return torch.tensor(rows)[None, None]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("count", "start"), WINDOW_CHUNKS)
def test_chunk_window_mask_matches_rule(count: int, start: int, window: int) -> None:
    _, positions = pad_chunk(list(range(count)), start, C)
    mask = chunk_window_mask(positions, keys(S), window)
    assert mask.shape == (1, 1, C, S + C) and mask.dtype == torch.bool
    assert torch.equal(mask, reference_window_mask(positions[0].tolist(), S, window))
    inside = chunk_window_mask(positions, None, window)
    assert torch.equal(inside, reference_window_mask(positions[0].tolist(), 0, window))


@pytest.mark.parametrize("window", WINDOWS)
def test_chunk_straddling_the_window_edge_drops_exactly_the_old_keys(window: int) -> None:
    start = 7  # the chunk covers positions 7..14: the window's lower edge moves through the cache and the chunk
    _, positions = pad_chunk(list(range(C)), start, C)
    mask = chunk_window_mask(positions, keys(S), window)[0, 0]
    for i, p in enumerate(range(start, start + C)):
        cache_keys = [k for k in range(S) if mask[i, k]]
        chunk_keys = [start + j for j in range(C) if mask[i, S + j]]
        assert cache_keys + chunk_keys == list(range(max(0, p - window + 1), p + 1)), f"query at {p}"


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("count", [1, 3, C - 1])
def test_padded_queries_see_the_last_real_tokens_window(count: int, window: int) -> None:
    _, positions = pad_chunk(list(range(count)), 5, C)
    mask = chunk_window_mask(positions, keys(S), window)[0, 0]
    for row in range(count, C):
        assert torch.equal(mask[row], mask[count - 1])
    assert not mask[:, 5:S].any(), "a cache position at or past the chunk was visible"
    assert not mask[:, S + count :].any(), "a padded key was visible"


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window_mask_reads_the_last_window_positions(window: int) -> None:
    live = torch.arange(S)[:, None]
    mask = decode_window_mask(live, keys(S), window)
    assert mask.shape == (S, 1, 1, S)
    for p in range(S):
        assert mask[p, 0, 0].nonzero()[:, 0].tolist() == list(range(max(0, p - window + 1), p + 1))
    # an idle row sits at position 0 of the scratch block: its output is discarded, it needs a non-empty softmax row
    idle = decode_window_mask(torch.tensor([[0]]), keys(S), window)[0, 0, 0]
    assert idle.nonzero()[:, 0].tolist() == [0]


def test_window_never_empties_a_row() -> None:
    """The key at a query's own position is always inside its window: no all-masked softmax row."""
    for count, start in WINDOW_CHUNKS:
        _, positions = pad_chunk(list(range(count)), start, C)
        assert chunk_window_mask(positions, keys(S), 1)[0, 0].any(dim=-1).all()
    assert decode_window_mask(torch.arange(S)[:, None], keys(S), 1).any(dim=-1).all()
