"""Phi-3 family (``Phi3ForCausalLM``; also Phi-3.5-mini and Phi-4-mini, which share the layout).

The checkpoint fuses the attention projections (``qkv_proj``: q rows, then k, then v) and the MLP's gate
and up (``gate_up_proj``: gate rows, then up): the static decoder keeps them fused, one matmul each, so
the weight map stays the identity and no unfused copy exists. Partial rotary (``partial_rotary_factor``)
rotates the first channels of each head only; ``longrope`` is exact up to
``original_max_position_embeddings`` (its short factors) and refused beyond (`checks.check_rope`);
``sliding_window``, when set, applies to every layer, as in transformers' ``Phi3Model``.
"""

from __future__ import annotations

from .family import Family, no_bias, uniform_layer_types

PHI3 = Family(
    name="phi3",
    model_types=("phi3",),
    qkv_bias=no_bias,
    o_bias=no_bias,
    layer_types=uniform_layer_types,
    fused_qkv=True,
)
