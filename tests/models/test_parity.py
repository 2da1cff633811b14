"""Parity beyond the backend contract (DESIGN.md §8): mixed batches equal each prompt alone, host
sampling is seeded, and chunked prefill samples what context encoding samples.

Greedy parity with transformers for every family, backend and prefill mode, and the last-token
logits, are part of the backend contract: ``tests/contract/test_backend_contract.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.contract.engine_tools import neuron_model
from tests.models.exports import CHUNK

NEW_TOKENS = 6


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + length)
    return torch.randint(3, 256, (1, length), generator=generator)


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
@pytest.mark.parametrize("name", ["llama-2x4x8-hostsampling-inductor"])  # on-device sampling: the contract suite
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
