"""Qwen2 family: llama with biases on the q/k/v projections; sliding window unsupported."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from .family import Family


def _rotary(hf_config: Any) -> nn.Module:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return Qwen2RotaryEmbedding(hf_config)


def check_full_attention(hf_config: Any, sequence_length: int) -> None:
    """Refuse configs whose layers use sliding-window attention within ``sequence_length``."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", False) and window and window < sequence_length:
        raise UnsupportedModelError(
            f"this {hf_config.model_type} model uses sliding-window attention (window {window}), which the "
            f"static decoder does not implement: export with --sequence_length <= {window}."
        )


QWEN2 = Family(
    name="qwen2",
    model_types=("qwen2",),
    rotary=_rotary,
    qkv_bias=lambda cfg: True,
    check=check_full_attention,
)
