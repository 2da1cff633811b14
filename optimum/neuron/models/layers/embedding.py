"""Token embeddings: plain, scaled by a constant (Gemma), the twins that read a table kept in the packed layout
(`kernels.packed`: a tied table is also the LM head, which the packed kernel multiplies by), and the twins of a tied
table quantized to int8 per row (``--lm_head_format int8``), in torch's layout or the packed one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.packed import packed_qlinear, packed_rows
from ...quantization import dequantize


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times a constant (Gemma: ``sqrt(hidden_size)``), the constant cast to the weights'
    dtype first as transformers does (``embed_scale`` is a buffer, so part of the weight set)."""

    def __init__(self, vocab: int, hidden: int, scale: float) -> None:
        super().__init__(vocab, hidden)
        with torch.device("cpu"):  # a real value even when the rest is built on the meta device
            self.embed_scale: torch.Tensor
            self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input_ids)
        return rows * self.embed_scale.to(rows.dtype)  # the table's dtype (a quantized table's: its float dtype)


class PackedEmbedding(nn.Embedding):
    """An embedding whose table ``[vocab, hidden]`` is held packed, ``[vocab / 16, hidden, 16]``: the rows are read
    from the panels (`kernels.packed.packed_rows`), the same values as the unpacked table's."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return packed_rows(self.weight, input_ids)


class PackedScaledEmbedding(ScaledEmbedding, PackedEmbedding):
    """`ScaledEmbedding` over a packed table."""


class QuantizedEmbedding(nn.Embedding):
    """A tied embedding / LM head table quantized per row: ``weight`` int8 ``[vocab, hidden]``, ``weight_scale``
    float32 ``[vocab, 1]``. The lookup returns ``q[id] * scale[id]`` in ``float_dtype``; the head multiplies by the
    dequantized table in the graph (`logits`): the same numbers as the float table ``q * scale``."""

    weight_scale: nn.Parameter
    float_dtype: torch.dtype
    """The dtype the rows are returned in (``auto_cast_type``: what the table had before it was quantized)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[input_ids].to(torch.float32) * self.weight_scale[input_ids]
        return rows.to(self.float_dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h @ (q * scale)^T``."""
        return F.linear(h, dequantize(self.weight, self.weight_scale).to(h.dtype))


class PackedQuantizedEmbedding(QuantizedEmbedding):
    """`QuantizedEmbedding` on the packed kernel's int8 panels (``[vocab / 16, hidden, 16]``) and scales
    (``[1, vocab / 16 * 16]``): the lookup reads its rows from the panels, the head is ``packed_qlinear``, which
    streams the int8 bytes."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scales = self.weight_scale[0, input_ids].unsqueeze(-1)
        return (packed_rows(self.weight, input_ids).to(torch.float32) * scales).to(self.float_dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return packed_qlinear(h, self.weight, self.weight_scale, None, self.num_embeddings)


class QuantizedScaledEmbedding(ScaledEmbedding, QuantizedEmbedding):
    """`ScaledEmbedding` over a quantized table."""


class PackedQuantizedScaledEmbedding(ScaledEmbedding, PackedQuantizedEmbedding):
    """`ScaledEmbedding` over a packed quantized table."""
