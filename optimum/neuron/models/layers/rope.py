"""Rotary position embedding with the inverse frequencies transformers computes for the config.

The frequencies (including Llama-3 / YaRN / dynamic scaling rules applied at init) are taken from
the family's transformers rotary module, so every rope variant it supports is reproduced exactly.
Families whose layer types use different rope bases (Gemma 3: local and global layers) get one set of
frequencies per layer type (`RotaryPerType`); partial rotary (Phi-3's ``partial_rotary_factor``) rotates
the first ``2 * len(inv_freq)`` channels of each head and passes the others through (`apply_rotary`).
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Computes ``cos, sin`` for position ids from a fixed ``inv_freq`` buffer."""

    def __init__(self, hf_rotary: nn.Module, layer_type: str | None = None) -> None:
        """Frequencies of ``hf_rotary`` (its ``inv_freq`` and ``attention_scaling``, or with ``layer_type``
        its ``<layer_type>_inv_freq`` and ``<layer_type>_attention_scaling``, as transformers names them)."""
        super().__init__()
        prefix = f"{layer_type}_" if layer_type else ""
        source = hf_rotary.get_buffer(f"{prefix}inv_freq")
        inv_freq = source.detach().to(torch.float32).clone()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = float(getattr(hf_rotary, f"{prefix}attention_scaling", 1.0))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B, T]`` -> ``cos, sin [B, 1, T, head_dim]`` in ``dtype``."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos[:, None], sin[:, None]


class RotaryPerType(nn.Module):
    """One `Rotary` per layer type, from a transformers rotary module that keeps ``<type>_inv_freq`` buffers
    (Gemma 3's local and global rope bases)."""

    def __init__(self, hf_rotary: nn.Module, layer_types: list[str]) -> None:
        super().__init__()
        self.by_type = nn.ModuleDict({t: Rotary(hf_rotary, t) for t in sorted(set(layer_types))})

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``cos, sin`` of each layer type, as `Rotary.forward` computes them."""
        return {name: rotary(position_ids, dtype) for name, rotary in self.by_type.items()}


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` by the position angles (the "rotate half" convention). When ``cos`` covers
    fewer than ``D`` channels (partial rotary), only those first channels rotate; the rest pass through."""
    dims = cos.shape[-1]
    if dims < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dims], cos, sin), x[..., dims:]), dim=-1)
    # x * cos + rotate_half(x) * sin, one half at a time: the same products and sums (rotate_half's negation is exact),
    # without a rotated copy of x for the compiled graph to write and read back
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    first = x1 * cos[..., :half] - x2 * sin[..., :half]
    second = x2 * cos[..., half:] + x1 * sin[..., half:]
    return torch.cat((first, second), dim=-1)
