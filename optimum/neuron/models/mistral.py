"""Mistral family: llama layout; ``sliding_window``, when set, applies to every layer (as transformers'
``MistralModel`` does: one mask for the whole model)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .checks import check_rope
from .family import Family, uniform_layer_types


def _rotary(hf_config: Any) -> nn.Module:
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding

    return MistralRotaryEmbedding(hf_config)


MISTRAL = Family(
    name="mistral",
    model_types=("mistral",),
    rotary=_rotary,
    qkv_bias=lambda cfg: False,
    check=check_rope,
    layer_types=uniform_layer_types,
)
