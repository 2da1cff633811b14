"""Self-attention over the shared KV cache, for one graph kind at a time.

`DecodeContext` (token generation: one token per slot, row b is slot b) and `ChunkContext`
(context encoding / chunked prefill: one sequence's chunk) hold the per-call masks and positions;
each layer's `Attention` asks its context to attend and to write the new K/V into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import read_slot, scratch_position, write_rows
from .masks import chunk_mask, chunk_write_positions, decode_mask
from .norm import RMSNorm
from .rope import apply_rotary


@dataclass(frozen=True)
class AttentionDims:
    """Head layout of one attention layer."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass
class DecodeContext:
    """Token generation: row ``b`` of the batch is KV slot ``b`` and writes at ``positions[b]`` (a row
    without a decoding sequence comes at the scratch position: `runtime.padding.decode_rows`)."""

    positions: torch.Tensor  # [B, 1]
    mask: torch.Tensor  # [B, 1, 1, S + 1]

    @classmethod
    def build(cls, position_ids: torch.Tensor, cache_len: int) -> DecodeContext:
        return cls(position_ids, decode_mask(position_ids, cache_len))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        """Write this step's K/V, then attend over each slot's whole cache."""
        rows = torch.arange(q.shape[0], device=q.device)
        write_rows(caches[0], rows, self.positions, k)
        write_rows(caches[1], rows, self.positions, v)
        return F.scaled_dot_product_attention(q, caches[0], caches[1], attn_mask=self.mask, enable_gqa=True)


@dataclass
class ChunkContext:
    """A prefill chunk of slot ``seq_ids[0]``; keys are ``[slot cache | chunk]``; padded columns write
    to the slot's scratch row (invariant 4)."""

    seq_ids: torch.Tensor  # [1]
    positions: torch.Tensor  # [1, C]: where each column writes
    mask: torch.Tensor  # [1, 1, C, S + 1 + C] or [1, 1, C, C]
    reads_prior: bool

    @classmethod
    def build(
        cls, seq_ids: torch.Tensor, position_ids: torch.Tensor, cache_len: int, reads_prior: bool
    ) -> ChunkContext:
        writes = chunk_write_positions(position_ids, scratch_position(cache_len))
        return cls(seq_ids, writes, chunk_mask(position_ids, cache_len, reads_prior), reads_prior)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        """Attend over the slot's earlier cache and the chunk's own K/V, then store the chunk's K/V."""
        keys, values = k, v
        if self.reads_prior:
            keys = torch.cat((read_slot(caches[0], self.seq_ids), k), dim=2)
            values = torch.cat((read_slot(caches[1], self.seq_ids), v), dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)
        write_rows(caches[0], self.seq_ids, self.positions, k)
        write_rows(caches[1], self.seq_ids, self.positions, v)
        return out


AttentionContext = DecodeContext | ChunkContext


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings, optional q/k RMSNorm (qwen3) and qkv bias."""

    def __init__(self, dims: AttentionDims, qkv_bias: bool, o_bias: bool, qk_norm_eps: float | None) -> None:
        super().__init__()
        self.dims = dims
        self.q_proj = nn.Linear(dims.hidden, dims.heads * dims.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dims.hidden, dims.kv_heads * dims.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dims.hidden, dims.kv_heads * dims.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(dims.heads * dims.head_dim, dims.hidden, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(dims.head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(dims.head_dim, qk_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, tokens, _ = x.shape
        return x.view(batch, tokens, heads, self.dims.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        caches: list[torch.Tensor],
        context: AttentionContext,
    ) -> torch.Tensor:
        """``x [B, T, hidden]`` -> ``[B, T, hidden]``; ``caches`` is this layer's ``[K, V]``."""
        q = self._heads(self.q_proj(x), self.dims.heads)
        k = self._heads(self.k_proj(x), self.dims.kv_heads)
        v = self._heads(self.v_proj(x), self.dims.kv_heads).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), *rope)
        k = apply_rotary(k.transpose(1, 2), *rope)
        out = context.attend(q, k, v, caches)
        batch, tokens, _ = x.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))
