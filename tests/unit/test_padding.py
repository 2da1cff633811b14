"""Padding rules of `optimum.neuron.runtime.padding` (invariants 4 and 9)."""

from __future__ import annotations

import math

import pytest
import torch

from optimum.neuron.errors import InputError
from optimum.neuron.runtime.padding import decode_rows, pad_chunk, split_chunks

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


def test_decode_rows_active_rows_carry_token_and_position() -> None:
    ids, positions = decode_rows(3, {0: (7, 4), 2: (9, 11)}, sequence_length=32)
    assert ids[:, 0].tolist() == [7, 0, 9]
    assert positions[:, 0].tolist() == [4, 32, 11]
    assert ids.shape == positions.shape == (3, 1)


def test_decode_rows_without_a_decoding_sequence_write_to_the_scratch_row() -> None:
    # free slots, slots half-way through their prefill, sequences not scheduled: position S, the scratch row
    _, positions = decode_rows(4, {1: (5, 3)}, sequence_length=32)
    assert positions[:, 0].tolist() == [32, 3, 32, 32]


def test_decode_rows_with_nothing_to_decode() -> None:
    ids, positions = decode_rows(2, {}, sequence_length=8)
    assert ids[:, 0].tolist() == [0, 0] and positions[:, 0].tolist() == [8, 8]
