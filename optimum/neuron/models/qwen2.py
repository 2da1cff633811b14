"""Qwen2 family: llama with biases on the q/k/v projections. Sliding-window attention per the config's
``layer_types`` (transformers derives them: layers from ``max_window_layers`` on slide when
``use_sliding_window`` is set)."""

from __future__ import annotations

from .family import Family, no_bias

QWEN2 = Family(name="qwen2", model_types=("qwen2",), qkv_bias=lambda cfg: True, o_bias=no_bias)
