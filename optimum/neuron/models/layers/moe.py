"""Sparse mixture-of-experts MLP (Qwen3-MoE) with static shapes: every expert is computed for every token
and the results are summed with the routing weights, zero for the experts a token did not pick.

Routing is transformers' own (``Qwen3MoeTopKRouter``): softmax over the router logits in fp32, the
``top_k`` largest, renormalized to sum to 1 when ``norm_topk_prob``, cast back to the model dtype. No
shape or branch depends on the routing, and a token's output depends on that token alone, so the padded
columns of a chunk cannot change a real one (invariant 4). Why all experts rather than a fixed-capacity
dispatch: ``docs/architecture.md`` ("Mixture of experts"), measured with ``benchmark/moe_dispatch.py``.

Parameter names equal transformers' in-memory ones: ``gate.weight [E, H]``, ``experts.gate_up_proj
[E, 2I, H]`` (gate rows first), ``experts.down_proj [E, H, I]``; checkpoints that store one tensor per
expert are stacked at load (`optimum.neuron.weights.stack_experts`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


def routing_weights(router_logits: torch.Tensor, top_k: int, normalize: bool) -> torch.Tensor:
    """``[N, E]`` router logits -> ``[N, E]`` weights in their dtype: the ``top_k`` softmax probabilities of
    each row (renormalized when ``normalize``), zero elsewhere."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(router_logits.dtype)
    return torch.zeros_like(router_logits).scatter(1, index, top)


class Experts(nn.Module):
    """``E`` gated MLPs stored as stacked tensors, all applied to every token."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act_name, self.act = act, ACT2FN[act]

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [N, H]``, ``weights [N, E]`` -> ``sum_e weights[:, e] * expert_e(x)``, ``[N, H]``."""
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
        out = torch.matmul(self.act(gate) * up, self.down_proj.transpose(1, 2))  # [E, N, H]
        return (out * weights.t()[:, :, None]).sum(dim=0)


class SparseMoeBlock(nn.Module):
    """Router + experts: transformers' ``Qwen3MoeSparseMoeBlock`` with static shapes."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool, act: str) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate, act)
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, H]`` -> ``[B, T, H]``."""
        flat = x.reshape(-1, x.shape[-1])
        weights = routing_weights(self.gate(flat), self.top_k, self.normalize)
        return self.experts(flat, weights).reshape(x.shape)
