"""RMSNorm, computed exactly as transformers does (fp32 variance, cast back before the scale), and Gemma's
``1 + weight`` variant (scale applied in fp32, then cast back)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the scale is ``1 + weight`` and is applied in fp32 before the cast back (transformers'
    ``Gemma3RMSNorm``; the checkpoint stores the offset ``weight``, zero-centred)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)
