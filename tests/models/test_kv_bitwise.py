"""Invariant 4, bitwise, in bf16 (eager and inductor): a short chunk's padded positions compute exactly the
real last token's K/V. The checks and why they are needed: `tests/contract/kv_inspection.py` (fp32 runs
for every backend in the contract suite), and a proof that the inspection can fail."""

from __future__ import annotations

import pytest
import torch

from optimum.neuron.models.layers import masks
from tests.contract.kv_inspection import (
    check_padded_chunk_writes,
    check_padded_columns,
    padded_rows_equal_last_real,
    setup,
)

CASES = [("eager", "bf16"), ("inductor", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_padded_columns_compute_the_last_real_kv(backend: str, dtype: str) -> None:
    check_padded_columns(backend, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_padded_chunk_writes_what_an_unpadded_chunk_writes(backend: str, dtype: str) -> None:
    check_padded_chunk_writes(backend, dtype)


def test_inspection_detects_padded_queries_that_attend_to_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: with the actual-tokens mask removed, padded queries attend to the padded
    keys, and from the second layer on their K/V differ from the real last token's."""
    case = setup("eager", "fp32")
    monkeypatch.setattr(masks, "actual_tokens_mask", lambda ids: torch.ones_like(ids, dtype=torch.bool))
    fill = 2
    before = case.start(case.second[:fill], seed=0)
    equal = padded_rows_equal_last_real(case.inspected(case.second[:fill], before), fill)
    assert all(equal[:2]), "layer 0 K/V depend only on token and position"
    assert not all(equal[2:]), "a broken mask went unnoticed"
