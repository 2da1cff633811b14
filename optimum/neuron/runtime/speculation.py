"""Speculative decoding on the verification graph (`GraphKind.VERIFICATION`, ``--speculation_length K``).

A decoding sequence feeds its last token and up to K proposed ones in one call; row ``i`` of the call's logits is what
the model predicts after the first ``i`` of them. `accept` samples those rows in order with the sequence's own sampler
(the rule and the uniform each token would have had without speculation: greedy rows keep the argmax) and keeps the
proposed tokens while they equal what was sampled; the first sampled token that differs, or the one after the last
proposed token, ends the run. So a step emits between 1 and K + 1 tokens, each exactly the token the model picks after
the ones before it, and the K/V written for rejected proposals lie past the sequence's computed length, where nothing
reads them before they are overwritten.

`propose_lookup` proposes tokens by prompt lookup (transformers' `PromptLookupCandidateGenerator`: the continuation of
the latest earlier occurrence of the sequence's last n-gram), the proposer of ``generate(prompt_lookup_num_tokens=k)``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, cast

import torch

from .sampling import SequenceSampler, sample_on_host
from .sequence import Sequence as Seq

MATCHING_NGRAM = 2
"""The longest n-gram prompt lookup matches (transformers' ``max_matching_ngram_size`` default)."""


class Accepted(NamedTuple):
    """One token a verification call emitted for a sequence, and the logits ``[V]`` it was sampled from."""

    token: int
    logits: torch.Tensor


def unverifiable(sequence: Seq) -> str | None:
    """Why tokens proposed after ``sequence``'s last one cannot be verified now, or None when they can: it must be
    decoding (its prompt in the cache, one sampled token pending), sampled by the engine's own sampler (a
    `HostSampler` samples one row per sequence) and ask no logprobs (a step returns one token's). The one rule a
    drafter and `Admission.check_drafts` both apply."""
    params = sequence.sampler.params
    if not sequence.decoding:
        return "is not decoding (its prompt is not all in the cache, or more than its last token is pending)"
    if params.host is not None:
        return "is sampled by a HostSampler, which samples one token per step"
    if params.logprobs is not None:
        return "asks logprobs, which a step returns for one token only"
    return None


def accept(
    logits: torch.Tensor, drafts: Sequence[int], sampler: SequenceSampler, max_topk: int, kernel: bool = False
) -> list[Accepted]:
    """The tokens a sequence keeps from a verification call: ``logits [>= len(drafts) + 1, V]`` are its rows (row
    ``i``: after its last token and the first ``i`` drafts), sampled in order with ``sampler`` (``kernel``: as
    `sample_on_host`); drafts are kept while they equal the sampled token, and the first sampled token that is not a
    draft ends the list (after every draft kept, the token sampled from the row past them). A greedy sequence's rows
    take one ``argmax`` over them all: the token `sample_on_host` picks for a greedy row (the smallest id among equal
    maxima), without its per-row candidates, which took ~7 % of a verification step at batch 8."""
    rows = len(drafts) + 1
    greedy = logits[:rows].argmax(dim=-1).tolist() if sampler.params.greedy else None
    kept: list[Accepted] = []
    for row in range(rows):
        if greedy is not None:
            token = int(greedy[row])
        else:
            token = int(sample_on_host(logits[row][None], [sampler], max_topk, kernel)[0])
        kept.append(Accepted(token, logits[row]))
        if row == len(drafts) or token != drafts[row]:
            break
    return kept


def propose_lookup(tokens: Sequence[int], most: int, eos_token_ids: Collection[int]) -> list[int]:
    """Up to ``most`` tokens proposed for the sequence ``tokens`` by prompt lookup (transformers'
    `PromptLookupCandidateGenerator`, which also stops a proposal before an end-of-sequence id); none when ``most`` is 0
    or no n-gram matches."""
    if most <= 0 or len(tokens) < 2:
        return []
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long) if eos_token_ids else None
    lookup = PromptLookupCandidateGenerator(
        eos, num_output_tokens=most, max_matching_ngram_size=MATCHING_NGRAM, max_length=len(tokens) + most + 1
    )
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    found, _ = lookup.get_candidates(cast(torch.LongTensor, ids))
    return found[0, len(tokens) :].tolist()
