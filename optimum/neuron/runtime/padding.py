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
