"""Attention masks and the write positions of a chunk (boolean masks, True = attend). The only place
masking rules live (invariant 4).

Masked positions are excluded by the attention kernel; no dtype minimum is ever fed to ``exp``
(invariant 7).

Sliding-window layers (mistral, qwen2 ``max_window_layers``, Gemma 3 local layers, ...) use the same masks
restricted by `within_window`: a query at position ``p`` sees keys in ``(p - window, p]``. A padded query
repeats the last real token's position, so it still sees exactly that token's keys.
"""

from __future__ import annotations

import torch


def actual_tokens_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``[B, T]``: True where a token is real, i.e. its position id is strictly larger
    than its predecessor's; index 0 is always real. Padding repeats the last real position."""
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    return torch.cat((first, position_ids[:, 1:] > position_ids[:, :-1]), dim=1)


def chunk_write_positions(position_ids: torch.Tensor, scratch: int) -> torch.Tensor:
    """Where each column of a prefill chunk ``position_ids [1, C]`` writes its K/V: its position when the
    token is real, the slot's scratch row ``scratch`` when it is padding (invariant 4)."""
    return torch.where(actual_tokens_mask(position_ids), position_ids, torch.full_like(position_ids, scratch))


def chunk_mask(position_ids: torch.Tensor, cache_len: int, reads_prior: bool) -> torch.Tensor:
    """Mask of a prefill chunk ``position_ids [1, C]`` over keys ``[cache (cache_len) | chunk (C)]``.

    A query attends to cache positions before the chunk's first position (never the scratch row), and
    to chunk keys that are causal and real. A padded query (duplicate of the last real token) therefore
    sees exactly the keys the real last token sees. Without ``reads_prior`` only the chunk part is
    returned. Result: ``[1, 1, C, cache_len + C]`` (or ``[1, 1, C, C]``).
    """
    tokens = position_ids.shape[1]
    index = torch.arange(tokens, device=position_ids.device)
    causal = index[None, :] <= index[:, None]
    inside = causal & actual_tokens_mask(position_ids)[0][None, :]
    if not reads_prior:
        return inside[None, None]
    keys = torch.arange(cache_len, device=position_ids.device)
    prior = (keys < position_ids[0, 0])[None, :].expand(tokens, cache_len)
    return torch.cat((prior, inside), dim=1)[None, None]


def decode_mask(position_ids: torch.Tensor, cache_len: int) -> torch.Tensor:
    """Mask of one new token per slot, ``position_ids [B, 1]``: cache keys up to its own position (a live
    token's position is below the scratch row). Result: ``[B, 1, 1, cache_len]``."""
    keys = torch.arange(cache_len, device=position_ids.device)
    return (keys[None, :] <= position_ids)[:, None, None, :]


def within_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window rule: ``[B, T]`` query positions x ``[K]`` key positions -> ``[B, 1, T, K]``, True
    where ``key > query - window``: the lower end of the window ``(query - window, query]`` (its upper end,
    causality, is the rule of `chunk_mask` and `decode_mask`)."""
    return (key_positions[None, None, :] > query_positions[:, :, None] - window)[:, None]


def chunk_window_mask(position_ids: torch.Tensor, cache_len: int, reads_prior: bool, window: int) -> torch.Tensor:
    """`chunk_mask` of a sliding-window layer: keys ``[cache (cache_len) | chunk (C)]`` are also limited to
    the ``window`` positions ending at each query's own. Same shape as `chunk_mask`."""
    keys = position_ids[0]
    if reads_prior:
        keys = torch.cat((torch.arange(cache_len, device=position_ids.device), keys))
    return chunk_mask(position_ids, cache_len, reads_prior) & within_window(position_ids, keys, window)


def decode_window_mask(position_ids: torch.Tensor, cache_len: int, window: int) -> torch.Tensor:
    """`decode_mask` of a sliding-window layer: cache keys in ``(position - window, position]``.
    Result: ``[B, 1, 1, cache_len]``."""
    keys = torch.arange(cache_len, device=position_ids.device)
    return decode_mask(position_ids, cache_len) & within_window(position_ids, keys, window)
