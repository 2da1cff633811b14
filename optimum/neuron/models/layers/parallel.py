"""Tensor parallelism in the Megatron layout (what NxD's ``ColumnParallelLinear`` / ``RowParallelLinear`` do on a
Neuron host): each of ``degree`` ranks holds a slice of every layer and one all-reduce per block sums the slices.

* q/k/v and gate/up projections are **column-parallel**: rank ``r`` holds the output rows of its heads (of its
  slice of the intermediate size). Attention is then local to a rank: its query heads, its KV heads, its own
  part of the KV cache. When the model has fewer KV heads than ranks and they divide the ranks, each KV head is
  **replicated** on the ``degree / kv_heads`` ranks whose query heads use it (GQA groups never straddle a rank).
  Fused projections (Phi-3's ``qkv_proj`` and ``gate_up_proj``) are split part by part: a rank holds its q, k and
  v rows (its gate and up rows), in the checkpoint's order.
* o and down projections are **row-parallel** (`RowParallelLinear`): each rank multiplies its slice of the input
  features and one ``all_reduce`` (sum, `all_reduce`) gives every rank the full output; a bias is added after it.
  A mixture-of-experts block splits every expert the same way (`RowParallelExperts`): the router is replicated,
  so every rank weighs its slice of every expert with the same routing weights before the one all-reduce.
* Embeddings, norms, rotary frequencies and the LM head are **replicated**: every rank computes the same hidden
  states and the same full logits, so every rank's on-device sampler sees identical inputs and picks identical
  tokens (the all-reduce returns the same bits on every rank).
* **Head padding** (NxD pads heads the same way): heads that do not split evenly are padded with zero heads
  (`HeadLayout`). The KV heads are padded to a multiple of the ranks and each GQA group's query heads to a multiple
  of the ranks sharing its KV head; a padded query head has zero q rows and zero o columns, so it adds exactly
  nothing to the output. SmolLM2's 9 query / 3 KV heads run at 2 ranks as 12 / 4 (6 / 2 per rank).

A rank's decoder is the family's own decoder built from `rank_config` (the head counts and intermediate sizes of
one rank) with its o/down projections swapped for row-parallel ones (`make_row_parallel`); its weights are
`shard_weights` of the one full weight set. The graph is the same on every rank (same shapes, the collective
on the default process group): only the weights bound to it differ.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import IncompatibleConfigError
from ...quantization import SCALE
from .attention import attention_dims
from .moe import Experts

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
        out = all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``x @ W_r^T``, before the sum over the ranks."""
        return F.linear(x, self.weight)


class RowParallelExperts(Experts):
    """`Experts` holding a slice of every expert's intermediate features: the routed sum of the slices, then one
    all-reduce. Its parameter names are `Experts`'."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x, weights))


def make_row_parallel(decoder: nn.Module) -> None:
    """Swap every o/down projection (and every experts block) of ``decoder`` for its row-parallel twin of the same
    shape, on the same device and in the same dtype (so a meta decoder stays meta)."""
    for name, module in list(decoder.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if type(module) is nn.Linear and name.endswith(ROW_PARALLEL):
            weight = module.weight
            row: nn.Module = RowParallelLinear(
                module.in_features, module.out_features, bias=module.bias is not None, device=weight.device
            )
        elif type(module) is Experts:
            weight = module.down_proj
            experts, hidden, intermediate = weight.shape
            with torch.device(weight.device):
                row = RowParallelExperts(experts, hidden, intermediate, module.act_name)
        else:
            continue
        setattr(decoder.get_submodule(parent_name), leaf, row.to(weight.dtype))


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads of a model laid out over ``degree`` ranks, padded with zero heads where they do not
    split: KV heads are split in blocks (padded to a multiple of ``degree``) or, when fewer than the ranks and a
    divisor of them, replicated; each GQA group keeps its KV head and is padded to a multiple of the ranks that
    share that head. With ``degree == 1`` or heads that split, nothing is padded."""

    heads: int
    kv_heads: int
    head_dim: int
    degree: int

    @property
    def replicated(self) -> bool:
        """Whether each KV head lives on several ranks (fewer KV heads than ranks, dividing them)."""
        return self.kv_heads < self.degree and self.degree % self.kv_heads == 0

    @property
    def padded_kv_heads(self) -> int:
        return self.kv_heads if self.replicated else math.ceil(self.kv_heads / self.degree) * self.degree

    @property
    def group(self) -> int:
        """Query heads per KV head in the model."""
        return self.heads // self.kv_heads

    @property
    def padded_group(self) -> int:
        """Query heads per KV head once padded: a multiple of the ranks sharing a KV head."""
        sharing = self.degree // self.kv_heads if self.replicated else 1
        return math.ceil(self.group / sharing) * sharing

    @property
    def padded_heads(self) -> int:
        return self.padded_kv_heads * self.padded_group

    @property
    def rank_heads(self) -> int:
        return self.padded_heads // self.degree

    @property
    def rank_kv_heads(self) -> int:
        return 1 if self.replicated else self.padded_kv_heads // self.degree

    def kv_rows(self, rank: int) -> slice:
        """The rows of the padded k/v projections that rank ``rank`` holds."""
        first = rank * self.kv_heads // self.degree if self.replicated else rank * self.rank_kv_heads
        return slice(first * self.head_dim, (first + self.rank_kv_heads) * self.head_dim)

    def pad_q(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor`` with zero query heads inserted along ``dim`` (q rows, or o columns): each group padded to
        `padded_group` heads, then zero groups for the padded KV heads."""
        return self._pad(tensor, dim, (self.kv_heads, self.group), (self.padded_kv_heads, self.padded_group))

    def pad_kv(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor`` with zero KV heads appended along ``dim`` (k/v rows)."""
        return self._pad(tensor, dim, (self.kv_heads,), (self.padded_kv_heads,))

    def _pad(self, tensor: torch.Tensor, dim: int, sizes: tuple[int, ...], padded: tuple[int, ...]) -> torch.Tensor:
        if sizes == padded:
            return tensor
        dim %= tensor.dim()
        shape = tensor.shape
        heads = tensor.reshape(*shape[:dim], *sizes, self.head_dim, *shape[dim + 1 :])
        out = heads.new_zeros(*shape[:dim], *padded, self.head_dim, *shape[dim + 1 :])
        out[(slice(None),) * dim + tuple(slice(0, s) for s in sizes)] = heads
        return out.reshape(*shape[:dim], math.prod(padded) * self.head_dim, *shape[dim + 1 :])


def head_layout(hf_config: Any, degree: int) -> HeadLayout:
    """The `HeadLayout` of ``hf_config`` over ``degree`` ranks."""
    dims = attention_dims(hf_config)
    return HeadLayout(dims.heads, dims.kv_heads, dims.head_dim, degree)


def _split_sizes(hf_config: Any) -> dict[str, int]:
    """The feature sizes that are split in blocks over the ranks: the MLP's intermediate size(s)."""
    names = ("intermediate_size", "moe_intermediate_size")
    return {n: getattr(hf_config, n) for n in names if getattr(hf_config, n, None)}


def check_tensor_parallel(hf_config: Any, degree: int) -> None:
    """`IncompatibleConfigError` unless ``hf_config``'s MLP splits evenly over ``degree`` ranks (heads always fit:
    they are padded, `HeadLayout`)."""
    for name, size in _split_sizes(hf_config).items():
        if size % degree:
            raise IncompatibleConfigError(
                f"{name}={size} is not divisible by {degree} ranks: export with a --tensor_parallel_size that "
                f"divides it, or 1."
            )


def rank_config(hf_config: Any, degree: int) -> Any:
    """A copy of ``hf_config`` with the head counts and intermediate sizes of one rank (``head_dim`` made explicit):
    the family's decoder built from it has one rank's shapes."""
    layout = head_layout(hf_config, degree)
    config = copy.deepcopy(hf_config)
    config.num_attention_heads = layout.rank_heads
    config.num_key_value_heads = layout.rank_kv_heads
    config.head_dim = layout.head_dim
    for name, size in _split_sizes(hf_config).items():
        setattr(config, name, size // degree)
    return config


def _blocks(tensor: torch.Tensor, dim: int, degree: int, rank: int, parts: int = 1) -> torch.Tensor:
    """Rank ``rank``'s block of each of the ``parts`` equal parts of ``tensor`` along ``dim``, concatenated (one
    part: a plain block; two: the gate and up halves of a fused ``gate_up_proj``)."""
    return torch.cat([p.chunk(degree, dim)[rank] for p in tensor.chunk(parts, dim)], dim)


def _qkv_rows(tensor: torch.Tensor, layout: HeadLayout, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a fused ``qkv_proj`` weight or bias: its q rows, then its k rows, then its v rows."""
    kv = layout.kv_heads * layout.head_dim
    q, k, v = tensor.split((layout.heads * layout.head_dim, kv, kv))
    rows = layout.kv_rows(rank)
    return torch.cat(
        [_blocks(layout.pad_q(q, 0), 0, layout.degree, rank), layout.pad_kv(k, 0)[rows], layout.pad_kv(v, 0)[rows]]
    )


_COLUMN_KINDS = ("weight", SCALE)
"""The tensors of a row-parallel projection that have its input columns: its weight, and a quantized weight's scales
spread over the columns (`quantization.graph_form`); its bias is replicated."""


def _shard(name: str, tensor: torch.Tensor, layout: HeadLayout, rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s part of the tensor called ``name`` (contiguous), or None for a replicated tensor."""
    module, _, kind = name.rpartition(".")
    degree = layout.degree
    if module.endswith("self_attn.qkv_proj"):
        return _qkv_rows(tensor, layout, rank)
    if module.endswith("self_attn.q_proj"):
        return _blocks(layout.pad_q(tensor, 0), 0, degree, rank)
    if module.endswith(KV_PARALLEL):
        return layout.pad_kv(tensor, 0)[layout.kv_rows(rank)]
    if module.endswith("self_attn.o_proj") and kind in _COLUMN_KINDS:
        return _blocks(layout.pad_q(tensor, 1), 1, degree, rank)
    if module.endswith(COLUMN_PARALLEL):
        return _blocks(tensor, 0, degree, rank)
    if module.endswith("mlp.gate_up_proj"):
        return _blocks(tensor, 0, degree, rank, parts=2)
    if module.endswith("mlp.down_proj") and kind in _COLUMN_KINDS:
        return _blocks(tensor, 1, degree, rank)
    if module.endswith("mlp.experts"):
        return _blocks(tensor, 1, degree, rank, parts=2) if kind == "gate_up_proj" else _blocks(tensor, 2, degree, rank)
    return None


def shard_weights(weights: dict[str, torch.Tensor], hf_config: Any, degree: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of the full weight set, heads padded with zeros where `HeadLayout` pads them
    (contiguous copies of its rows or columns; replicated tensors are the same objects)."""
    layout = head_layout(hf_config, degree)
    shards = {}
    for name, tensor in weights.items():
        part = _shard(name, tensor, layout, rank)
        shards[name] = tensor if part is None else part.contiguous()
    return shards


def lora_rank_part(
    hf_config: Any, degree: int, rank: int
) -> Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s part of a LoRA adapter's ``(A [r, in], B [out, r])`` on projection ``module``: a row-parallel
    projection's (o, down) columns of A and all of B, any other projection's rows of B (heads padded as its weight's)
    and all of A: sliced as the projection's own weight is (`layers.lora.LoraRowParallel`)."""
    layout = head_layout(hf_config, degree)

    def part(module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if module.endswith(ROW_PARALLEL):
            sliced = _shard(f"{module}.weight", a, layout, rank)
            return (a if sliced is None else sliced.contiguous()), b
        sliced = _shard(f"{module}.weight", b, layout, rank)
        return a, (b if sliced is None else sliced.contiguous())

    return part
