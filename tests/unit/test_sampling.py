"""Sampling (invariant 6): parameter validation, greedy resolution, top-k/top-p semantics, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from optimum.neuron.errors import InputError
from optimum.neuron.kernels import library
from optimum.neuron.models.layers.sampling import _NEG, sample_tokens
from optimum.neuron.runtime.sampling import (
    NO_TOP_K,
    SamplingParams,
    SequenceSampler,
    normalized_top_k,
    sample_on_host,
    sampling_tensors,
)
from optimum.neuron.runtime.speculation import accept

# Vocabulary of 5 where token 3 has p=0.5, token 0 p=0.3, token 4 p=0.2 (tokens 1 and 2 p=0).
PROBS = torch.tensor([0.3, 0.0, 0.0, 0.5, 0.2])
LOGITS = torch.log(PROBS.clamp_min(1e-12))[None]


def sample(uniform: float, top_k: int = 5, top_p: float = 1.0, temperature: float = 1.0, max_topk: int = 5) -> int:
    """One token from `LOGITS` with the graph's sampling rule."""
    out = sample_tokens(
        LOGITS,
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([uniform]),
        max_topk,
    )
    return int(out[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"temperature": "0.7"},
        {"top_p": "1"},
        {"top_k": -2},
        {"top_k": 3.0},
        {"seed": 1.5},
        {"seed": -1},
        {"seed": 2**63},
        {"seed": 2**64},
        {"max_tokens": 0},
        {"logprobs": True},
        {"return_logits": "yes"},
    ],
)
def test_invalid_params_raise_input_error(kwargs: dict) -> None:
    with pytest.raises(InputError):
        SamplingParams(do_sample=True, **kwargs)


@pytest.mark.parametrize(
    ("params", "greedy"),
    [
        (SamplingParams(), True),
        (SamplingParams(do_sample=True), False),
        (SamplingParams(do_sample=True, temperature=0.0), True),
        (SamplingParams(do_sample=True, top_k=1), True),
        (SamplingParams(do_sample=True, top_k=2, top_p=0.5, temperature=0.7), False),
    ],
)
def test_greedy_resolution(params: SamplingParams, greedy: bool) -> None:
    assert params.greedy is greedy
    assert (params.resolve(64) == (1.0, 1, 1.0)) is greedy


@pytest.mark.parametrize(("top_k", "expected"), [(0, 64), (-1, 64), (10, 10), (64, 64)])
def test_top_k_up_to_max_topk(top_k: int, expected: int) -> None:
    assert SamplingParams(do_sample=True, top_k=top_k, temperature=0.5, top_p=0.9).resolve(64) == (0.5, expected, 0.9)


@pytest.mark.parametrize(("given", "stored"), [(None, NO_TOP_K), (0, NO_TOP_K), (-1, NO_TOP_K), (7, 7), (-2, -2)])
def test_no_top_k_filter_has_one_rule(given: object, stored: object) -> None:
    """None (transformers), 0 and -1 (vLLM) all mean no top-k filter; other values are left to SamplingParams."""
    assert normalized_top_k(given) == stored
    if stored != -2:
        assert SamplingParams(do_sample=True, top_k=given).top_k == stored  # type: ignore[arg-type]


def test_values_are_stored_as_plain_python_types() -> None:
    import numpy as np

    params = SamplingParams(do_sample=True, temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(2**63 - 1))
    assert (type(params.temperature), type(params.top_k), type(params.seed)) == (float, int, int)
    assert params.seed == 2**63 - 1


def test_top_k_above_max_topk_is_refused_naming_the_flag() -> None:
    params = SamplingParams(do_sample=True, top_k=65, temperature=0.5)
    for call in (params.check, params.resolve):
        with pytest.raises(InputError, match="--max_topk 65") as info:
            call(64)
        assert "max_topk=64" in str(info.value)
    SamplingParams(top_k=500).check(64)  # greedy: top_k is never used, so it is not refused


@pytest.mark.parametrize("uniform", [0.0, 0.3, 0.999])
def test_top_k_one_is_argmax(uniform: float) -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    rows = logits.shape[0]
    out = sample_tokens(
        logits,
        torch.full((rows,), 2.0),
        torch.ones(rows, dtype=torch.long),
        torch.ones(rows),
        torch.full((rows,), uniform),
        32,
    )
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize(("uniform", "token"), [(0.0, 3), (0.49, 3), (0.51, 0), (0.79, 0), (0.81, 4), (0.999, 4)])
def test_inverse_cdf_over_sorted_candidates(uniform: float, token: int) -> None:
    assert sample(uniform) == token


@pytest.mark.parametrize(("uniform", "token"), [(0.6, 3), (0.7, 0), (0.999, 0)])
def test_top_k_two_renormalizes_over_the_two_best(uniform: float, token: int) -> None:
    # kept probabilities 0.5 / 0.3 -> 0.625 / 0.375
    assert sample(uniform, top_k=2) == token


@pytest.mark.parametrize(("uniform", "token"), [(0.6, 3), (0.7, 0), (0.999, 0)])
def test_top_p_keeps_tokens_until_mass_reached(uniform: float, token: int) -> None:
    # top_p 0.6: mass before token 0 is 0.5 < 0.6 (kept), before token 4 is 0.8 (dropped)
    assert sample(uniform, top_p=0.6) == token


@pytest.mark.parametrize("uniform", [0.0, 0.5, 0.999])
def test_top_p_below_best_probability_keeps_only_the_best(uniform: float) -> None:
    assert sample(uniform, top_p=0.5) == 3
    assert sample(uniform, top_p=0.01) == 3


def test_max_topk_caps_candidates_inside_the_sampler() -> None:
    assert sample(0.999, top_k=5, max_topk=2) == 0
    assert sample(0.999, top_k=5, max_topk=5) == 4


def test_low_temperature_sharpens() -> None:
    assert sample(0.9, temperature=0.05) == 3
    assert sample(0.9, temperature=1.0) == 4


def test_huge_negative_logits_stay_finite() -> None:
    logits = torch.full((1, 8), torch.finfo(torch.float32).min)
    logits[0, 6] = 0.0
    for uniform in (0.0, 0.5, 0.999):
        out = sample_tokens(
            logits, torch.tensor([0.5]), torch.tensor([8]), torch.tensor([1.0]), torch.tensor([uniform]), 8
        )
        assert int(out[0]) == 6
    assert math.isfinite(_NEG) and torch.finfo(torch.float32).min < _NEG


def test_seeded_sampler_is_reproducible() -> None:
    params = SamplingParams(do_sample=True, seed=1234)
    a, b = SequenceSampler(params), SequenceSampler(params)
    stream_a, stream_b = [a.uniform() for _ in range(20)], [b.uniform() for _ in range(20)]
    assert stream_a == stream_b
    assert len(set(stream_a)) == 20 and all(0.0 <= u < 1.0 for u in stream_a)
    other = SequenceSampler(SamplingParams(do_sample=True, seed=1235))
    assert [other.uniform() for _ in range(20)] != stream_a


def test_unseeded_samplers_differ() -> None:
    params = SamplingParams(do_sample=True)
    assert [SequenceSampler(params).uniform() for _ in range(3)] != [
        SequenceSampler(params).uniform() for _ in range(3)
    ]


def test_sampling_tensors_rows() -> None:
    sampler = SequenceSampler(SamplingParams(do_sample=True, temperature=0.8, top_k=0, top_p=0.9, seed=3))
    expected_uniform = SequenceSampler(SamplingParams(seed=3)).uniform()
    t = sampling_tensors([None, sampler], max_topk=16)
    assert t["temperature"].tolist() == pytest.approx([1.0, 0.8])
    assert t["top_k"].tolist() == [1, 16]
    assert t["top_p"].tolist() == pytest.approx([1.0, 0.9])
    assert t["uniforms"].tolist() == pytest.approx([0.0, expected_uniform])
    assert t["top_k"].dtype == torch.long and t["uniforms"].dtype == torch.float32


def test_host_sampling_seeded_and_greedy() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(do_sample=True, temperature=1.5, top_k=20, seed=9)

    def draw() -> list[int]:
        samplers = [SequenceSampler(params), SequenceSampler(params)]
        return [int(sample_on_host(logits, samplers, 32)[0]) for _ in range(10)]

    assert draw() == draw()
    greedy = sample_on_host(logits, [None, SequenceSampler(SamplingParams(seed=1))], 32)
    assert torch.equal(greedy, logits.argmax(-1))


@pytest.mark.parametrize("kernel", [False, True])
def test_greedy_acceptance_picks_what_the_host_sampler_picks_row_by_row(kernel: bool) -> None:
    if kernel:
        library.load()
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(0))
    logits[2, [5, 17, 40]] = logits[2].max() + 1.0  # a tie: the smallest id wins
    sampler = SequenceSampler(SamplingParams())
    by_row = [int(sample_on_host(row[None], [sampler], 8, kernel)[0]) for row in logits]
    assert by_row[2] == 5
    kept = accept(logits, by_row[:6], sampler, 8, kernel)  # every draft what the model picks: all kept, one more
    assert [a.token for a in kept] == by_row
    wrong = [*by_row[:3], by_row[3] + 1, *by_row[4:6]]
    assert [a.token for a in accept(logits, wrong, sampler, 8, kernel)] == by_row[:4]
