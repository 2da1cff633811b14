"""Invariant 4, bitwise, in bf16 (eager and inductor): a short chunk writes exactly its real rows, as an
unpadded chunk would, and its padding only the scratch block. The check: `tests/contract/kv_inspection.py`
(fp32 runs for every backend in the contract suite); here also a proof that the check can fail."""

from __future__ import annotations

import pytest
import torch

from optimum.neuron.runtime import engine as engine_module
from optimum.neuron.runtime.padding import slots_of
from tests.contract.kv_inspection import START, check_padded_chunk_writes, setup, unchanged_outside

CASES = [("eager", "bf16"), ("inductor", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_padded_chunk_writes_only_its_real_rows_bitwise(backend: str, dtype: str) -> None:
    check_padded_chunk_writes(backend, dtype)


def test_the_check_catches_padding_that_writes_live_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With padded columns writing at positions of their own (start + j, in the sequence's blocks) instead of the
    scratch block, rows past the chunk's real tokens change, and the check sees it."""
    case = setup("eager", "fp32")

    def spread(blocks: list[int], start: int, count: int, size: int, block_size: int) -> torch.Tensor:
        held = len(blocks) * block_size  # the positions its blocks hold
        return torch.tensor([slots_of(blocks, [min(p, held - 1) for p in range(start, start + size)], block_size)])

    monkeypatch.setattr(engine_module, "chunk_slots", spread)
    fill = 2
    before, padded = case.shipped(case.second[:fill], seed=0)
    chunk = case.slots(START, START + fill)
    assert not unchanged_outside(case, before, padded, chunk), "padding writing live rows went unnoticed"
