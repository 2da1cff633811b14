"""Token sampling from logits: the one sampling rule, used inside the token-generation graph
(on-device sampling) and on the host for prefill logits (hybrid sampling, invariant 6).

It is a pure function: randomness comes in as one uniform per row, drawn by the caller from a
seeded generator, so the same seed gives the same tokens on every backend and path.
"""

from __future__ import annotations

import torch

_NEG = -1.0e30  # finite large negative in fp32: never the dtype minimum (invariant 7)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    max_topk: int,
) -> torch.Tensor:
    """Sample one token per row of ``logits [B, V]``.

    ``top_k [B]`` in ``1..max_topk`` (1 = greedy), ``temperature [B] > 0``, ``top_p [B]`` in
    ``(0, 1]``, ``uniforms [B]`` in ``[0, 1)``. Candidates are the ``max_topk`` largest logits, equal
    ones by increasing token id (so greedy is ``argmax``, ties included); the kept ones are
    renormalized and the token is picked by inverse CDF at the uniform.
    """
    values, indices = _candidates(logits, min(max_topk, logits.shape[-1]))
    k = values.shape[-1]
    rank = torch.arange(k, device=logits.device)[None, :]
    scaled = values / temperature.to(torch.float32)[:, None]
    scaled = torch.where(rank < top_k[:, None], scaled, torch.full_like(scaled, _NEG))
    probs = torch.softmax(scaled, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = torch.where((mass_before < top_p[:, None]) | (rank == 0), probs, torch.zeros_like(probs))
    cdf = torch.cumsum(probs, dim=-1)
    threshold = uniforms.to(torch.float32)[:, None] * cdf[:, -1:]
    choice = (cdf <= threshold).sum(dim=-1).clamp(max=k - 1)
    return indices.gather(1, choice[:, None]).squeeze(1)


def _candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row (fp32) and their token ids, best first, equal logits in
    increasing token id order. That is how ``argmax`` (and transformers' greedy search) breaks ties;
    ``topk``'s own order among equal values is unspecified and differs between kernels, and ties are
    common in bf16 logits."""
    values, indices = torch.topk(logits.to(torch.float32), k, dim=-1)
    indices, by_id = torch.sort(indices, dim=-1)
    values, by_value = torch.sort(values.gather(-1, by_id), dim=-1, descending=True, stable=True)
    return values, indices.gather(-1, by_value)


def processed_scores(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_topk: int,
) -> torch.Tensor:
    """What `sample_tokens` draws from, as transformers' ``output_scores`` show it: ``[B, V]`` fp32, the logits
    divided by the temperature for the candidates that top-k and top-p keep, ``-inf`` for every other token."""
    values, indices = _candidates(logits, min(max_topk, logits.shape[-1]))
    rank = torch.arange(values.shape[-1], device=logits.device)[None, :]
    scaled = values / temperature.to(torch.float32)[:, None]
    in_top_k = rank < top_k[:, None]
    probs = torch.softmax(torch.where(in_top_k, scaled, torch.full_like(scaled, _NEG)), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    kept = in_top_k & ((mass_before < top_p[:, None]) | (rank == 0))
    out = torch.full(logits.shape, -torch.inf, dtype=torch.float32, device=logits.device)
    return out.scatter(1, indices, torch.where(kept, scaled, torch.full_like(scaled, -torch.inf)))
