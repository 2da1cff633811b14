"""Greedy parity with transformers for every family, backend and prefill mode (DESIGN.md §8).

Chunked prefill (C = 8, S = 32) and context encoding (S = 32) must both give transformers' greedy
tokens at the boundary lengths, and last-token logits within 1e-4 (fp32).
"""

from __future__ import annotations

import pytest
import torch

from optimum.neuron import NeuronModelForCausalLM
from tests.fixtures.llm.models import FAMILIES, export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy as reference_greedy
from tests.fixtures.llm.reference import reference_model

CHUNK = 8
SEQUENCE_LENGTH = 4 * CHUNK
LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK, 4 * CHUNK]
NEW_TOKENS = 6
LOGIT_TOLERANCE = 1e-4

_models: dict[str, NeuronModelForCausalLM] = {}


def neuron_model(name: str) -> NeuronModelForCausalLM:
    if name not in _models:
        _models[name] = NeuronModelForCausalLM.from_pretrained(export_fixture(name))
    return _models[name]


def reference(family: str) -> torch.nn.Module:
    return reference_model(tiny_model(family))


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + length)
    return torch.randint(3, 256, (1, length), generator=generator)


def hf_greedy(family: str, ids: torch.Tensor, new: int = NEW_TOKENS) -> list[int]:
    return reference_greedy(tiny_model(family), ids[0].tolist(), new)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("mode", ["chunked", "ce"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family: str, mode: str, backend: str) -> None:
    name = f"{family}-2x4x8-{backend}" if mode == "chunked" else f"{family}-2x1x32-ce-{backend}"
    model = neuron_model(name)
    for length in LENGTHS:
        ids = prompt(length)
        new = min(NEW_TOKENS, SEQUENCE_LENGTH - length + 1)  # a 4C = S prompt fills the cache: one token
        ours = model.generate(ids, max_new_tokens=new, eos_token_id=[])[0, length:].tolist()
        assert ours == hf_greedy(family, ids, new), f"{name}: prompt length {length}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match(family: str, backend: str) -> None:
    chunked = neuron_model(f"{family}-2x4x8-{backend}").engine
    ce = neuron_model(f"{family}-2x1x32-ce-{backend}").engine
    ref = reference(family)
    for length in (1, CHUNK + 1, 3 * CHUNK + 3, 4 * CHUNK):
        ids = prompt(length)
        with torch.no_grad():
            expected = ref(ids).logits[0, -1]
        got_chunked = chunked.prefill(ids[0].tolist(), 1)
        got_ce = ce.prefill(ids[0].tolist(), 1)
        assert torch.allclose(got_chunked, expected, atol=LOGIT_TOLERANCE), (got_chunked - expected).abs().max()
        assert torch.allclose(got_ce, expected, atol=LOGIT_TOLERANCE), (got_ce - expected).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["llama-2x4x8-inductor", "qwen2-2x1x32-ce-inductor", "llama-2x4x8-hostsampling-inductor"]
)
def test_mixed_batch_equals_alone(name: str) -> None:
    model = neuron_model(name)
    short, long = prompt(3, seed=1)[0], prompt(2 * CHUNK + 5, seed=2)[0]
    width = long.shape[0]
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    ids[0, width - 3 :], mask[0, width - 3 :] = short, 1  # left padding
    ids[1], mask[1] = long, 1
    together = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])[:, width:]
    alone_short = model.generate(short[None], max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, 3:]
    alone_long = model.generate(long[None], max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, width:]
    assert together[0].tolist() == alone_short.tolist()
    assert together[1].tolist() == alone_long.tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["llama-2x4x8-inductor", "llama-2x1x32-ce-inductor", "llama-2x4x8-hostsampling-inductor"]
)
def test_seeded_sampling(name: str) -> None:
    model = neuron_model(name)
    ids = prompt(CHUNK + 3)
    kwargs = {
        "max_new_tokens": 12,
        "do_sample": True,
        "temperature": 1.5,
        "top_k": 50,
        "top_p": 0.95,
        "eos_token_id": [],
    }
    first = model.generate(ids, seed=7, **kwargs)
    assert torch.equal(first, model.generate(ids, seed=7, **kwargs))
    assert not torch.equal(first, model.generate(ids, seed=8, **kwargs)), "different seeds gave the same tokens"
    greedy = model.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(model.generate(ids, seed=3, **{**kwargs, "top_k": 1}), greedy)


@pytest.mark.slow
def test_sampling_same_for_chunked_and_ce() -> None:
    ids = prompt(2 * CHUNK + 1)
    kwargs = {"max_new_tokens": 10, "do_sample": True, "temperature": 1.2, "top_k": 40, "seed": 11, "eos_token_id": []}
    chunked = neuron_model("llama-2x4x8-inductor").generate(ids, **kwargs)
    ce = neuron_model("llama-2x1x32-ce-inductor").generate(ids, **kwargs)
    assert torch.equal(chunked, ce)
