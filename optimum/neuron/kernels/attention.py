"""``optimum_neuron::paged_attention``: the decode attention of the token-generation graph on the CPU, read from the
paged KV cache in place.

One new token per row attends over its sequence's KV window: the blocks its block table names, read where they lie
(``csrc/paged_attention.cpp``), instead of gathering the window into a copy for ``scaled_dot_product_attention`` (at
batch 8 and a 2,000-token context that copy and the strided attention after it made a decode step cost 2.7x the slot
layout's: `benchmark/paged.py`). Which keys a row attends is the caller's mask (`models.layers.masks`), passed as
``[B, W]`` booleans: the kernel holds no mask rule of its own. fp32 on the CPU, eager and inductor (`NeuronConfig`
``attention_kernel``); everything else runs the gather and torch's attention.

``optimum_neuron::paged_attention_int8`` is the same attention over an int8 cache (``--kv_cache_dtype int8``): int8 K
and V with one float32 scale per key and KV head, each key and value dequantized as it is read (``float(q) * scale``
into L1-resident rows shared by the group's query heads), so a decode step streams a quarter of the fp32 cache's
bytes (plus the scales), and the result is bitwise the float kernel's on the dequantized cache.

``optimum_neuron::chunk_attention`` is the attention of a prefill chunk (or of a verification call's rows) over its
window, read from the paged cache in place, and over the chunk's own keys (``csrc/chunk_attention.cpp``): both products
run through the panel GEMM of the linear layers, the queries of a 64-token tile sharing each key and value they read,
and a tile reads no chunk key past its last query (causality). Torch's CPU flash attention, which it replaces there,
spent a third of a 1,024-token prefill of SmolLM2 (`benchmark/prefill.py`).
"""

from __future__ import annotations

import torch

OPERATOR = "optimum_neuron::paged_attention"
INT8_OPERATOR = "optimum_neuron::paged_attention_int8"
CHUNK_OPERATOR = "optimum_neuron::chunk_attention"

torch.library.define(
    OPERATOR,
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor mask, float scale) -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
"""``q [B, Hq, 1, D]``, caches ``[blocks, Hk, block_size, D]``, ``block_table [B, nb]`` int64, ``mask [B, nb *
block_size]`` bool -> ``[B, Hq, 1, D]``. ``flexible_layout``: the kernel reads a contiguous view of ``q`` and its
other inputs as given."""


@torch.library.register_fake(OPERATOR)
def _output_shape(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``softmax(q K^T * scale) V`` of each row's query heads over the keys ``mask`` leaves in its window (grouped-query
    attention: query head h uses KV head ``h // (Hq / Hk)``), K and V read through ``block_table`` from the caches."""
    return torch.ops.optimum_neuron.paged_attention(q, k_cache, v_cache, block_table, mask, scale)


torch.library.define(
    INT8_OPERATOR,
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, Tensor block_table, Tensor mask, "
    "float scale) -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
"""As `OPERATOR`, the caches int8 ``[blocks, Hk, block_size, D]`` with float32 scales ``[blocks, Hk, block_size]``."""


@torch.library.register_fake(INT8_OPERATOR)
def _int8_output_shape(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    block_table: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape)


def paged_attention_int8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention` over an int8 cache: K and V are ``float(k_cache) * k_scale`` and ``float(v_cache) *
    v_scale``, dequantized row by row as they are read."""
    return torch.ops.optimum_neuron.paged_attention_int8(
        q, k_cache, v_cache, k_scale, v_scale, block_table, mask, scale
    )


torch.library.define(
    CHUNK_OPERATOR,
    "(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor? block_table, Tensor mask, float scale) "
    "-> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
"""``q [B, Hq, C, D]``, the chunk's ``k``, ``v [B, Hk, C, D]``, caches ``[blocks, Hk, block_size, D]``, ``block_table
[B, nb]`` int64 or None (no earlier cache read), ``mask [B, 1, C, nb * block_size + C]`` bool over ``[window | chunk]``
-> ``[B, Hq, C, D]``."""


@torch.library.register_fake(CHUNK_OPERATOR)
def _chunk_output_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor | None, mask: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape)


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``softmax(q K^T * scale) V`` of each chunk query over the keys ``mask`` leaves in ``[its window | the chunk]``
    (grouped-query attention as `paged_attention`), the window read through ``block_table`` from the caches. A query
    never attends a chunk key after its own (causality: the mask rule of `models.layers.masks.chunk_mask`); a query
    that attends no key gets zeros."""
    return torch.ops.optimum_neuron.chunk_attention(q, k, v, k_cache, v_cache, block_table, mask, scale)
