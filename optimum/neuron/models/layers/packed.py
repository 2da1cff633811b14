"""The decoder's linear layers on the packed CPU kernel (`kernels.packed`): packed twins of ``nn.Linear``, of
`RowParallelLinear` and of a tied embedding table, and `pack_decoder`, which swaps them in.

A twin keeps its module's name and parameter names; only its ``weight`` has the packed shape. What gets packed: every
linear layer of the decoder's layers (attention and MLP projections, Phi-3's fused ones, an MoE router), the LM head,
and the embedding table when it is tied to the LM head (then the lookup reads the packed table: one table in memory).
MoE experts (stacked ``[E, out, in]`` tensors), the vision tower and untied embedding tables keep torch's layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.packed import packed_linear, packed_shape
from .embedding import PackedEmbedding, PackedScaledEmbedding, QuantizedEmbedding, ScaledEmbedding
from .packed_linear import PackedLinear
from .parallel import RowParallelLinear


class PackedRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` with a packed weight: its rank's slice of the input features, packed."""

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, None, self.out_features)


PACKED_TWINS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: PackedLinear,
    RowParallelLinear: PackedRowParallelLinear,
    nn.Embedding: PackedEmbedding,
    ScaledEmbedding: PackedScaledEmbedding,
}
"""Each packable module type and its packed twin."""


def pack_decoder(decoder: nn.Module) -> None:
    """Turn, in place, every module of ``decoder`` that `packable` names into its packed twin: the same module (name,
    bias, buffers, device, dtype), its class the twin's and its weight an empty tensor of the packed shape."""
    for name in packable(decoder):
        module = decoder.get_submodule(name)
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        module.__class__ = PACKED_TWINS[type(module)]
        packed = torch.empty(packed_shape(weight.shape), device=weight.device, dtype=weight.dtype)
        module.weight = nn.Parameter(packed, requires_grad=weight.requires_grad)


def packable(decoder: nn.Module) -> list[str]:
    """The modules whose weight the packed layout covers: linear layers under ``model.layers``, the LM head, and the
    embedding table when it is tied to the LM head."""
    tied = bool(getattr(decoder, "tied", False))
    return [name for name, module in decoder.named_modules() if _packable(name, type(module), tied)]


def _packable(name: str, kind: type[nn.Module], tied: bool) -> bool:
    if kind in (nn.Linear, RowParallelLinear):
        return name.startswith("model.layers.") or name == "lm_head"
    return tied and name == "model.embed_tokens" and kind in (nn.Embedding, ScaledEmbedding)


def packed_weights(decoder: nn.Module) -> set[str]:
    """The names of ``decoder``'s packed weights (after `pack_decoder`)."""
    twins = tuple(PACKED_TWINS.values())
    return {f"{name}.weight" for name, module in decoder.named_modules() if isinstance(module, twins)}


def head_logits(decoder_head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``h @ W^T`` for an LM head given as its module: a linear layer (quantized or not), or an embedding table tied
    to it (packed, quantized, or in torch's layout)."""
    if isinstance(decoder_head, nn.Linear):
        return decoder_head(h)
    if isinstance(decoder_head, QuantizedEmbedding):
        return decoder_head.logits(h)
    if isinstance(decoder_head, PackedEmbedding):
        return packed_linear(h, decoder_head.weight, None, decoder_head.num_embeddings)
    assert isinstance(decoder_head, nn.Embedding), f"not an LM head: {type(decoder_head).__name__}"
    return F.linear(h, decoder_head.weight)
