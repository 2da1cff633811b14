"""The one shared KV cache: per layer a K and a V tensor ``[batch_size, kv_heads, sequence_length + 1, head_dim]``.

Graphs receive the list ``[k_0, v_0, k_1, v_1, ...]`` as an input and update it in place by
scatter at row ``(seq_id, position)`` — flat row ``seq_id * (S + 1) + position`` (DESIGN.md invariant 2).

Row ``S`` of every slot is its **scratch row** (`scratch_position`): the writes of tokens that are not
real (the padded columns of a short chunk, the rows of the token-generation graph that carry no decoding
sequence) land there, and no mask ever lets a query read it (a live query sits at a position ``< S`` and
reads keys up to its own position). So whatever a non-real token computes never reaches live data, on any
backend, whatever order it applies duplicate scatter indices in (invariants 4 and 9).
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    num_layers: int,
    batch: int,
    kv_heads: int,
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[torch.Tensor]:
    """Zero-filled K and V tensors for every layer, ``seq_len`` positions plus the scratch row per slot,
    allocated once by the runtime (built on the host, then moved: lazy device-side creation would change
    an XLA graph)."""
    shape = (batch, kv_heads, seq_len + 1, head_dim)
    return [torch.zeros(shape, dtype=dtype).to(device) for _ in range(2 * num_layers)]


def scratch_position(cache_len: int) -> int:
    """The scratch row of a cache with ``cache_len`` rows per slot: its last."""
    return cache_len - 1


def write_rows(cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> None:
    """Scatter ``new [B, H, T, D]`` into ``cache`` at ``(rows[b], positions[b, t])`` in place.

    ``rows [B]`` are KV slots, ``positions [B, T]`` cache positions. Only the scratch row may be written
    twice in one call (by tokens that are not real), and nothing reads it.
    """
    batch, _, tokens, _ = new.shape
    row_index = rows[:, None].expand(batch, tokens).reshape(-1)
    values = new.transpose(1, 2).reshape(batch * tokens, new.shape[1], new.shape[3])
    torch.ops.aten.index_put_(cache, [row_index, None, positions.reshape(-1)], values)


def read_slot(cache: torch.Tensor, seq_ids: torch.Tensor, window: int) -> torch.Tensor:
    """Positions ``[0, window)`` of the slots ``seq_ids [N]`` -> ``[N, H, window, D]`` (a KV window: only those
    rows are gathered)."""
    return cache[:, :, :window].index_select(0, seq_ids)
