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
"""

from __future__ import annotations

import torch

SCRATCH_BLOCK = 0
"""The block that takes the writes of tokens that are not real and that no sequence owns."""


def allocate_kv_cache(
    num_layers: int,
    blocks: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[torch.Tensor]:
    """Zero-filled K and V tensors ``[blocks, kv_heads, block_size, head_dim]`` for every layer (the scratch block
    included), allocated once by the runtime (built on the host, then moved: lazy device-side creation would change an
    XLA graph)."""
    shape = (blocks, kv_heads, block_size, head_dim)
    return [torch.zeros(shape, dtype=dtype).to(device) for _ in range(2 * num_layers)]


def write_slots(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Scatter ``new [B, H, T, D]`` into ``cache`` in place, token ``(b, t)`` at slot ``slots[b, t]``. Only slots of
    the scratch block may be written twice in one call (by tokens that are not real), and nothing reads them."""
    batch, heads, tokens, dim = new.shape
    values = new.transpose(1, 2).reshape(batch * tokens, heads, dim)
    flat, block_size = slots.reshape(-1), cache.shape[2]
    torch.ops.aten.index_put_(cache, [flat // block_size, None, flat % block_size], values)


def read_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The positions ``[0, W)`` of each row's sequence, ``W = table.shape[1] * block_size``: the blocks ``table [B, W /
    block_size]`` names, gathered in order -> ``[B, H, W, D]`` (a copy of those blocks only)."""
    _, heads, block_size, dim = cache.shape
    batch, blocks = table.shape
    gathered = cache.index_select(0, table.reshape(-1)).view(batch, blocks, heads, block_size, dim)
    return gathered.transpose(1, 2).reshape(batch, heads, blocks * block_size, dim)


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K (or V) of ``slots [N]``: ``[N, H, D]`` (inspection and tests)."""
    block_size = cache.shape[2]
    return cache[slots // block_size, :, slots % block_size]
