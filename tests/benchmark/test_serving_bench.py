"""`benchmark.serve --quick` end to end on a tiny model (eager backend, so nothing compiles): four artifacts
served by `vllm serve`, driven by `vllm bench serve`, a transformers peer, and a well-formed report.
Speed is not asserted: only that every number a reader would look at exists and is sane."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmark.serving.configs import CONFIGS, MIXED_CONFIGS, QUICK
from tests.fixtures.llm.models import tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PNG = b"\x89PNG\r\n\x1a\n"
PORT = 8131


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serving")
    (out / "started").write_text(str(time.time()))
    cmd = [sys.executable, "-m", "benchmark.serve", "--quick", "--model", str(tiny_model("llama"))]
    cmd += ["--backend", "eager", "--out", str(out), "--port", str(PORT)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


def test_every_configuration_and_the_peer_have_sane_numbers(report: Path) -> None:
    summary = json.loads((report / "serving.json").read_text())
    assert summary["floor_ms"] > 0
    for config in CONFIGS:
        r = summary["main"][config.name]
        assert r["completed"] == QUICK.main.prompts, config.name
        assert r["output_throughput"] > 0 and r["duration"] > 0
        assert 0 < r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"], config.name
        assert 0 <= r["p50_itl_ms"] <= r["p99_itl_ms"], config.name
    peer = summary["main"]["transformers generate (eager)"]
    assert peer["output_throughput"] > 0 and peer["p50_ttft_ms"] > 0
    assert "no GGUF" in summary["main"]["llama.cpp"]["error"], "llama.cpp needs the model's GGUF"


def test_mixed_workload_is_recorded_for_ce_and_chunked(report: Path) -> None:
    mixed = json.loads((report / "serving.json").read_text())["mixed"]
    assert set(mixed) == set(MIXED_CONFIGS)
    for name, parts in mixed.items():
        assert parts["idle"]["completed"] == parts["chats"]["completed"] == QUICK.chats.prompts, name
        assert parts["arrivals"]["completed"] == QUICK.arrivals.prompts, name
        assert all(math.isfinite(parts[p]["p99_itl_ms"]) for p in ("idle", "chats")), name


def test_markdown_tables_and_plots(report: Path) -> None:
    text = (report / "serving.md").read_text()
    assert "`vllm bench serve`" in text and "vllm 0.32.0" in text
    for config in CONFIGS:
        assert f"| {config.label} |" in text
    assert text.count("| transformers generate (eager) |") == 1
    for plot in ("throughput.png", "latency.png", "mixed-itl.png"):
        assert (report / plot).read_bytes().startswith(PNG), plot
        assert f"({plot})" in text


def test_no_server_outlives_the_benchmark(report: Path) -> None:
    started = float((report / "started").read_text())
    left = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
        text = f"{proc.info['name']} {' '.join(proc.info['cmdline'] or [])}"
        if proc.info["create_time"] >= started and ("EngineCore" in text or "bench/serving/" in text):
            left.append(text)
    listening = [c for c in psutil.net_connections("tcp") if c.laddr.port == PORT and c.status == psutil.CONN_LISTEN]
    assert not left and not listening, f"the benchmark's server is still running: {left} {listening}"
