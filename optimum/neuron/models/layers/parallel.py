"""Tensor parallelism in the Megatron layout (what NxD's ``ColumnParallelLinear`` / ``RowParallelLinear`` do on a
Neuron host): each of ``degree`` ranks holds a slice of every layer and one all-reduce per block sums the slices.

* q/k/v and gate/up projections are **column-parallel**: rank ``r`` holds the output rows of its heads (of its
  slice of the intermediate size). Attention is then local to a rank: its query heads, its KV heads, its own
  part of the KV cache. When the model has fewer KV heads than ranks, each KV head is **replicated** on the
  ``degree / kv_heads`` ranks whose query heads use it (GQA groups never straddle a rank).
* o and down projections are **row-parallel** (`RowParallelLinear`): each rank multiplies its slice of the input
  features and one ``all_reduce`` (sum, `all_reduce`) gives every rank the full output; a bias is added after it.
* Embeddings, norms, rotary frequencies and the LM head are **replicated**: every rank computes the same hidden
  states and the same full logits, so every rank's on-device sampler sees identical inputs and picks identical
  tokens (the all-reduce returns the same bits on every rank).

A rank's decoder is the family's own decoder built from `rank_config` (the head counts and intermediate size of
one rank) with its o/down projections swapped for `RowParallelLinear` (`make_row_parallel`); its weights are
`shard_weights` of the one full weight set. The graph is the same on every rank (same shapes, the collective
on the default process group): only the weights bound to it differ.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import IncompatibleConfigError

COLUMN_PARALLEL = ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj")
"""Projections split along their output features, one contiguous block per rank."""
KV_PARALLEL = ("self_attn.k_proj", "self_attn.v_proj")
"""Projections split by KV head (replicated when there are fewer KV heads than ranks)."""
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""Projections split along their input features, followed by one all-reduce."""


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks of the default process group: the one collective of a tensor-parallel graph
    (a functional collective, so ``torch.export`` records it in the graph and AOTInductor compiles it)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    assert group is not None, "a tensor-parallel graph runs (or is traced) inside a process group"
    return funcol.all_reduce(x, "sum", group)


class RowParallelLinear(nn.Linear):
    """A linear layer holding a slice of the input features: ``all_reduce(x @ W_r^T) + bias`` (the bias, full and
    replicated, added once after the sum). Its parameter names are `nn.Linear`'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def make_row_parallel(decoder: nn.Module) -> None:
    """Swap every o/down projection of ``decoder`` for a `RowParallelLinear` of the same shape (on the same device,
    so a meta decoder stays meta)."""
    for name, module in list(decoder.named_modules()):
        if type(module) is nn.Linear and name.endswith(ROW_PARALLEL):
            parent_name, _, leaf = name.rpartition(".")
            weight = module.weight
            row = RowParallelLinear(
                module.in_features, module.out_features, bias=module.bias is not None, device=weight.device
            )
            setattr(decoder.get_submodule(parent_name), leaf, row.to(weight.dtype))


def _dims(hf_config: Any) -> tuple[int, int, int]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim


def check_tensor_parallel(family: Any, hf_config: Any, degree: int) -> None:
    """`IncompatibleConfigError` unless ``hf_config`` splits evenly over ``degree`` ranks in this layout."""
    fix = f"export with a --tensor_parallel_size that fits, or 1 (got {degree})"
    if family.fused_qkv or family.mlp is not None or family.layer is not None:
        raise IncompatibleConfigError(
            f"tensor parallelism is implemented for families with separate q/k/v and dense gate/up projections "
            f"(llama, qwen2, qwen3, mistral, gemma3), not {hf_config.model_type}: export with --tensor_parallel_size 1."
        )
    heads, kv_heads, _ = _dims(hf_config)
    if heads % degree:
        raise IncompatibleConfigError(f"num_attention_heads={heads} is not divisible by {degree} ranks: {fix}.")
    if kv_heads % degree and degree % kv_heads:
        raise IncompatibleConfigError(
            f"num_key_value_heads={kv_heads} neither splits over {degree} ranks nor replicates evenly on them: {fix}."
        )
    if hf_config.intermediate_size % degree:
        raise IncompatibleConfigError(
            f"intermediate_size={hf_config.intermediate_size} is not divisible by {degree} ranks: {fix}."
        )


def rank_config(hf_config: Any, degree: int) -> Any:
    """A copy of ``hf_config`` with the head counts and intermediate size of one rank (``head_dim`` made explicit):
    the family's decoder built from it has one rank's shapes."""
    heads, kv_heads, head_dim = _dims(hf_config)
    config = copy.deepcopy(hf_config)
    config.num_attention_heads = heads // degree
    config.num_key_value_heads = max(kv_heads // degree, 1)
    config.head_dim = head_dim
    config.intermediate_size = hf_config.intermediate_size // degree
    return config


def _kv_rows(hf_config: Any, degree: int, rank: int) -> slice:
    """The rows of k/v_proj that rank ``rank`` holds: its KV heads, or the one head it shares with other ranks."""
    _, kv_heads, head_dim = _dims(hf_config)
    first, count = rank * kv_heads // degree, max(kv_heads // degree, 1)
    return slice(first * head_dim, (first + count) * head_dim)


def shard_weights(weights: dict[str, torch.Tensor], hf_config: Any, degree: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of the full weight set (contiguous copies of its rows or columns; replicated tensors
    are the same objects)."""
    shards = {}
    for name, tensor in weights.items():
        module, _, kind = name.rpartition(".")
        if module.endswith(KV_PARALLEL):
            part = tensor[_kv_rows(hf_config, degree, rank)]
        elif module.endswith(COLUMN_PARALLEL):
            part = tensor.chunk(degree, dim=0)[rank]
        elif module.endswith(ROW_PARALLEL) and kind == "weight":
            part = tensor.chunk(degree, dim=1)[rank]
        else:
            shards[name] = tensor
            continue
        shards[name] = part.contiguous()
    return shards
