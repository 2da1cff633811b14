"""Mistral family: llama layout; a sliding window shorter than the compiled length is refused."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from .family import Family


def _rotary(hf_config: Any) -> nn.Module:
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding

    return MistralRotaryEmbedding(hf_config)


def _check_window(hf_config: Any, sequence_length: int) -> None:
    window = getattr(hf_config, "sliding_window", None)
    if window and window < sequence_length:
        raise UnsupportedModelError(
            f"this mistral model uses a {window}-token sliding window, which the static decoder does not "
            f"implement: export with --sequence_length <= {window}."
        )


MISTRAL = Family(
    name="mistral",
    model_types=("mistral",),
    rotary=_rotary,
    qkv_bias=lambda cfg: False,
    check=_check_window,
)
