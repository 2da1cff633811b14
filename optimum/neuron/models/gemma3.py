"""Gemma 3 text family (``Gemma3ForCausalLM``, and the text tower of ``Gemma3ForConditionalGeneration``).

Local (sliding-window) and global layers interleave as the config's ``layer_types`` say, each with its own
rope base (``rope_parameters`` keyed by layer type, e.g. ``rope_local_base_freq`` for local layers); every
layer has four ``1 + weight`` RMSNorms (before and after attention and MLP), q/k norm, scores scaled by
``query_pre_attn_scalar ** -0.5``, a GELU-tanh gated MLP; embeddings are scaled by ``sqrt(hidden_size)``, the
LM head is tied, ``final_logit_softcapping`` is applied when set. Attention logit soft-capping and
bidirectional attention are refused (`check`).

A multimodal checkpoint (model_type ``gemma3``) is exported as its text decoder: the artifact's config is
the ``text_config`` (``Gemma3ForCausalLM``), the language model's weights are renamed and the vision tower
left out (`weights.text_tower`); images are not served.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from ..weights import text_tower
from .base import DecoderLayer
from .checks import check_rope, refuse_set
from .family import Family
from .layers.attention import AttentionContext, kept_rows
from .layers.mlp import GatedMLP
from .layers.norm import OffsetRMSNorm


class Gemma3DecoderLayer(DecoderLayer):
    """Gemma 3's block: norms before and after both attention and MLP ("sandwich" norms)."""

    def __init__(self, family: Family, hf_config: Any, index: int) -> None:
        super().__init__(family, hf_config, index)
        self.pre_feedforward_layernorm = family.norm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_feedforward_layernorm = family.norm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: Any,
        caches: list[torch.Tensor],
        ctx: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, caches, ctx, rows))
        h = kept_rows(h, rows) + attended
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def _check(hf_config: Any, sequence_length: int) -> None:
    refuse_set(
        hf_config,
        {
            "attn_logit_softcapping": "attention-score soft-capping needs a non-fused attention kernel; transformers' "
            "default (sdpa) attention does not apply it either. Set it to null in config.json to serve the model as "
            "transformers' sdpa attention computes it.",
            "use_bidirectional_attention": "only causal attention is implemented (a static decoder generates "
            "left to right).",
        },
    )
    check_rope(hf_config, sequence_length)


def _mlp(hf_config: Any, index: int) -> nn.Module:
    return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_activation)


def _text_config(hf_config: Any) -> Any:
    """The text decoder's config of a multimodal Gemma 3 config, as a ``Gemma3ForCausalLM`` config."""
    text = copy.deepcopy(hf_config.get_text_config())
    text.architectures = ["Gemma3ForCausalLM"]
    return text


GEMMA3 = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    qk_norm=True,
    check=_check,
    norm=OffsetRMSNorm,
    mlp=_mlp,
    layer=Gemma3DecoderLayer,
    rope_per_layer_type=True,
    attention_scale=lambda cfg: cfg.query_pre_attn_scalar**-0.5,
    embed_scale=lambda cfg: cfg.hidden_size**0.5,
    logit_softcap=lambda cfg: cfg.final_logit_softcapping,
    checkpoint_rules=(text_tower,),
)

GEMMA3_MULTIMODAL = dataclasses.replace(GEMMA3, model_types=("gemma3",), text_config=_text_config)
"""``Gemma3ForConditionalGeneration`` checkpoints: exported as the text decoder (`GEMMA3`)."""
