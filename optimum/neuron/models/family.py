"""`Family`: what distinguishes one model family's static decoder from the common one.

Every hook has the common case as its default, so a family states only what differs from it: transformers'
rotary module found by name in the model's own modeling module (`transformers_rotary`), q/k/v and output biases
as the config's ``attention_bias`` says, `checks.check_rope`, the layer types transformers gives the config.

Layer types follow transformers' vocabulary: ``"full_attention"`` or ``"sliding_attention"`` per layer,
read from the config's ``layer_types`` when it has them (qwen2, qwen3, Gemma 3 derive them), else the same
for every layer, sliding when the config sets ``sliding_window`` (`per_layer_types`). mistral, Phi-3 and Qwen3-MoE
state `uniform_layer_types`: transformers applies one mask to their whole model, whatever ``layer_types`` says.
A sliding layer attends to the ``sliding_window`` positions ending at its query's (`layer_windows`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .checks import check_rope
from .layers.norm import RMSNorm

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
StateRule = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def transformers_rotary(hf_config: Any) -> nn.Module:
    """transformers' rotary module for ``hf_config``: the one ``*RotaryEmbedding`` class defined in the modeling module
    beside the config's class (``transformers.models.llama.configuration_llama.LlamaConfig`` ->
    ``modeling_llama.LlamaRotaryEmbedding``), the source of the exact ``inv_freq``."""
    name = type(hf_config).__module__.replace(".configuration_", ".modeling_")
    module = importlib.import_module(name)
    found = [
        value
        for key, value in vars(module).items()
        if key.endswith("RotaryEmbedding") and isinstance(value, type) and value.__module__ == name
    ]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{name} defines {len(found)} *RotaryEmbedding classes, not one: give the family its rotary module "
            "(Family.rotary)."
        )
    return found[0](hf_config)


def config_attention_bias(hf_config: Any) -> bool:
    """The config's ``attention_bias`` (False when it has none)."""
    return bool(getattr(hf_config, "attention_bias", False))


def no_bias(hf_config: Any) -> bool:
    """No bias, whatever the config says (transformers' module has none)."""
    return False


def uniform_layer_types(hf_config: Any) -> list[str]:
    """Every layer sliding when the config sets ``sliding_window``, else full (how mistral, Phi-3 and
    Qwen3-MoE choose their mask: one mask function for the whole model; their configs have no ``layer_types``)."""
    sliding = getattr(hf_config, "sliding_window", None) is not None
    return [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * hf_config.num_hidden_layers


def per_layer_types(hf_config: Any) -> list[str]:
    """The config's own ``layer_types`` (qwen2 and qwen3 derive them from ``use_sliding_window`` and
    ``max_window_layers``, Gemma 3 from its sliding pattern); `uniform_layer_types` when it has none."""
    types = getattr(hf_config, "layer_types", None)
    return list(types) if types is not None else uniform_layer_types(hf_config)


@dataclass(frozen=True)
class Family:
    """A registered model family: a small delta over the common decoder."""

    name: str
    model_types: tuple[str, ...]
    rotary: Callable[[Any], nn.Module] = transformers_rotary
    """Builds transformers' rotary module for a config (source of the exact ``inv_freq``)."""
    qkv_bias: Callable[[Any], bool] = config_attention_bias
    """Whether q/k/v projections carry a bias."""
    o_bias: Callable[[Any], bool] = config_attention_bias
    """Whether the attention output projection carries a bias."""
    qk_norm: bool = False
    """RMSNorm (of the family's `norm` kind) on q and k per head before rope (qwen3, Gemma 3)."""
    check: Callable[[Any, int], None] = check_rope
    """``(config, sequence_length)``: refuses configs the static decoder would compute differently from transformers."""
    layer_types: Callable[[Any], list[str]] = per_layer_types
    """Each layer's attention type (`FULL_ATTENTION` or `SLIDING_ATTENTION`), as transformers decides it."""
    norm: Callable[[int, float], nn.Module] = RMSNorm
    """The RMSNorm kind, ``(size, eps) -> module`` (Gemma: ``1 + weight``)."""
    fused_qkv: bool = False
    """One ``qkv_proj`` and one ``gate_up_proj`` matmul, as Phi-3's checkpoint stores them."""
    mlp: Callable[[Any, int], nn.Module] | None = None
    """Builds layer ``i``'s MLP; ``None``: the gated MLP of ``intermediate_size`` (Qwen3-MoE: sparse layers)."""
    layer: Callable[[Family, Any, int], nn.Module] | None = None
    """Builds decoder layer ``i``; ``None``: the pre-norm block of `models.base.DecoderLayer` (Gemma 3: four norms)."""
    rope_per_layer_type: bool = False
    """One rope base per layer type (Gemma 3: ``rope_parameters`` keyed by layer type)."""
    attention_scale: Callable[[Any], float | None] = lambda cfg: None
    """Softmax scale of attention scores; ``None``: ``head_dim ** -0.5`` (Gemma 3: ``query_pre_attn_scalar``)."""
    embed_scale: Callable[[Any], float | None] = lambda cfg: None
    """Factor applied to the token embeddings (Gemma: ``sqrt(hidden_size)``, rounded to the model dtype)."""
    logit_softcap: Callable[[Any], float | None] = lambda cfg: None
    """``cap * tanh(logits / cap)`` on the final logits when set (Gemma's ``final_logit_softcapping``)."""
    checkpoint_rules: tuple[StateRule, ...] = ()
    """Renaming rules applied to the checkpoint before the strict map (`optimum.neuron.weights`)."""
    text_config: Callable[[Any], Any] | None = None
    """For a multimodal config: the config of the text decoder this toolkit serves (its text tower)."""


def layer_windows(family: Family, hf_config: Any) -> list[int | None]:
    """Each layer's sliding window (``None``: full attention); `UnsupportedModelError` for a sliding layer
    without a ``sliding_window`` (transformers refuses it too) or a layer type we do not know."""
    types = family.layer_types(hf_config)
    if len(types) != hf_config.num_hidden_layers:
        raise UnsupportedModelError(
            f"config field layer_types has {len(types)} entries for {hf_config.num_hidden_layers} layers: "
            "fix config.json."
        )
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise UnsupportedModelError(
            f"config field layer_types names {unknown}, which the static decoder does not implement (only "
            f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r})."
        )
    window = getattr(hf_config, "sliding_window", None)
    if SLIDING_ATTENTION in types and not window:
        raise UnsupportedModelError(
            "config field layer_types has sliding_attention layers but sliding_window is not set: set sliding_window "
            "(and use_sliding_window for qwen models) in config.json, or make every layer full_attention."
        )
    return [window if t == SLIDING_ATTENTION else None for t in types]
