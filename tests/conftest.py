"""Shared test setup: a project-local cache, offline hubs, XLA on the CPU; tests marked ``xla`` are
skipped where torch-xla is not installed (they run in .venv-xla: ``make test-xla``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OPTIMUM_NEURON_CACHE", str(ROOT / ".cache" / "optimum-neuron"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["OPTIMUM_NEURON_CACHE"], "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two pytest workers on two cores, each with two OpenMP threads: by default an idle OpenMP thread spins before it
# sleeps, burning the core the other worker needs. Sleeping at once (set before torch loads libgomp) measured
# 38 s -> 30 s for the eager contract tests and 239 s -> 221 s for a vLLM/inductor mix; the compiled code and the
# thread count (part of an inductor graph's cache key) are unchanged. Subprocesses (vllm serve, fresh tests) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
sys.path.insert(0, str(ROOT))

from tests.utils import HAS_TORCH_XLA  # noqa: E402 (after the path and cache setup above)

if HAS_TORCH_XLA:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
_NO_XLA = "torch_xla is not installed here: the xla tests run in .venv-xla (make install-xla && make test-xla)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``xla`` when torch-xla is absent, saying where they run."""
    if HAS_TORCH_XLA:
        return
    for item in items:
        if item.get_closest_marker("xla") is not None:
            item.add_marker(pytest.mark.skip(reason=_NO_XLA))
