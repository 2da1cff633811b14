"""`benchmark.serve --quick` end to end on a tiny model (eager backend, so nothing compiles): one of the four
artifacts (chunked + hybrid sampling: the plain and the mixed workload) served by `vllm serve`, driven by
`vllm bench serve`, a transformers peer, and a well-formed report. The other configurations differ only in the
artifact the same code exports and serves (context encoding and CPU sampling are served in tests/vllm). Speed is
not asserted: only that every number a reader would look at exists and is sane, and that no server outlives the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from benchmark.serving.configs import CONFIGS, MIXED_CONFIGS, QUICK
from tests.fixtures.llm.models import tiny_model
from tests.fixtures.processes import TAG, check_no_process_outlives_the_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PNG = b"\x89PNG\r\n\x1a\n"
RUN = ("chunked-hybrid",)
CONFIGS_RUN = [c for c in CONFIGS if c.name in RUN]


def test_quick_benchmark_end_to_end(tmp_path: Path) -> None:
    """One run of the benchmark (several minutes), then every check of its output."""
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "benchmark.serve", "--quick", "--model", str(tiny_model("llama"))]
    cmd += ["--backend", "eager", "--out", str(tmp_path), "--configs", *RUN]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env={**os.environ, TAG: tag})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    check_every_configuration_and_the_peer_have_sane_numbers(tmp_path)
    check_mixed_workload_is_recorded(tmp_path)
    check_markdown_tables_and_plots(tmp_path)
    check_no_process_outlives_the_run(tag)


def check_every_configuration_and_the_peer_have_sane_numbers(report: Path) -> None:
    summary = json.loads((report / "serving.json").read_text())
    assert summary["floor_ms"] > 0
    assert set(summary["main"]) >= set(RUN)
    for config in CONFIGS_RUN:
        r = summary["main"][config.name]
        assert r["completed"] == QUICK.main.prompts, config.name
        assert r["output_throughput"] > 0 and r["duration"] > 0
        assert 0 < r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"], config.name
        assert 0 <= r["p50_itl_ms"] <= r["p99_itl_ms"], config.name
    peer = summary["main"]["transformers generate (eager)"]
    assert peer["output_throughput"] > 0 and peer["p50_ttft_ms"] > 0
    assert "no GGUF" in summary["main"]["llama.cpp"]["error"], "llama.cpp needs the model's GGUF"


def check_mixed_workload_is_recorded(report: Path) -> None:
    mixed = json.loads((report / "serving.json").read_text())["mixed"]
    assert set(mixed) == set(MIXED_CONFIGS) & set(RUN)
    for name, parts in mixed.items():
        assert parts["idle"]["completed"] == parts["chats"]["completed"] == QUICK.chats.prompts, name
        assert parts["arrivals"]["completed"] == QUICK.arrivals.prompts, name
        assert all(math.isfinite(parts[p]["p99_itl_ms"]) for p in ("idle", "chats")), name


def check_markdown_tables_and_plots(report: Path) -> None:
    text = (report / "serving.md").read_text()
    assert "`vllm bench serve`" in text and "vllm 0.32.0" in text
    for config in CONFIGS_RUN:
        assert f"| {config.label} |" in text
    assert text.count("| transformers generate (eager) |") == 1
    for plot in ("throughput.png", "latency.png", "mixed-itl.png"):
        assert (report / plot).read_bytes().startswith(PNG), plot
        assert f"({plot})" in text
