"""Qwen2 family: llama with biases on the q/k/v projections. Sliding-window attention per the config's
``layer_types`` (transformers derives them: layers from ``max_window_layers`` on slide when
``use_sliding_window`` is set)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .checks import check_rope
from .family import Family, per_layer_types


def _rotary(hf_config: Any) -> nn.Module:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return Qwen2RotaryEmbedding(hf_config)


QWEN2 = Family(
    name="qwen2",
    model_types=("qwen2",),
    rotary=_rotary,
    qkv_bias=lambda cfg: True,
    check=check_rope,
    layer_types=per_layer_types,
)
