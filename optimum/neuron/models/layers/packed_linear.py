"""`PackedLinear`, the packed twin of ``nn.Linear`` (`kernels.packed`), and `project`, which runs several of a layer's
projections of one input in one call. Apart from `packed` so that the attention and MLP modules can import it (`packed`
imports `parallel`, which imports the attention)."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.packed import packed_linear, packed_linear_cat


class PackedLinear(nn.Linear):
    """``nn.Linear`` with a packed weight ``[ceil(out / 16), in, 16]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias, self.out_features)


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each of ``linears`` applied to ``x`` (a layer's q, k and v, or its gate and up): in one `packed_linear_cat`
    call when all are plain `PackedLinear` layers (one parallel region for all), each bias added after, which is
    bitwise the separate products (packed_linear's kernel also adds the bias to the finished sum); else one call each
    (torch's layout, quantized and LoRA layers)."""
    layers = [m for m in linears if type(m) is PackedLinear]
    if len(linears) < 2 or len(layers) < len(linears):
        return tuple(m(x) for m in linears)
    sizes = [layer.out_features for layer in layers]
    outs = packed_linear_cat(x, [layer.weight for layer in layers], sizes).split(sizes, dim=-1)
    return tuple(out if layer.bias is None else out + layer.bias for out, layer in zip(outs, layers, strict=True))
