"""``min_p`` against a reference that does not use vLLM: transformers' ``MinPLogitsWarper`` (issue 25, deliverable 6).

A request with ``min_p`` is sampled by vLLM's own sampler through the plugin's host-sampling adapter (the
`HostSampler` the engine calls; ``needs_vllm_sampler``). Sampled many times with seeded generators from fixed
logits, every token it draws must be in the set transformers' warper keeps (after the temperature, as both apply
it), every kept token must be drawn, and the frequencies must follow the warper's renormalized probabilities.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper
from vllm import SamplingParams as VllmParams

from optimum.neuron.runtime.sampling import SequenceSampler
from optimum.neuron.runtime.sequence import Sequence
from optimum.neuron.vllm.host_sampling import HostSampling
from optimum.neuron.vllm.sampling import to_sampling_params

pytestmark = [pytest.mark.vllm]
VOCAB, ROWS, CALLS = 32, 8, 250
"""2000 draws: a kept token of probability p is drawn with frequency within 0.04 of p (over 4 standard deviations)."""


def warper_probabilities(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """transformers' temperature then min-p warpers on ``logits [V]``, as probabilities (0 where filtered)."""
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())  # type: ignore[arg-type]
    return torch.softmax(MinPLogitsWarper(min_p)(None, scores)[0], dim=-1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("temperature", "min_p"), [(0.8, 0.1), (1.3, 0.3)])
def test_min_p_keeps_the_tokens_transformers_keeps(temperature: float, min_p: float) -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 1.5
    expected = warper_probabilities(logits, temperature, min_p)
    kept = set(torch.nonzero(expected).flatten().tolist())
    assert 2 < len(kept) < VOCAB, "the case must filter some tokens and keep several"
    rows = {}
    for slot in range(ROWS):
        params = to_sampling_params(VllmParams(temperature=temperature, min_p=min_p, seed=100 + slot))
        assert params.host is not None, "min_p is sampled by vLLM's sampler (HostSampling)"
        rows[slot] = Sequence(f"r{slot}", slot, [3, 4, 5], 3, 32, SequenceSampler(params))
    host = HostSampling(ROWS, VOCAB)
    counts = torch.zeros(VOCAB)
    for _ in range(CALLS):
        tokens, _ = host.sample(logits.expand(ROWS, VOCAB).clone(), rows, None)
        for token in tokens.values():
            counts[token] += 1
    drawn = set(torch.nonzero(counts).flatten().tolist())
    assert drawn <= kept, f"drew tokens transformers' MinPLogitsWarper filters: {sorted(drawn - kept)}"
    assert drawn == kept, f"never drew kept tokens {sorted(kept - drawn)}"
    frequencies = counts / counts.sum()
    assert float((frequencies - expected).abs().max()) < 0.04, (frequencies, expected)
