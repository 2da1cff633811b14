"""Gated MLPs: ``down(act(gate(x)) * up(x))``, with separate or fused (Phi-3) gate and up projections. With SiLU and
packed fp32 weights, the gate and up products and the activation run in one kernel call (`swiglu`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .packed_linear import SILU, fused_swiglu, project, swiglu


class GatedMLP(nn.Module):
    """The SwiGLU-style MLP shared by the llama, mistral, qwen and Gemma families."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACT2FN[act]
        self.silu = act in SILU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = swiglu(x, self.gate_proj, self.up_proj) if self.silu else None
        if fused is not None:
            return self.down_proj(fused)
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(self.act(gate) * up)


class FusedGatedMLP(nn.Module):
    """The same MLP with gate and up in one ``gate_up_proj`` matmul (Phi-3's checkpoint layout: the gate
    is the first half of its output, up the second)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACT2FN[act]
        self.silu = act in SILU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_swiglu(x, self.gate_up_proj) if self.silu else None
        if fused is not None:
            return self.down_proj(fused)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))
