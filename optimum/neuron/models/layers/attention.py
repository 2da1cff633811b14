"""Self-attention over the shared KV cache, for one graph kind at a time.

`DecodeContext` (token generation: one token per slot, row b is slot b) and `ChunkContext`
(context encoding / chunked prefill: one sequence's chunk) hold the per-call masks and positions;
each layer's `Attention` asks its context to attend and to write the new K/V into the cache.

A context holds one mask per attention window its decoder uses: the full-attention mask and one per
sliding window (`masks.chunk_window_mask`, `masks.decode_window_mask`). Each layer passes its own window
(``None``: full attention) and gets exactly that mask (`mask_for`); the cache and its writes are the same.

Reads go through the call's **KV window** ``[0, W)`` (``W = len(key_positions)``): a slice of the one cache,
never a copy of it; writes go to any position of the cache (live positions below ``W``, the scratch row beyond).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import read_slot, scratch_position, write_rows
from .masks import chunk_mask, chunk_window_mask, chunk_write_positions, decode_mask, decode_window_mask
from .rope import apply_rotary


@dataclass(frozen=True)
class AttentionDims:
    """Head layout of one attention layer."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def attention_dims(hf_config: Any) -> AttentionDims:
    """Head layout of a transformers config."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return AttentionDims(hf_config.hidden_size, heads, kv_heads, head_dim)


@dataclass
class DecodeContext:
    """Token generation: row ``b`` of the batch is KV slot ``b`` and writes at ``positions[b]`` (a row
    without a decoding sequence comes at the scratch position: `runtime.padding.decode_rows`)."""

    positions: torch.Tensor  # [B, 1]
    keys: torch.Tensor  # [W]: the cache positions of the KV window
    mask: torch.Tensor  # [B, 1, 1, W]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask

    @classmethod
    def build(cls, position_ids: torch.Tensor, keys: torch.Tensor, windows: Iterable[int] = ()) -> DecodeContext:
        windowed = {w: decode_window_mask(position_ids, keys, w) for w in windows}
        return cls(position_ids, keys, decode_mask(position_ids, keys), windowed)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with sliding window ``window`` (``None``: full attention)."""
        return self.mask if window is None else self.window_masks[window]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: list[torch.Tensor],
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend over each slot's KV window (within ``window`` positions of its own
        for a sliding-window layer)."""
        rows = torch.arange(q.shape[0], device=q.device)
        write_rows(caches[0], rows, self.positions, k)
        write_rows(caches[1], rows, self.positions, v)
        mask, size = self.mask_for(window), self.keys.shape[0]
        keys, values = caches[0][:, :, :size], caches[1][:, :, :size]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


@dataclass
class ChunkContext:
    """A prefill chunk of slot ``seq_ids[0]``; keys are ``[slot cache | chunk]``; padded columns write
    to the slot's scratch row (invariant 4)."""

    seq_ids: torch.Tensor  # [1]
    positions: torch.Tensor  # [1, C]: where each column writes
    keys: torch.Tensor | None  # [W]: the cache positions of the KV window; None: no earlier cache is read
    mask: torch.Tensor  # [1, 1, C, W + C] or [1, 1, C, C]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask

    @classmethod
    def build(
        cls,
        seq_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_len: int,
        keys: torch.Tensor | None,
        windows: Iterable[int] = (),
    ) -> ChunkContext:
        writes = chunk_write_positions(position_ids, scratch_position(cache_len))
        windowed = {w: chunk_window_mask(position_ids, keys, w) for w in windows}
        return cls(seq_ids, writes, keys, chunk_mask(position_ids, keys), windowed)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with sliding window ``window`` (``None``: full attention)."""
        return self.mask if window is None else self.window_masks[window]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: list[torch.Tensor],
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attend over the slot's KV window and the chunk's own K/V (within ``window`` positions of each query for
        a sliding-window layer), then store the chunk's K/V."""
        keys, values = k, v
        if self.keys is not None:
            size = self.keys.shape[0]
            keys = torch.cat((read_slot(caches[0], self.seq_ids, size), k), dim=2)
            values = torch.cat((read_slot(caches[1], self.seq_ids, size), v), dim=2)
        mask = self.mask_for(window)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        write_rows(caches[0], self.seq_ids, self.positions, k)
        write_rows(caches[1], self.seq_ids, self.positions, v)
        return out


AttentionContext = DecodeContext | ChunkContext


@dataclass(frozen=True)
class AttentionOptions:
    """What distinguishes one family's attention layer from plain grouped-query attention."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Callable[[int], nn.Module] | None = None
    """Builds the per-head norm of q and k (head_dim -> module), applied before rope (qwen3, Gemma 3)."""
    fused_qkv: bool = False
    """One ``qkv_proj`` matmul (Phi-3's checkpoint layout) instead of ``q_proj``, ``k_proj``, ``v_proj``."""
    scale: float | None = None
    """Softmax scale of the scores; ``None``: ``head_dim ** -0.5``."""
    window: int | None = None
    """Sliding window of this layer (keys in ``(p - window, p]``); ``None``: full attention."""


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings over the shared cache; optional qkv bias, q/k norm,
    fused qkv projection, custom scale and sliding window (`AttentionOptions`)."""

    def __init__(self, dims: AttentionDims, options: AttentionOptions) -> None:
        super().__init__()
        self.dims, self.options = dims, options
        q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
        self.split = (q_size, kv_size, kv_size)
        if options.fused_qkv:
            self.qkv_proj = nn.Linear(dims.hidden, q_size + 2 * kv_size, bias=options.qkv_bias)
        else:
            self.q_proj = nn.Linear(dims.hidden, q_size, bias=options.qkv_bias)
            self.k_proj = nn.Linear(dims.hidden, kv_size, bias=options.qkv_bias)
            self.v_proj = nn.Linear(dims.hidden, kv_size, bias=options.qkv_bias)
        self.o_proj = nn.Linear(q_size, dims.hidden, bias=options.o_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if options.qk_norm is not None:
            self.q_norm = options.qk_norm(dims.head_dim)
            self.k_norm = options.qk_norm(dims.head_dim)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, tokens, _ = x.shape
        return x.view(batch, tokens, heads, self.dims.head_dim)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.options.fused_qkv:
            q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        caches: list[torch.Tensor],
        context: AttentionContext,
    ) -> torch.Tensor:
        """``x [B, T, hidden]`` -> ``[B, T, hidden]``; ``caches`` is this layer's ``[K, V]``."""
        q, k, v = self._project(x)
        q, k = self._heads(q, self.dims.heads), self._heads(k, self.dims.kv_heads)
        v = self._heads(v, self.dims.kv_heads).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), *rope)
        k = apply_rotary(k.transpose(1, 2), *rope)
        out = context.attend(q, k, v, caches, self.options.window, self.options.scale)
        batch, tokens, _ = x.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))
