"""`benchmark.soak --quick` end to end on the tiny llama (eager backend, so nothing compiles): a few concurrent clients
mixing every request kind against one `vllm serve`, then the report. Speed is not asserted: only the soak's goals
(no error, nothing left running or holding a KV slot, engine RSS growth within 5 %, greedy outputs under load equal to
the same requests sent alone), that every request kind was exercised, and that no process outlives the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from benchmark.serving.soak_clients import KINDS
from tests.fixtures.llm.models import tiny_model
from tests.fixtures.processes import TAG, check_no_process_outlives_the_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_quick_soak_meets_its_goals(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "benchmark.soak", "--quick", "--model", str(tiny_model("llama")), "--backend", "eager"]
    env = {**os.environ, TAG: tag}
    done = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "soak-quick.json").read_text())
    assert all(result["goals"].values()), (result["goals"], result["load"]["error_samples"], result["server_errors"])
    warm = result["warm_up"]["kinds"]
    assert all(warm[kind]["ok"] == 1 for kind in KINDS), warm  # every kind ran, and succeeded, at least once
    load = result["load"]["all"]
    assert load["requests"] >= result["setup"]["clients"] and load["tokens"] > 0, load
    assert result["left"] == {"running": 0, "waiting": 0, "slots_held": 0, "health": 200}, result["left"]
    assert result["rss"]["start"] > 0 and result["rss"]["end"] > 0
    assert result["greedy"]["checks"] >= 1 and result["exit_status"] == 0
    report = (tmp_path / "soak-quick.md").read_text()
    assert "| all |" in report and "| 0 errors | yes |" in report, report
    check_no_process_outlives_the_run(tag)
