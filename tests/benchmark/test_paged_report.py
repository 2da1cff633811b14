"""`benchmark.paged_report`'s ``kvint8`` part: the table of decode ms/step, fp32 KV against int8 KV, per batch, and the
caches' bytes, from the runs `benchmark.paged.kv_int8` records."""

from __future__ import annotations

from pathlib import Path

from benchmark.paged_report import write_report


def test_the_kvint8_part_reports_each_batch_and_the_cache_ratio(tmp_path: Path) -> None:
    runs = {"auto@1": [20.0, 22.0], "int8@1": [16.0, 18.0], "auto@8": [60.0, 62.0], "int8@8": [45.0, 47.0]}
    part = {"runs": runs, "backend": "inductor", "context": 1000, "load": 0.5}
    part["cache_bytes"] = {"auto": 256 * 2**20, "int8": 68 * 2**20}
    write_report(tmp_path, {"machine": {"cpu": "test"}, "rounds": 2, "baseline": "x", "kvint8": part})
    text = (tmp_path / "paged.md").read_text()
    assert "| 1 | 20.0 / 22.0 | 16.0 / 18.0 | **0.81x** |" in text
    assert "| 8 | 60.0 / 62.0 | 45.0 / 47.0 | **0.75x** |" in text
    assert "256.0 MiB fp32, 68.0 MiB int8 (0.2656)" in text and "after a 1000-token context" in text
    long = {**part, "context": 4000, "sequence_length": 4096}
    write_report(tmp_path, {"machine": {"cpu": "test"}, "rounds": 2, "baseline": "x", "kvint8-long": long})
    text = (tmp_path / "paged.md").read_text()
    assert "## int8 KV cache: decode ms/step after 4000 tokens" in text and "S 4096, C 256" in text


def test_parts_measured_on_different_machines_each_name_theirs(tmp_path: Path) -> None:
    runs = {"auto@1": [20.0], "int8@1": [16.0], "auto@8": [60.0], "int8@8": [45.0]}
    part = {"runs": runs, "backend": "inductor", "context": 1000, "load": 0.5, "cache_bytes": {"auto": 2, "int8": 1}}
    results = {"machine": {"cpu": "b"}, "rounds": 1, "baseline": "x", "kvint8": part, "kvint8-long": part}
    write_report(tmp_path, results | {"machines": {"kvint8": {"cpu": "a"}, "kvint8-long": {"cpu": "b"}}})
    text = (tmp_path / "paged.md").read_text()
    assert "- kvint8: cpu a." in text and "- kvint8-long: cpu b." in text
    write_report(tmp_path, results | {"machines": {"kvint8": {"cpu": "b"}, "kvint8-long": {"cpu": "b"}}})
    assert "Machine: cpu b." in (tmp_path / "paged.md").read_text()
