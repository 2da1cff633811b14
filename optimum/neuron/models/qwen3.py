"""Qwen3 family: llama with per-head RMSNorm on q and k before rope; sliding window per ``layer_types``
as for qwen2."""

from __future__ import annotations

from typing import Any

from torch import nn

from .checks import check_rope
from .family import Family, per_layer_types


def _rotary(hf_config: Any) -> nn.Module:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(hf_config)


QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    rotary=_rotary,
    qkv_bias=lambda cfg: bool(getattr(cfg, "attention_bias", False)),
    o_bias=lambda cfg: bool(getattr(cfg, "attention_bias", False)),
    qk_norm=True,
    check=check_rope,
    layer_types=per_layer_types,
)
