"""Attention masks and the write positions of a chunk (boolean masks, True = attend). The only place
masking rules live (invariant 4).

Masked positions are excluded by the attention kernel; no dtype minimum is ever fed to ``exp``
(invariant 7).

Sliding-window layers (mistral, qwen2 ``max_window_layers``, Gemma 3 local layers, ...) use the same masks
restricted by `within_window`: a query at position ``p`` sees keys in ``(p - window, p]``. A padded query
repeats the last real token's position, so it still sees exactly that token's keys.

A graph reads the cache through a **KV window** (a KV-length bucket): positions ``[0, W)`` of each sequence, the
first ``W / block_size`` blocks of its block table (`kv_cache.read_blocks`), whose positions are ``keys = arange(W)``;
the engine picks a ``W`` that covers every position the call reads, so the masks below never need a key beyond it.
Where the K/V of a token that is not real is written (the scratch block) is the runtime's rule
(`runtime.padding.slot_mapping`), not a mask.
"""

from __future__ import annotations

import torch


def actual_tokens_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``[B, T]``: True where a token is real, i.e. its position id is strictly larger
    than its predecessor's; index 0 is always real. Padding repeats the last real position."""
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    return torch.cat((first, position_ids[:, 1:] > position_ids[:, :-1]), dim=1)


def chunk_mask(position_ids: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
    """Mask of chunks ``position_ids [B, C]`` (one prefill chunk, ``B = 1``; or each row's tokens of a verification
    call) over keys ``[cache window | chunk (C)]``, the window's cache positions being ``keys [W]`` (``None``: the
    graph reads no earlier cache).

    A query attends to its sequence's cache positions before its row's first position, and to its row's keys that
    are causal and real. A padded query (duplicate of the last real token) therefore sees exactly the keys the real
    last token sees. Result: ``[B, 1, C, W + C]`` (or ``[B, 1, C, C]`` without ``keys``).
    """
    tokens = position_ids.shape[1]
    index = torch.arange(tokens, device=position_ids.device)
    causal = index[None, :] <= index[:, None]
    inside = causal[None] & actual_tokens_mask(position_ids)[:, None, :]
    if keys is None:
        return inside[:, None]
    prior = (keys[None, None, :] < position_ids[:, :1, None]).expand(-1, tokens, -1)
    return torch.cat((prior, inside), dim=2)[:, None]


def decode_mask(position_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Mask of one new token per slot, ``position_ids [B, 1]``, over the cache positions ``keys [W]`` of the
    window: keys up to its own position. Result: ``[B, 1, 1, W]``."""
    return (keys[None, :] <= position_ids)[:, None, None, :]


def within_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window rule: ``[B, T]`` query positions x key positions (``[K]`` shared by every row, or ``[B, K]``)
    -> ``[B, 1, T, K]``, True where ``key > query - window``: the lower end of the window ``(query - window, query]``
    (its upper end, causality, is the rule of `chunk_mask` and `decode_mask`)."""
    keys = key_positions if key_positions.dim() == 2 else key_positions[None]
    return (keys[:, None, :] > query_positions[:, :, None] - window)[:, None]


def chunk_window_mask(position_ids: torch.Tensor, keys: torch.Tensor | None, window: int) -> torch.Tensor:
    """`chunk_mask` of a sliding-window layer: keys ``[cache window (keys) | chunk (C)]`` are also limited to
    the ``window`` positions ending at each query's own. Same shape as `chunk_mask`."""
    rows = position_ids.shape[0]
    all_keys = position_ids if keys is None else torch.cat((keys[None].expand(rows, -1), position_ids), dim=1)
    return chunk_mask(position_ids, keys) & within_window(position_ids, all_keys, window)


def decode_window_mask(position_ids: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """`decode_mask` of a sliding-window layer: cache keys in ``(position - window, position]``.
    Result: ``[B, 1, 1, W]``."""
    return decode_mask(position_ids, keys) & within_window(position_ids, keys, window)
