"""Invariant 4, bitwise, in bf16 (eager and inductor): a short chunk writes exactly its real rows, as an
unpadded chunk would, and its padding only the scratch row. The check: `tests/contract/kv_inspection.py`
(fp32 runs for every backend in the contract suite); here also a proof that the check can fail."""

from __future__ import annotations

import pytest
import torch

from optimum.neuron.models.layers import attention
from tests.contract.kv_inspection import START, check_padded_chunk_writes, setup, unchanged_outside

CASES = [("eager", "bf16"), ("inductor", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_padded_chunk_writes_only_its_real_rows_bitwise(backend: str, dtype: str) -> None:
    check_padded_chunk_writes(backend, dtype)


def test_the_check_catches_padding_that_writes_live_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With padded columns writing at positions of their own (start + j) instead of the scratch row, rows past
    the chunk's real tokens change, and the check sees it."""
    case = setup("eager", "fp32")
    spread = lambda positions, scratch: positions[:, :1] + torch.arange(positions.shape[1])  # noqa: E731
    monkeypatch.setattr(attention, "chunk_write_positions", spread)
    fill = 2
    before, padded = case.shipped(case.second[:fill], seed=0)
    assert not unchanged_outside(before, padded, START, START + fill), "padding writing live rows went unnoticed"
