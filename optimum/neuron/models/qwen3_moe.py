"""Qwen3-MoE family (``Qwen3MoeForCausalLM``): qwen3's attention (q/k norm) with a sparse
mixture-of-experts MLP (`layers.moe`) in the layers transformers makes sparse: not in ``mlp_only_layers``
and ``(index + 1) % decoder_sparse_step == 0``; the other layers keep a dense MLP of
``intermediate_size``. Per-expert checkpoint tensors are stacked at load (`weights.stack_experts`).
``sliding_window`` (set only with ``use_sliding_window``) applies to every layer, as in transformers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..weights import stack_experts
from .family import Family, uniform_layer_types
from .layers.mlp import GatedMLP
from .layers.moe import SparseMoeBlock


def is_sparse(hf_config: Any, index: int) -> bool:
    """Whether layer ``index`` has the sparse MoE block (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
    only_dense = getattr(hf_config, "mlp_only_layers", None) or []
    experts = hf_config.num_experts
    return index not in only_dense and experts > 0 and (index + 1) % hf_config.decoder_sparse_step == 0


def _mlp(hf_config: Any, index: int) -> nn.Module:
    hidden, act = hf_config.hidden_size, hf_config.hidden_act
    if not is_sparse(hf_config, index):
        return GatedMLP(hidden, hf_config.intermediate_size, act)
    return SparseMoeBlock(
        hidden,
        hf_config.moe_intermediate_size,
        hf_config.num_experts,
        hf_config.num_experts_per_tok,
        bool(hf_config.norm_topk_prob),
        act,
    )


QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    qk_norm=True,
    layer_types=uniform_layer_types,
    mlp=_mlp,
    checkpoint_rules=(stack_experts,),
)
