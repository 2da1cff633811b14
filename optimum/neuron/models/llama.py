"""Llama family (Llama 2/3 incl. Llama-3 rope scaling, SmolLM2): the reference decoder."""

from __future__ import annotations

from typing import Any

from torch import nn

from .checks import check_rope
from .family import Family


def _rotary(hf_config: Any) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(hf_config)


LLAMA = Family(
    name="llama",
    model_types=("llama",),
    rotary=_rotary,
    qkv_bias=lambda cfg: bool(getattr(cfg, "attention_bias", False)),
    o_bias=lambda cfg: bool(getattr(cfg, "attention_bias", False)),
    check=check_rope,
)
