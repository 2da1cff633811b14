"""Gated MLP: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


class GatedMLP(nn.Module):
    """The SwiGLU-style MLP shared by the llama, mistral and qwen families."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
