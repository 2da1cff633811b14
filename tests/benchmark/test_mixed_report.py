"""`benchmark.mixed`'s report: each row's medians and ranges per artifact, and mixed / two calls from the medians."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark import mixed


def test_each_row_reports_both_artifacts_and_their_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mixed, "RESULTS", tmp_path)
    runs = {
        "two calls:steps:None": [{"step_ms": 180.0, "decode_ms": 14.0}, {"step_ms": 170.0, "decode_ms": 16.0}],
        "mixed:steps:None": [{"step_ms": 160.0, "decode_ms": 15.0}, {"step_ms": 150.0, "decode_ms": 15.0}],
        "two calls:vllm:batch": [{"tok_s": 250.0}, {"tok_s": 270.0}],
        "mixed:vllm:batch": [{"tok_s": 260.0}, {"tok_s": 280.0}],
        "two calls:vllm:long prompts": [{"tok_s": 40.0}, {"tok_s": 50.0}],
        "mixed:vllm:long prompts": [{"tok_s": 45.0}, {"tok_s": 55.0}],
    }
    mixed.write_report("here", 2, runs, [0.5, 1.5])
    text = (tmp_path / "here" / "mixed.md").read_text()
    assert "| a step of 7 decodes + 249 prompt tokens, ms | 175.0 (170.0-180.0) | 155.0 (150.0-160.0) | 0.886 |" in text
    assert "| a step of the 7 decodes alone, ms | 15.0 (14.0-16.0) | 15.0 (15.0-15.0) | 1.000 |" in text
    assert "| `vllm.LLM`, long prompts workload, output tok/s | 45.0 (40.0-50.0) | 50.0 (45.0-55.0) | 1.111 |" in text
    assert "--rounds 2 --machine here" in text and "1-minute load 0.50-1.50" in text
    assert json.loads((tmp_path / "here" / "mixed.json").read_text())["runs"] == runs
