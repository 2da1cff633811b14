"""One benchmark measurement in a fresh interpreter: ``python -m <module> --worker JSON`` runs it and prints its answer
on one line after `MARKER` (vLLM logs to stdout too, so the answer is found by its marker), read back by
`run_worker`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

MARKER = "BENCHMARK_RESULT "


def run_worker(module: str, spec: dict[str, Any]) -> dict[str, Any]:
    """``python -m module --worker <spec as JSON>`` in a fresh interpreter; the answer it printed with `answer`."""
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    answers = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode or not answers:
        raise RuntimeError(f"{module} {spec} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(answers[-1].removeprefix(MARKER)))


def answer(result: dict[str, Any]) -> None:
    """A worker's answer, on the line `run_worker` reads."""
    print(MARKER + json.dumps(result), flush=True)
