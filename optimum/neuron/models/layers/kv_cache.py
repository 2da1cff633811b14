"""The one shared, block-paged KV cache: per layer a K and a V tensor ``[kv_blocks, kv_heads, block_size, head_dim]``.

A sequence's positions live in **blocks** of ``block_size`` positions, anywhere in the cache: its **block table** lists
them in order, so position ``p`` is cache row (**slot**) ``table[p // block_size] * block_size + p % block_size``, that
is position ``slot % block_size`` of block ``slot // block_size``. Within a block each KV head's positions are
contiguous (``block_size x head_dim`` values), so a head's keys are read in runs of whole blocks. Graphs receive the
list ``[k_0, v_0, k_1, v_1, ...]`` as an input and update it in place: each token's K/V is scattered to the slot the
runtime computed for it (``slot_mapping``, `runtime.padding`), and reads gather the blocks of a row's table that lie
inside the call's KV window (DESIGN.md invariant 2, per block), or read them in place (`kernels.attention`).

Block 0 is the **scratch block** (`SCRATCH_BLOCK`): no sequence owns it (it is vLLM's null block, and the engine's
own allocator never hands it out), the writes of tokens that are not real (the padded columns of a short chunk, the
rows of the token-generation graph that carry no decoding sequence) land in it, and the block tables of those rows
(and the unused tail of every table) point at it. No mask lets a live query read a position it holds: a live query
reads only its own sequence's positions up to its own. So whatever a non-real token computes never reaches live data,
on any backend, whatever order it applies duplicate scatter indices in (invariants 4 and 9).

An **int8 cache** (``--kv_cache_dtype int8``) holds per layer ``[K, V, K scales, V scales]``: K and V as int8 in the
same block layout, and one float32 scale per token and KV head, ``[kv_blocks, kv_heads, block_size]``, written at the
same slots (`quantize_kv`: symmetric, ``scale = max|x| / 127`` over the head's values, computed in the graph). Each
token is quantized on its own, so a padded column still writes exactly what the real last token writes. Reads
dequantize (`dequantize_kv`) what they gather; the CPU decode kernel dequantizes each row as it reads it instead.
"""

from __future__ import annotations

import torch

SCRATCH_BLOCK = 0
"""The block that takes the writes of tokens that are not real and that no sequence owns."""
INT8_LIMIT = 127
"""The largest magnitude of an int8 cache value (symmetric: -127..127)."""


def tensors_per_layer(int8: bool) -> int:
    """Tensors of one layer in the cache list: ``[K, V]``, or for an int8 cache ``[K, V, K scales, V scales]``."""
    return 4 if int8 else 2


def allocate_kv_cache(
    num_layers: int,
    blocks: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    int8: bool = False,
) -> list[torch.Tensor]:
    """Zero-filled K and V tensors ``[blocks, kv_heads, block_size, head_dim]`` for every layer (the scratch block
    included), allocated once by the runtime (built on the host, then moved: lazy device-side creation would change an
    XLA graph). ``int8``: K and V of int8, then their float32 scales ``[blocks, kv_heads, block_size]``."""
    shape = (blocks, kv_heads, block_size, head_dim)
    if not int8:
        return [torch.zeros(shape, dtype=dtype).to(device) for _ in range(2 * num_layers)]
    layer = [(shape, torch.int8), (shape, torch.int8), (shape[:3], torch.float32), (shape[:3], torch.float32)]
    return [torch.zeros(size, dtype=kind).to(device) for _ in range(num_layers) for size, kind in layer]


def cache_bytes(cache: list[torch.Tensor]) -> int:
    """Bytes the tensors of a KV cache list hold (values and, for an int8 cache, scales)."""
    return sum(t.numel() * t.element_size() for t in cache)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> int8 values ``[..., D]`` and float32 scales ``[...]``, per vector: ``scale = max|x| / 127``,
    ``q = round(x / scale)`` (half to even) clamped to ±127, in float32; a zero vector gets scale 0 and zeros."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_LIMIT
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x / divisor.unsqueeze(-1)).clamp(-INT8_LIMIT, INT8_LIMIT)
    return q.to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float(q) * scale`` (one float32 multiply per value, what the CPU kernel computes) in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Scatter ``new [B, H, T, D]`` (or scales ``[B, H, T]``) into ``cache`` in place, token ``(b, t)`` at slot
    ``slots[b, t]``. Only slots of the scratch block may be written twice in one call (by tokens that are not real),
    and nothing reads them."""
    batch, heads, tokens = new.shape[:3]
    values = new.transpose(1, 2).reshape(batch * tokens, heads, *new.shape[3:])
    flat, block_size = slots.reshape(-1), cache.shape[2]
    torch.ops.aten.index_put_(cache, [flat // block_size, None, flat % block_size], values)


def stored_kv(caches: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """What one layer's cache stores of new ``k``, ``v [B, H, T, D]``, tensor for tensor of ``caches``: ``[k, v]``, or
    for an int8 cache (four tensors) ``[K values, V values, K scales, V scales]`` (`quantize_kv`)."""
    if len(caches) == 2:
        return [k, v]
    (qk, sk), (qv, sv) = quantize_kv(k), quantize_kv(v)
    return [qk, qv, sk, sv]


def readable(stored: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as attention reads them from one layer's stored form (`stored_kv`, or blocks of the cache gathered):
    as they are, or dequantized into ``dtype`` (`dequantize_kv`)."""
    if len(stored) == 2:
        return stored[0], stored[1]
    return dequantize_kv(stored[0], stored[2], dtype), dequantize_kv(stored[1], stored[3], dtype)


def write_stored(caches: list[torch.Tensor], slots: torch.Tensor, stored: list[torch.Tensor]) -> None:
    """Scatter one layer's stored form (`stored_kv`) into its cache tensors at ``slots``."""
    for cache, new in zip(caches, stored, strict=True):
        write_slots(cache, slots, new)


def read_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The positions ``[0, W)`` of each row's sequence, ``W = table.shape[1] * block_size``: the blocks ``table [B, W /
    block_size]`` names, gathered in order -> ``[B, H, W, D]`` (scales: ``[B, H, W]``; a copy of those blocks only)."""
    heads, block_size, rest = cache.shape[1], cache.shape[2], cache.shape[3:]
    batch, blocks = table.shape
    gathered = cache.index_select(0, table.reshape(-1)).view(batch, blocks, heads, block_size, *rest)
    return gathered.transpose(1, 2).reshape(batch, heads, blocks * block_size, *rest)


def read_kv(caches: list[torch.Tensor], table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values of the window ``table`` names (`read_blocks`), as attention reads them
    (`readable`)."""
    return readable([read_blocks(cache, table) for cache in caches], dtype)


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K (or V) of ``slots [N]``: ``[N, H, D]`` (scales: ``[N, H]``; inspection and tests)."""
    block_size = cache.shape[2]
    return cache[slots // block_size, :, slots % block_size]
