"""Every padding rule of the runtime, in one place (DESIGN.md invariants 4 and 9).

Used by `generate()` and by the vLLM runner alike.
"""

from __future__ import annotations

import torch

from ..errors import InputError


def pad_chunk(token_ids: list[int], start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk of ``size`` columns for real tokens ``token_ids`` starting at cache position
    ``start``: a short chunk repeats its last real token id *and* position id.

    Returns ``input_ids [1, size]`` and ``position_ids [1, size]``.
    """
    count = len(token_ids)
    if not 1 <= count <= size:
        raise InputError(f"a prefill chunk holds 1 to {size} tokens, got {count}.")
    fill = size - count
    ids = list(token_ids) + [token_ids[-1]] * fill
    positions = list(range(start, start + count)) + [start + count - 1] * fill
    return torch.tensor([ids], dtype=torch.long), torch.tensor([positions], dtype=torch.long)


def split_chunks(token_ids: list[int], start: int, size: int) -> list[tuple[list[int], int]]:
    """Split real tokens starting at position ``start`` into ``(tokens, start)`` pieces of at most ``size``."""
    return [(token_ids[i : i + size], start + i) for i in range(0, len(token_ids), size)]


def decode_rows(
    batch_size: int, active: dict[int, tuple[int, int]], sequence_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of the token-generation graph: row ``b`` is KV slot ``b``.

    ``active`` maps slot -> (token id, position) for the rows that decode. Every other row (a free
    slot, a slot half-way through its prefill, a sequence not scheduled this step) is token 0 at the
    slot's scratch position ``sequence_length``, which nothing reads (invariant 9).
    """
    ids = torch.zeros(batch_size, 1, dtype=torch.long)
    positions = torch.full((batch_size, 1), sequence_length, dtype=torch.long)
    for slot, (token, position) in active.items():
        ids[slot, 0], positions[slot, 0] = token, position
    return ids, positions


def pad_tiles(pixels: torch.Tensor, size: int) -> list[torch.Tensor]:
    """An image's tiles ``[t, 3, S, S]`` in vision-encoder batches of ``size`` tiles, the last one filled with zero
    tiles: tiles never see each other, so a filler tile changes no real tile's rows (the caller drops its rows)."""
    batches = list(torch.split(pixels, size))
    fill = size - batches[-1].shape[0]
    if fill:
        batches[-1] = torch.cat((batches[-1], batches[-1].new_zeros(fill, *pixels.shape[1:])))
    return batches


def pad_image_rows(rows: torch.Tensor, mask: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The image inputs of a prefill chunk: ``rows [n, H]`` and ``mask [n]`` of its ``n`` real columns, padded to
    ``size`` columns by repeating the last real column's row and mask value (with `pad_chunk`'s repeated token id and
    position, a padded column then computes exactly what the last real one computes: invariant 4). Returns
    ``image_embeds [1, size, H]`` and ``image_mask [1, size]``."""
    fill = size - rows.shape[0]
    rows = torch.cat((rows, rows[-1:].expand(fill, -1)))
    mask = torch.cat((mask, mask[-1:].expand(fill)))
    return rows[None], mask[None]
