"""Token embeddings: plain, scaled by a constant (Gemma), and the twins that read a table kept in the packed layout
(`kernels.packed`: a tied table is also the LM head, which the packed kernel multiplies by)."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.packed import packed_rows


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times a constant (Gemma: ``sqrt(hidden_size)``), the constant cast to the weights'
    dtype first as transformers does (``embed_scale`` is a buffer, so part of the weight set)."""

    def __init__(self, vocab: int, hidden: int, scale: float) -> None:
        super().__init__(vocab, hidden)
        with torch.device("cpu"):  # a real value even when the rest is built on the meta device
            self.embed_scale: torch.Tensor
            self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class PackedEmbedding(nn.Embedding):
    """An embedding whose table ``[vocab, hidden]`` is held packed, ``[vocab / 16, hidden, 16]``: the rows are read
    from the panels (`kernels.packed.packed_rows`), the same values as the unpacked table's."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return packed_rows(self.weight, input_ids)


class PackedScaledEmbedding(ScaledEmbedding, PackedEmbedding):
    """`ScaledEmbedding` over a packed table."""
