"""Every padding rule of the runtime, in one place (DESIGN.md invariants 4 and 9).

Used by `generate()` and by the vLLM runner alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..errors import InputError
from ..models.layers.kv_cache import SCRATCH_BLOCK

SCRATCH_SLOT = 0
"""The cache row every write of a token that is not real goes to: the scratch block's first (nothing reads it)."""


def pad_chunk(token_ids: list[int], start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk of ``size`` columns for real tokens ``token_ids`` starting at cache position
    ``start``: a short chunk repeats its last real token id *and* position id.

    Returns ``input_ids [1, size]`` and ``position_ids [1, size]``.
    """
    ids, positions = _padded(token_ids, start, size)
    return torch.tensor([ids], dtype=torch.long), torch.tensor([positions], dtype=torch.long)


def _padded(token_ids: Sequence[int], start: int, size: int) -> tuple[list[int], list[int]]:
    """`pad_chunk`'s rule on lists: the token ids and position ids of the ``size`` columns."""
    count = len(token_ids)
    if not 1 <= count <= size:
        raise InputError(f"a prefill chunk holds 1 to {size} tokens, got {count}.")
    fill = size - count
    ids = list(token_ids) + [token_ids[-1]] * fill
    positions = list(range(start, start + count)) + [start + count - 1] * fill
    return ids, positions


def split_chunks(token_ids: list[int], start: int, size: int) -> list[tuple[list[int], int]]:
    """Split real tokens starting at position ``start`` into ``(tokens, start)`` pieces of at most ``size``."""
    return [(token_ids[i : i + size], start + i) for i in range(0, len(token_ids), size)]


def slots_of(blocks: Sequence[int], positions: Sequence[int], block_size: int) -> list[int]:
    """The cache rows of ``positions`` of a sequence holding ``blocks``: ``blocks[p // block_size] * block_size +
    p % block_size`` (the one position -> slot rule)."""
    return [blocks[p // block_size] * block_size + p % block_size for p in positions]


def chunk_slots(blocks: Sequence[int], start: int, count: int, size: int, block_size: int) -> torch.Tensor:
    """``slot_mapping [1, size]`` of a prefill chunk whose ``count`` real tokens sit at positions ``[start, start +
    count)``: their slots, then the scratch block's first slot for each padded column, so a token that is not real
    writes where no sequence reads (invariant 4)."""
    return torch.tensor([_slots(blocks, start, count, size, block_size)], dtype=torch.long)


def _slots(blocks: Sequence[int], start: int, count: int, size: int, block_size: int) -> list[int]:
    """`chunk_slots`' rule on a list."""
    return slots_of(blocks, range(start, start + count), block_size) + [SCRATCH_SLOT] * (size - count)


def table_rows(tables: Sequence[Sequence[int] | None], width: int) -> torch.Tensor:
    """``block_table [len(tables), width]``: row i lists the first ``width`` blocks of ``tables[i]``, then the scratch
    block (never read: positions past a sequence's own are masked); a None row is all scratch."""
    rows = []
    for blocks in tables:
        used = list(blocks[:width]) if blocks else []
        rows.append(used + [SCRATCH_BLOCK] * (width - len(used)))
    return torch.tensor(rows, dtype=torch.long).reshape(len(tables), width)


class DecodeRow(NamedTuple):
    """One decoding sequence's row of the token-generation graph."""

    token: int
    position: int
    blocks: Sequence[int]


def decode_rows(batch_size: int, active: dict[int, DecodeRow], width: int, block_size: int) -> dict[str, torch.Tensor]:
    """Inputs of the token-generation graph (``input_ids``, ``position_ids``, ``slot_mapping`` ``[B, 1]`` and
    ``block_table [B, width]``): row ``b`` decodes ``active[b]``. Every other row (a free slot, a sequence half-way
    through its prefill, one not scheduled this step) is token 0 at position 0, written to the scratch block and
    reading only the scratch block (invariant 9): `verify_rows` with one column."""
    rows = {row: VerifyRow([token], position, blocks) for row, (token, position, blocks) in active.items()}
    return verify_rows(batch_size, rows, 1, width, block_size)


class VerifyRow(NamedTuple):
    """One decoding sequence's row of the verification graph: its last token and the tokens proposed after it,
    starting at cache position ``position``."""

    tokens: Sequence[int]
    position: int
    blocks: Sequence[int]


def verify_rows(
    batch_size: int, active: dict[int, VerifyRow], columns: int, width: int, block_size: int
) -> dict[str, torch.Tensor]:
    """Inputs of the verification graph (``input_ids``, ``position_ids``, ``slot_mapping`` ``[B, columns]`` and
    ``block_table [B, width]``): row ``b`` holds ``active[b]``'s tokens padded like a prefill chunk (`pad_chunk`: the
    last real token and position repeated, the padded columns written to the scratch block); every other row is token
    0 at position 0, written to and reading only the scratch block (invariant 9). The rows are built as lists and
    each input made once (a tensor per row and field cost ~25 us a row of a batch-8 decode step)."""
    ids = [[0] * columns for _ in range(batch_size)]
    positions = [[0] * columns for _ in range(batch_size)]
    slots = [[SCRATCH_SLOT] * columns for _ in range(batch_size)]
    tables: list[Sequence[int] | None] = [None] * batch_size
    for row, (tokens, position, blocks) in active.items():
        ids[row], positions[row] = _padded(tokens, position, columns)
        slots[row] = _slots(blocks, position, len(tokens), columns, block_size)
        tables[row] = blocks
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
        "slot_mapping": torch.tensor(slots, dtype=torch.long),
        "block_table": table_rows(tables, width),
    }


def packed_verify_rows(
    active: Sequence[VerifyRow], columns: int, width: int, block_size: int
) -> dict[str, torch.Tensor]:
    """Inputs of the packed verification graph (`GraphSpec.packed`: ``input_ids``, ``position_ids``, ``slot_mapping``
    ``[1, columns]`` and ``block_table [columns, width]``): the columns of ``active[0]``'s tokens at their positions,
    then ``active[1]``'s and so on, each column with its sequence's blocks; the columns past them (up to the call's
    ``columns``) are token 0 at position 0, written to and reading only the scratch block, as `verify_rows` fills a
    row without a sequence (invariant 9)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    owner: list[int] = []  # each column's row of `tables`
    for index, (tokens, position, blocks) in enumerate(active):
        span = range(position, position + len(tokens))
        ids.extend(tokens)
        positions.extend(span)
        slots.extend(slots_of(blocks, span, block_size))
        owner.extend([index] * len(tokens))
    fill = columns - len(ids)
    if fill < 0:
        raise InputError(f"a verification call of {columns} columns cannot hold {len(ids)} tokens.")
    tables = table_rows([*(row.blocks for row in active), None], width)
    return {
        "input_ids": torch.tensor([ids + [0] * fill], dtype=torch.long),
        "position_ids": torch.tensor([positions + [0] * fill], dtype=torch.long),
        "slot_mapping": torch.tensor([slots + [SCRATCH_SLOT] * fill], dtype=torch.long),
        "block_table": tables[torch.tensor(owner + [len(active)] * fill, dtype=torch.long)],
    }


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
