"""Qwen3 family: llama with per-head RMSNorm on q and k before rope; sliding window per ``layer_types``
as for qwen2."""

from __future__ import annotations

from .family import Family

QWEN3 = Family(name="qwen3", model_types=("qwen3",), qk_norm=True)
