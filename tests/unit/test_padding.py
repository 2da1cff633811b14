"""Padding rules of `optimum.neuron.runtime.padding` (invariants 4 and 9)."""

from __future__ import annotations

import math

import pytest
import torch

from optimum.neuron.errors import InputError
from optimum.neuron.models.layers.kv_cache import SCRATCH_BLOCK
from optimum.neuron.runtime.padding import (
    SCRATCH_SLOT,
    DecodeRow,
    VerifyRow,
    chunk_slots,
    decode_rows,
    packed_verify_rows,
    pad_chunk,
    slots_of,
    split_chunks,
    table_rows,
)

C = 8
LENGTHS = [1, C - 1, C, C + 1, 2 * C, 2 * C + 1, 4 * C]


def test_short_chunk_repeats_last_token_id_and_position() -> None:
    ids, positions = pad_chunk([11, 12, 13], start=5, size=C)
    assert ids.tolist() == [[11, 12, 13, 13, 13, 13, 13, 13]]
    assert positions.tolist() == [[5, 6, 7, 7, 7, 7, 7, 7]]
    assert ids.dtype == positions.dtype == torch.long


def test_single_token_chunk_is_all_repeats() -> None:
    ids, positions = pad_chunk([42], start=0, size=4)
    assert ids.tolist() == [[42] * 4]
    assert positions.tolist() == [[0] * 4]


def test_full_chunk_is_not_padded() -> None:
    tokens = list(range(100, 100 + C))
    ids, positions = pad_chunk(tokens, start=16, size=C)
    assert ids.tolist() == [tokens]
    assert positions.tolist() == [list(range(16, 16 + C))]


@pytest.mark.parametrize("count", [0, C + 1])
def test_chunk_outside_one_to_size_raises(count: int) -> None:
    with pytest.raises(InputError, match=f"1 to {C} tokens"):
        pad_chunk(list(range(count)), start=0, size=C)


@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("length", LENGTHS)
def test_split_chunks_boundaries(length: int, start: int) -> None:
    tokens = list(range(1000, 1000 + length))
    pieces = split_chunks(tokens, start, C)
    assert len(pieces) == math.ceil(length / C)
    assert [t for piece, _ in pieces for t in piece] == tokens
    assert [s for _, s in pieces] == [start + i * C for i in range(len(pieces))]
    assert all(len(piece) == C for piece, _ in pieces[:-1])
    assert 1 <= len(pieces[-1][0]) <= C
    assert len(pieces[-1][0]) == (length % C or C)


def test_split_empty_prompt_gives_no_chunk() -> None:
    assert split_chunks([], 0, C) == []


@pytest.mark.parametrize("length", LENGTHS)
def test_split_then_pad_covers_consecutive_positions(length: int) -> None:
    covered: list[int] = []
    for piece, start in split_chunks(list(range(length)), 0, C):
        _, positions = pad_chunk(piece, start, C)
        covered.extend(sorted(set(positions[0].tolist())))
    assert covered == list(range(length))


BLOCK = 4


def test_slots_follow_the_block_table() -> None:
    blocks = [7, 2, 9]  # positions 0-3 in block 7, 4-7 in block 2, 8-11 in block 9
    assert slots_of(blocks, [0, 3, 4, 7, 8, 11], BLOCK) == [28, 31, 8, 11, 36, 39]


@pytest.mark.parametrize(("count", "start"), [(1, 0), (3, 5), (C, 8)])
def test_padded_columns_write_to_the_scratch_block_only(count: int, start: int) -> None:
    blocks = [3, 5, 6, 1]
    slots = chunk_slots(blocks, start, count, C, BLOCK)[0].tolist()
    assert slots[:count] == slots_of(blocks, range(start, start + count), BLOCK)
    assert slots[count:] == [SCRATCH_SLOT] * (C - count)
    assert SCRATCH_SLOT // BLOCK == SCRATCH_BLOCK


def test_table_rows_pad_with_the_scratch_block() -> None:
    table = table_rows([[4, 2, 9], None, [1]], width=2)
    assert table.tolist() == [[4, 2], [SCRATCH_BLOCK] * 2, [1, SCRATCH_BLOCK]]


def test_decode_rows_active_rows_carry_token_position_slot_and_table() -> None:
    rows = decode_rows(3, {0: DecodeRow(7, 4, [5, 6]), 2: DecodeRow(9, 1, [3])}, width=2, block_size=BLOCK)
    assert rows["input_ids"][:, 0].tolist() == [7, 0, 9]
    assert rows["position_ids"][:, 0].tolist() == [4, 0, 1]
    assert rows["slot_mapping"][:, 0].tolist() == [6 * BLOCK, SCRATCH_SLOT, 3 * BLOCK + 1]
    assert rows["block_table"].tolist() == [[5, 6], [SCRATCH_BLOCK] * 2, [3, SCRATCH_BLOCK]]
    assert all(t.shape[0] == 3 for t in rows.values())


def test_decode_rows_with_nothing_to_decode_touch_only_the_scratch_block() -> None:
    # free slots, slots half-way through their prefill, sequences not scheduled: the scratch block, read and written
    rows = decode_rows(2, {}, width=3, block_size=BLOCK)
    assert rows["input_ids"][:, 0].tolist() == [0, 0] and rows["slot_mapping"][:, 0].tolist() == [SCRATCH_SLOT] * 2
    assert (rows["block_table"] == SCRATCH_BLOCK).all() and rows["block_table"].shape == (2, 3)


def test_packed_verify_rows_put_each_sequence_after_the_last_with_its_own_table() -> None:
    """A sequence proposing 2 tokens at positions 3-5 across its block seam, then one proposing none: 4 columns, each
    with its sequence's blocks; the columns past them write to and read only the scratch block (invariant 9)."""
    rows = [VerifyRow([7, 8, 9], 3, [5, 6]), VerifyRow([4], 1, [2])]
    packed = packed_verify_rows(rows, 6, width=2, block_size=BLOCK)
    assert packed["input_ids"].tolist() == [[7, 8, 9, 4, 0, 0]]
    assert packed["position_ids"].tolist() == [[3, 4, 5, 1, 0, 0]]
    real = [5 * BLOCK + 3, 6 * BLOCK, 6 * BLOCK + 1, 2 * BLOCK + 1]
    assert packed["slot_mapping"].tolist() == [real + [SCRATCH_SLOT] * 2]
    scratch = [SCRATCH_BLOCK] * 2
    assert packed["block_table"].tolist() == [[5, 6]] * 3 + [[2, SCRATCH_BLOCK]] + [scratch] * 2
    with pytest.raises(InputError, match="cannot hold 4 tokens"):
        packed_verify_rows(rows, 3, width=2, block_size=BLOCK)
