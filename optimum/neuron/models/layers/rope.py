"""Rotary position embedding with the inverse frequencies transformers computes for the config.

The frequencies (including Llama-3 / YaRN / dynamic scaling rules applied at init) are taken from
the family's transformers rotary module, so every rope variant it supports is reproduced exactly.
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Computes ``cos, sin`` for position ids from a fixed ``inv_freq`` buffer."""

    def __init__(self, hf_rotary: nn.Module) -> None:
        super().__init__()
        source = hf_rotary.get_buffer("inv_freq")
        inv_freq = source.detach().to(torch.float32).clone()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = float(getattr(hf_rotary, "attention_scaling", 1.0))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B, T]`` -> ``cos, sin [B, 1, T, head_dim]`` in ``dtype``."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos[:, None], sin[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` by the position angles (the "rotate half" convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
