"""Self-attention over the shared paged KV cache, for one graph kind at a time.

`DecodeContext` (token generation: one token per batch row), `ChunkContext` (context encoding / chunked prefill:
one sequence's chunk; verification rows off the CPU kernels), `VerifyContext` (verification on the CPU kernels:
each row's columns as token-generation queries) and `MixedContext` (the mixed graph: token generation's rows and a
chunk in one call) hold the per-call masks, the cache slot each token writes and the
block table each row reads; each layer's `Attention` asks its context to attend and to write the new K/V into the cache.

A context holds one mask per attention window its decoder uses: the full-attention mask and one per
sliding window (`masks.chunk_window_mask`, `masks.decode_window_mask`). Each layer passes its own window
(``None``: full attention) and gets exactly that mask (`mask_for`); the cache and its writes are the same.

Reads go through the call's **KV window** ``[0, W)``: the first ``W / block_size`` blocks of each row's table,
gathered (`kv_cache.read_blocks`), or for token generation on the CPU read in place by the paged attention kernel
(`kernels.attention`); writes go to each token's slot (`slot_mapping`: a live position of the
sequence's blocks, or the scratch block for a token that is not real). Attention reads every key and value as the
cache holds it, the chunk's own too: an int8 cache's dequantized (`kv_cache.stored_kv`, `kv_cache.readable`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.attention import chunk_attention, paged_attention, paged_attention_int8
from .kv_cache import read_kv, readable, stored_kv, write_stored
from .masks import chunk_mask, chunk_window_mask, decode_mask, decode_window_mask
from .packed_linear import project
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


def window_keys(table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The positions ``[0, W)`` a block table ``[B, W / block_size]`` covers: the keys of the call's KV window."""
    return torch.arange(table.shape[1] * block_size, device=table.device)


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """The scale of the scores the CPU kernels take: ``scale``, or ``head_dim ** -0.5`` (SDPA's default) for None."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``q [B, H, T, D]`` over ``keys`` / ``values [B, KV, L, D]`` (``H`` a multiple
    of ``KV``: each KV head serves ``H / KV`` query heads) under the boolean ``mask``. On the CPU, SDPA's ``enable_gqa``
    reads the KV heads as they are. On CUDA the KV heads are repeated to ``H`` first, by ``index_select``: there SDPA
    with ``enable_gqa`` and a boolean mask decomposes to its math path, which repeats them with ``repeat_interleave``,
    and that one expands an unsqueezed dimension whose contiguity check gives ``torch.export`` a guard on the symbolic
    KV window it cannot prove (torch 2.11, docs/cuda.md)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    kv_head = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // keys.shape[1])
    keys, values = keys.index_select(1, kv_head), values.index_select(1, kv_head)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


@dataclass
class DecodeContext:
    """Token generation: row ``b`` decodes the sequence whose blocks ``table[b]`` lists and writes its token at cache
    row ``slots[b]`` (a row without a decoding sequence has an all-scratch table and slot:
    `runtime.padding.decode_rows`)."""

    slots: torch.Tensor  # [B, 1]
    table: torch.Tensor  # [B, W / block_size]
    block_size: int
    mask: torch.Tensor  # [B, 1, 1, W]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask
    kernel: bool = False
    """Attend with the paged CPU kernel (`kernels.attention`), reading the window's blocks in place, instead of a
    gather and ``scaled_dot_product_attention``."""

    @classmethod
    def build(
        cls,
        position_ids: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        block_size: int,
        windows: Iterable[int] = (),
        kernel: bool = False,
    ) -> DecodeContext:
        keys = window_keys(table, block_size)
        windowed = {w: decode_window_mask(position_ids, keys, w) for w in windows}
        return cls(slots, table, block_size, decode_mask(position_ids, keys), windowed, kernel)

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
        """Write this step's K/V, then attend over each row's KV window (within ``window`` positions of its own
        for a sliding-window layer)."""
        write_stored(caches, self.slots, stored_kv(caches, k, v))
        return self.read(q, caches, window, scale)

    def read(
        self, q: torch.Tensor, caches: list[torch.Tensor], window: int | None = None, scale: float | None = None
    ) -> torch.Tensor:
        """Attend ``q [B, Hq, 1, D]`` over each row's KV window as the cache holds it (the K/V of this step already
        written)."""
        mask = self.mask_for(window)
        if self.kernel:
            rows = mask.reshape(mask.shape[0], mask.shape[-1])
            factor = softmax_scale(q, scale)
            if len(caches) == 4:  # int8 values and their scales, dequantized as read
                k_cache, v_cache, k_scale, v_scale = caches
                return paged_attention_int8(q, k_cache, v_cache, k_scale, v_scale, self.table, rows, factor)
            return paged_attention(q, caches[0], caches[1], self.table, rows, factor)
        keys, values = read_kv(caches, self.table, q.dtype)
        return grouped_attention(q, keys, values, mask, scale)


@dataclass
class ChunkContext:
    """A prefill chunk of one sequence (``B = 1``), or the tokens of each row of a verification call (row ``b``: a
    sequence's last token and the tokens proposed after it); keys are ``[its KV window | the row's tokens]``; each
    column writes at ``slots[b, t]`` (padded columns: the scratch block, invariant 4)."""

    slots: torch.Tensor  # [B, C]
    table: torch.Tensor | None  # [B, W / block_size]; None: no earlier cache is read (context encoding)
    block_size: int
    mask: torch.Tensor  # [B, 1, C, W + C] or [B, 1, C, C]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask
    kernel: bool = False
    """Attend with the chunk CPU kernel (`kernels.attention.chunk_attention`), reading the window's blocks in place,
    instead of a gather and ``scaled_dot_product_attention`` (a float cache; an int8 one keeps the gather)."""

    @classmethod
    def build(
        cls,
        position_ids: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor | None,
        block_size: int,
        windows: Iterable[int] = (),
        kernel: bool = False,
    ) -> ChunkContext:
        keys = None if table is None else window_keys(table, block_size)
        windowed = {w: chunk_window_mask(position_ids, keys, w) for w in windows}
        return cls(slots, table, block_size, chunk_mask(position_ids, keys), windowed, kernel)

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
        """Attend over the sequence's KV window and the chunk's own K/V (within ``window`` positions of each query for
        a sliding-window layer), then store the chunk's K/V."""
        stored = stored_kv(caches, k, v)
        if self.reads_after_write(caches):
            # Written first, as token generation does: the kernel then reads the cache after the write (a data
            # dependency), so inductor updates the cache in place. Read before it, the write was compiled in place or
            # into a full copy of the layer's cache depending on what the compiling process had compiled before.
            write_stored(caches, self.slots, stored)
            return self.read(q, k, stored, caches, window, scale)
        out = self.read(q, k, stored, caches, window, scale)
        write_stored(caches, self.slots, stored)
        return out

    def reads_after_write(self, caches: list[torch.Tensor]) -> bool:
        """Whether `attend` writes the chunk's K/V before it reads: with the chunk kernel over a float cache (whose
        stored K/V are the chunk's own as they are)."""
        return self.kernel and len(caches) == 2

    def read(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        stored: list[torch.Tensor],
        caches: list[torch.Tensor],
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attend ``q`` over the window's blocks as the cache holds them and over the chunk's own K/V, ``stored``
        (`kv_cache.stored_kv` of ``k`` and its values), before or after the chunk's write: the keys the chunk writes
        inside its window are masked for every query (they are not before the chunk's first position), so they weigh
        exactly 0 either way."""
        mask = self.mask_for(window)
        if self.reads_after_write(caches):
            return chunk_attention(q, k, stored[1], caches[0], caches[1], self.table, mask, softmax_scale(q, scale))
        keys, values = readable(stored, k.dtype)
        if self.table is not None:
            earlier_keys, earlier_values = read_kv(caches, self.table, k.dtype)
            keys, values = torch.cat((earlier_keys, keys), dim=2), torch.cat((earlier_values, values), dim=2)
        return grouped_attention(q, keys, values, mask, scale)


@dataclass
class VerifyContext:
    """A verification call on the CPU kernels: column ``t`` of row ``b`` (a sequence's last token or a proposed one)
    attends like a token-generation query at its own position, `DecodeContext` over the ``B * C`` columns, each reading
    its row's block table with the paged kernel, once every column's K/V is written at ``slots[b, t]`` (a padded
    column repeats the last real one's token and position, and writes to the scratch block: invariant 4). The chunk
    kernel, built for long chunks, transposes each row's window values once per call and fills 16-column panels: for a
    handful of columns per row it cost 3.5x the paged kernel's time at batch 8 (docs/speculative.md)."""

    slots: torch.Tensor  # [B, C]
    columns: DecodeContext  # one row per column, [B * C]

    @classmethod
    def build(
        cls,
        position_ids: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        block_size: int,
        windows: Iterable[int] = (),
        packed: bool = False,
    ) -> VerifyContext:
        """``table``: a row's blocks per row ``[B, W / block_size]``, or with ``packed`` (``B = 1``, the columns of
        every sequence one after another: `GraphSpec.packed`) a column's blocks per column ``[C, W / block_size]``."""
        rows, cols = position_ids.shape
        per_column = table
        if not packed:
            per_column = table[:, None, :].expand(rows, cols, table.shape[1]).reshape(rows * cols, table.shape[1])
        flat = position_ids.reshape(rows * cols, 1)
        columns = DecodeContext.build(flat, slots.reshape(rows * cols, 1), per_column, block_size, windows, True)
        return cls(slots, columns)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: list[torch.Tensor],
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Write every column's K/V, then attend each column over its row's window up to its own position (within
        ``window`` positions for a sliding-window layer); ``q [B, Hq, C, D]`` -> ``[B, Hq, C, D]``."""
        write_stored(caches, self.slots, stored_kv(caches, k, v))
        rows, heads, cols, dim = q.shape
        out = self.columns.read(q.transpose(1, 2).reshape(rows * cols, heads, 1, dim), caches, window, scale)
        return out.reshape(rows, cols, heads, dim).transpose(1, 2)


@dataclass
class MixedContext:
    """The mixed graph (``--mixed_batch``): its one row of tokens holds the ``rows`` token-generation rows first, one
    token each, attending as `DecodeContext` does, then one prefill chunk, attending as `ChunkContext` does. Every
    column's K/V is written before either part reads (the decode rows and the chunk are different sequences: no column
    reads a block another one writes, but the scratch block nobody reads)."""

    decode: DecodeContext
    chunk: ChunkContext
    rows: int

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: list[torch.Tensor],
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``q [1, Hq, rows + T, D]`` (``k``, ``v``: ``[1, Hk, rows + T, D]``) -> ``[1, Hq, rows + T, D]``."""
        b = self.rows

        def decode_rows(x: torch.Tensor) -> torch.Tensor:  # [1, H, rows, D] -> [rows, H, 1, D]
            return x[:, :, :b].transpose(0, 2)

        chunk_k, chunk_v = k[:, :, b:], v[:, :, b:]
        write_stored(caches, self.decode.slots, stored_kv(caches, decode_rows(k), decode_rows(v)))
        stored = stored_kv(caches, chunk_k, chunk_v)
        write_stored(caches, self.chunk.slots, stored)
        decoded = self.decode.read(decode_rows(q), caches, window, scale)
        chunked = self.chunk.read(q[:, :, b:], chunk_k, stored, caches, window, scale)
        return torch.cat((decoded.transpose(0, 2), chunked), dim=2)


AttentionContext = DecodeContext | ChunkContext | VerifyContext | MixedContext


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
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        caches: list[torch.Tensor],
        context: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, T, hidden]`` -> ``[B, T, hidden]``; ``caches`` is this layer's ``[K, V]``. With ``rows`` (indices
        into T), only those tokens' outputs go through the output projection: ``[B, len(rows), hidden]``; every token
        still attends and writes its K/V (`kept_rows`)."""
        q, k, v = self._project(x)
        q, k = self._heads(q, self.dims.heads), self._heads(k, self.dims.kv_heads)
        v = self._heads(v, self.dims.kv_heads).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), *rope)
        k = apply_rotary(k.transpose(1, 2), *rope)
        out = context.attend(q, k, v, caches, self.options.window, self.options.scale)
        batch, tokens, _ = x.shape
        return self.o_proj(kept_rows(out.transpose(1, 2).reshape(batch, tokens, -1), rows))


def kept_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``x [B, T, ...]`` at token indices ``rows`` (all of them: None). The last layer of a graph that returns only
    some tokens' logits (a prefill chunk's last real token, a mixed call's decode rows and that token) computes past
    its attention only for those rows: every op there is row-wise (the packed products' sums depend on the row only),
    so the kept rows' values are those of the whole computation, and the other rows' output projection and MLP are
    not run (SmolLM2: 84 % of a layer's products, 1 / 30 of a chunk's)."""
    return x if rows is None else x.index_select(1, rows)
