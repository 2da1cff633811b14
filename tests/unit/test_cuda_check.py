"""``make test-cuda`` (scripts/test_cuda.sh) skips cleanly where no NVIDIA GPU exists: exit 0, a message
that says why and where the CUDA status is documented, and nothing installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test_cuda.sh"


@pytest.mark.parametrize("probe", ["missing", "lists-nothing"])
def test_no_gpu_skips_and_installs_nothing(tmp_path: Path, probe: str) -> None:
    smi = tmp_path / "nvidia-smi"
    if probe == "lists-nothing":
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)
    venv = tmp_path / "venv-cuda"
    env = {**os.environ, "OPTIMUM_NEURON_NVIDIA_SMI": str(smi)}
    done = subprocess.run(["bash", str(SCRIPT), "python3", str(venv)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "test-cuda: skipped: no NVIDIA GPU here" in done.stdout and "docs/cuda.md" in done.stdout
    assert not venv.exists(), "the skip installed something"
