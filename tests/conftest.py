"""Shared test setup: a project-local cache, offline hubs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OPTIMUM_NEURON_CACHE", str(ROOT / ".cache" / "optimum-neuron"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["OPTIMUM_NEURON_CACHE"], "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(ROOT))
