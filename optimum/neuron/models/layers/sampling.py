"""Token sampling from logits: the one sampling rule, used inside the token-generation graph
(on-device sampling) and on the host for prefill logits (hybrid sampling, invariant 6).

It is a pure function: randomness comes in as one uniform per row, drawn by the caller from a
seeded generator, so the same seed gives the same tokens on every backend and path. `kept_candidates` is
the one top-k / top-p rule: `sample_tokens` draws from the candidates it keeps, `processed_scores` shows them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...kernels.candidates import top_candidates

_NEG = -1.0e30  # finite large negative in fp32: never the dtype minimum (invariant 7)


class Candidates(NamedTuple):
    """The ``k`` candidates of each row, best first (`kept_candidates`)."""

    indices: torch.Tensor
    """``[B, k]`` their token ids."""
    scaled: torch.Tensor
    """``[B, k]`` fp32 their logits divided by the row's temperature."""
    probs: torch.Tensor
    """``[B, k]`` fp32 the softmax of ``scaled`` over the top-k candidates (exactly 0 for the others)."""
    kept: torch.Tensor
    """``[B, k]`` bool: the candidates top-k and top-p keep (the best one always)."""


def kept_candidates(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_topk: int,
    kernel: bool = False,
) -> Candidates:
    """The candidates of each row of ``logits [B, V]`` and which of them the sampler keeps: the ``max_topk``
    largest logits (`_candidates`), divided by ``temperature [B] > 0``; the first ``top_k [B]`` of them
    (``1..max_topk``, 1 = greedy); of those, each one whose preceding candidates' probability mass is below
    ``top_p [B]`` (in ``(0, 1]``), the best one always. ``kernel``: the candidates from the toolkit's CPU kernel
    (`kernels.candidates`; `_candidates` says where they may differ from torch's)."""
    values, indices = _candidates(logits, min(max_topk, logits.shape[-1]), kernel)
    rank = torch.arange(values.shape[-1], device=logits.device)[None, :]
    scaled = values / temperature.to(torch.float32)[:, None]
    in_top_k = rank < top_k[:, None]
    probs = torch.softmax(torch.where(in_top_k, scaled, torch.full_like(scaled, _NEG)), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    kept = in_top_k & ((mass_before < top_p[:, None]) | (rank == 0))
    return Candidates(indices, scaled, probs, kept)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    max_topk: int,
    kernel: bool = False,
) -> torch.Tensor:
    """Sample one token per row of ``logits [B, V]`` from the candidates `kept_candidates` keeps: their
    probabilities renormalized, the token picked by inverse CDF at ``uniforms [B]`` (in ``[0, 1)``).
    Candidates are ordered best first, equal logits by increasing token id (so greedy is ``argmax``, ties
    included). ``kernel``: as `kept_candidates`."""
    found = kept_candidates(logits, temperature, top_k, top_p, max_topk, kernel)
    probs = torch.where(found.kept, found.probs, torch.zeros_like(found.probs))
    cdf = torch.cumsum(probs, dim=-1)
    threshold = uniforms.to(torch.float32)[:, None] * cdf[:, -1:]
    choice = (cdf <= threshold).sum(dim=-1).clamp(max=probs.shape[-1] - 1)
    return found.indices.gather(1, choice[:, None]).squeeze(1)


def _candidates(logits: torch.Tensor, k: int, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row (fp32) and their token ids, best first, equal logits in
    increasing token id order. That is how ``argmax`` (and transformers' greedy search) breaks ties;
    ``topk``'s own order among equal values is unspecified and differs between kernels, and ties are
    common in bf16 logits. Which of several logits equal to the ``k``-th largest are kept is ``topk``'s choice
    here; ``kernel``: the toolkit's CPU kernel (`kernels.candidates.top_candidates`) keeps those of the smallest ids,
    and selects in one pass over each row instead of ``topk`` and its sorts (the same tensors otherwise)."""
    if kernel:
        return top_candidates(logits.to(torch.float32), k)
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
    kernel: bool = False,
) -> torch.Tensor:
    """What `sample_tokens` draws from, as transformers' ``output_scores`` show it: ``[B, V]`` fp32, the logits
    divided by the temperature for the candidates `kept_candidates` keeps, ``-inf`` for every other token.
    ``kernel``: as `kept_candidates`."""
    found = kept_candidates(logits, temperature, top_k, top_p, max_topk, kernel)
    out = torch.full(logits.shape, -torch.inf, dtype=torch.float32, device=logits.device)
    kept = torch.where(found.kept, found.scaled, torch.full_like(found.scaled, -torch.inf))
    return out.scatter(1, found.indices, kept)
