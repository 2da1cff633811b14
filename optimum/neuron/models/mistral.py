"""Mistral family: llama layout; ``sliding_window``, when set, applies to every layer (as transformers'
``MistralModel`` does: one mask for the whole model)."""

from __future__ import annotations

from .family import Family, no_bias, uniform_layer_types

MISTRAL = Family(
    name="mistral", model_types=("mistral",), qkv_bias=no_bias, o_bias=no_bias, layer_types=uniform_layer_types
)
