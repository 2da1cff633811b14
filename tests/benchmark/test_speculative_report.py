"""`benchmark.speculative`'s report: the decode steps' share of the time, from the worker's step records, and the
speedup a cell's tokens per step would give if its verification calls cost a plain step."""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmark import speculative


def record(started: float, seconds: float, decodes: int, prefill: bool = False) -> dict[str, Any]:
    """A step record as the worker returns it."""
    prefills = [["p", 0, 256]] if prefill else []
    return {"started": started, "seconds": seconds, "decodes": [str(i) for i in range(decodes)], "prefills": prefills}


def test_decode_steps_count_from_their_start_to_the_next_step_s() -> None:
    records = [record(10.0, 0.5, 0, prefill=True), record(10.6, 0.1, 8), record(10.75, 0.3, 8, prefill=True)]
    records.append(record(11.1, 0.1, 8))
    assert speculative.decode_seconds(records) == pytest.approx(0.15 + 0.1)
    assert speculative.decode_seconds([]) == 0.0


def test_free_verification_speedup_is_amdahl_over_the_decode_share() -> None:
    base = {"decode_share": 0.6, "tokens_per_step": 8.0}
    assert speculative.free_verification(base, {"tokens_per_step": 8.0}) == pytest.approx(1.0)
    assert speculative.free_verification(base, {"tokens_per_step": 16.0}) == pytest.approx(1 / (0.4 + 0.3))
    assert speculative.free_verification(base, {"tokens_per_step": 1e12}) == pytest.approx(1 / 0.4)


def cell(tok_s: float, tokens_per_step: float, share: float | None) -> dict[str, Any]:
    """A report cell, with or without the decode share (runs recorded before it was measured)."""
    found = {"tok_s": tok_s, "tokens_per_step": tokens_per_step, "kept": 0.5, "tokens": [[1, 2]]}
    return found if share is None else {**found, "decode_share": share}


@pytest.mark.parametrize("share", [0.5, None])
def test_report_gives_the_share_and_the_bound_where_measured(share: float | None) -> None:
    body = {
        "machine": {"cpu": "test cpu", "cores": 2},
        "rounds": 1,
        "new": 96,
        "lookups": [0, 2],
        "vllm": True,
        "cells": {f"{w} b8 k{k}": cell(100.0 * (1 + k / 10), 8.0 + k, share) for w in ("copy", "chat") for k in (0, 2)},
    }
    text = speculative.render(json.loads(json.dumps(body)), (8,))
    row = "| copy | 8 | 2 | 120.0 | 1.20x | 10.00 | - | 50 % |"
    if share is None:
        assert f"{row} - | - | yes |" in text
    else:
        assert f"{row} 50 % | {1 / (0.5 + 0.5 * 8 / 10):.2f}x | yes |" in text
        assert "| copy | 8 | 0 | 100.0 | 1.00x | 8.00 | - | - | 50 % | - | yes |" in text


def test_rows_per_step_average_the_decode_steps_rows() -> None:
    assert speculative.rows_per_step([record(0.0, 0.1, 8), record(0.1, 0.1, 5)]) == pytest.approx(6.5)
    assert speculative.rows_per_step([]) == 0.0


def test_passages_do_not_depend_on_how_many_are_asked() -> None:
    few, many = speculative.passages(4), speculative.passages(48)
    assert few == many[:4]
    assert len(set(many)) == 48


@pytest.mark.parametrize("count", [0, speculative.most_requests() + 1])
def test_prompts_beyond_the_workloads_are_refused(count: int) -> None:
    with pytest.raises(ValueError, match="prompts asked"):
        speculative.prompts("copy", count)


def test_report_names_the_requests_and_rows_per_step() -> None:
    keys = [(w, k) for w in ("copy", "chat") for k in (0, 6)]
    cells = {f"{w} b8 k{k}": {**cell(100.0, 8.0, 0.5), "rows_per_step": 7.5 - k} for w, k in keys}
    body = {"machine": {"cpu": "test cpu", "cores": 2}, "rounds": 2, "new": 96, "lookups": [0, 6], "vllm": True}
    body |= {"requests": 48, "batches": [8], "cells": cells}
    text = speculative.render(json.loads(json.dumps(body)), (8,))
    assert "--batches 8 --requests 48 --lookups 6 --rounds 2`" in text
    assert "| copy | 8 | 6 | 100.0 | 1.00x | 8.00 | 1.50 | 50 % |" in text
