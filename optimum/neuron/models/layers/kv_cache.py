"""The one shared, block-paged KV cache: per layer a K and a V tensor ``[kv_blocks * block_size, kv_heads, head_dim]``.

A sequence's positions live in **blocks** of ``block_size`` positions, anywhere in the cache: its **block table** lists
them in order, so position ``p`` is cache row (**slot**) ``table[p // block_size] * block_size + p % block_size``.
Graphs receive the list ``[k_0, v_0, k_1, v_1, ...]`` as an input and update it in place: each token's K/V is
scattered to the slot the runtime computed for it (``slot_mapping``, `runtime.padding`), and reads gather the blocks
of a row's table that lie inside the call's KV window (DESIGN.md invariant 2, per block).

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
    slots: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[torch.Tensor]:
    """Zero-filled K and V tensors ``[slots, kv_heads, head_dim]`` for every layer (``slots``: blocks x block size, the
    scratch block included), allocated once by the runtime (built on the host, then moved: lazy device-side creation
    would change an XLA graph)."""
    shape = (slots, kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype).to(device) for _ in range(2 * num_layers)]


def write_slots(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Scatter ``new [B, H, T, D]`` into ``cache`` in place, token ``(b, t)`` at cache row ``slots[b, t]``. Only slots
    of the scratch block may be written twice in one call (by tokens that are not real), and nothing reads them."""
    batch, heads, tokens, dim = new.shape
    values = new.transpose(1, 2).reshape(batch * tokens, heads, dim)
    torch.ops.aten.index_put_(cache, [slots.reshape(-1)], values)


def read_blocks(cache: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The positions ``[0, W)`` of each row's sequence, ``W = table.shape[1] * block_size``: the blocks ``table [B, W /
    block_size]`` names, gathered in order -> ``[B, H, W, D]`` (a copy of those blocks only)."""
    slots, heads, dim = cache.shape
    batch, blocks = table.shape
    by_block = cache.view(slots // block_size, block_size * heads * dim)
    gathered = by_block.index_select(0, table.reshape(-1))
    return gathered.view(batch, blocks * block_size, heads, dim).transpose(1, 2)
