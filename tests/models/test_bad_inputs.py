"""Every bad input is refused before anything is held (issue 25, deliverable 1).

Each bad argument of ``generate()`` and of the engine's ``admit`` / ``resume`` is an `InputError` naming the
parameter, not a ``TypeError`` / ``ValueError`` from deeper down; afterwards every KV slot is free and a greedy
generation still equals transformers'. ``admit`` takes the slot last, so even a failure after every check (here
injected) holds nothing.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum.neuron import NeuronModelForCausalLM
from optimum.neuron.errors import InputError
from optimum.neuron.runtime import engine as engine_module
from optimum.neuron.runtime.sampling import SamplingParams
from tests.contract.engine_tools import neuron_model, prompt
from tests.fixtures.llm.models import tiny_model

FIXTURE = "llama-2x4x8-logprobs-eager"
"""Batch 2 (two slots), chunk 8, sequence length 32, with the graphs returning logits (logprobs are servable)."""
PROMPT = prompt(11, seed=3)
NEW = 6

BAD_GENERATE: dict[str, tuple[dict[str, Any], str]] = {
    "seed float": ({"do_sample": True, "seed": 1.5}, "seed"),
    "seed negative": ({"do_sample": True, "seed": -1}, "seed"),
    "seed 2**64": ({"do_sample": True, "seed": 2**64}, "seed"),
    "seed 2**63": ({"do_sample": True, "seed": 2**63}, "seed"),
    "temperature NaN": ({"do_sample": True, "temperature": math.nan}, "temperature"),
    "temperature inf": ({"do_sample": True, "temperature": math.inf}, "temperature"),
    "temperature string": ({"do_sample": True, "temperature": "hot"}, "temperature"),
    "temperature negative": ({"do_sample": True, "temperature": -0.5}, "temperature"),
    "top_p 0": ({"do_sample": True, "top_p": 0.0}, "top_p"),
    "top_p above 1": ({"do_sample": True, "top_p": 1.5}, "top_p"),
    "top_p string": ({"do_sample": True, "top_p": "0.9"}, "top_p"),
    "top_k negative": ({"do_sample": True, "top_k": -2}, "top_k"),
    "top_k not an integer": ({"do_sample": True, "top_k": 2.5}, "top_k"),
    "top_k above max_topk": ({"do_sample": True, "top_k": 10_000}, "top_k"),
    "max_new_tokens 0": ({"max_new_tokens": 0}, "max_new_tokens"),
    "max_new_tokens negative": ({"max_new_tokens": -3}, "max_new_tokens"),
    "max_new_tokens float": ({"max_new_tokens": 2.0}, "max_new_tokens"),
    "num_return_sequences 0": ({"num_return_sequences": 0}, "num_return_sequences"),
    "do_sample string": ({"do_sample": "yes"}, "do_sample"),
}
"""generate() arguments refused, and the parameter each message must name."""

BAD_PARAMS: dict[str, tuple[dict[str, Any], str]] = {
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"max_tokens": -1}, "max_tokens"),
    "logprobs below -1": ({"logprobs": -2}, "logprobs"),
    "logprobs not an integer": ({"logprobs": 1.0}, "logprobs"),
    "prompt_logprobs below -1": ({"prompt_logprobs": -5}, "prompt_logprobs"),
    "seed string": ({"do_sample": True, "seed": "7"}, "seed"),
}
"""`SamplingParams` fields refused when built."""

BAD_ADMIT: dict[str, tuple[dict[str, Any], str]] = {
    "logprobs above the vocabulary": ({"logprobs": 257}, "logprobs=257 exceeds this model's vocabulary of 256"),
    "prompt_logprobs above the vocabulary": ({"prompt_logprobs": 1000}, "prompt_logprobs=1000 exceeds"),
}
"""Parameters valid in themselves that this artifact cannot serve: refused by ``admit``."""


@cache
def expected() -> list[int]:
    """transformers' greedy tokens for `PROMPT` (the reference every check ends with)."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    out = ref.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def model() -> NeuronModelForCausalLM:
    return neuron_model(FIXTURE)


def assert_nothing_held(neuron: NeuronModelForCausalLM) -> None:
    """Every slot free, and a greedy generation equal to transformers'."""
    engine = neuron.engine
    assert engine.slots.free_count == engine.config.batch_size
    assert engine.pool is not None and engine.pool.held == 0, "a KV block is still held"
    out = neuron.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, eos_token_id=[])
    assert out[0, len(PROMPT) :].tolist() == expected()


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_bad_generate_argument_is_refused_and_holds_nothing(case: str) -> None:
    kwargs, name = BAD_GENERATE[case]
    neuron = model()
    batch = torch.tensor([PROMPT, PROMPT])  # both slots: a leaked one would fail the next generate()
    for _ in range(2):
        with pytest.raises(InputError, match=name):
            neuron.generate(batch, **{"max_new_tokens": 3, **kwargs})
    assert_nothing_held(neuron)


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_field_is_refused_naming_it(case: str) -> None:
    kwargs, name = BAD_PARAMS[case]
    with pytest.raises(InputError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("case", list(BAD_ADMIT))
def test_params_the_artifact_cannot_serve_are_refused_at_admit(case: str) -> None:
    kwargs, message = BAD_ADMIT[case]
    neuron = model()
    with pytest.raises(InputError, match=message):
        neuron.engine.admit("bad", PROMPT, SamplingParams(**kwargs))
    assert_nothing_held(neuron)


def test_a_seed_at_the_limit_is_served_and_rows_wrap_below_it() -> None:
    """seed 2**63 - 1 is valid; with two rows the second uses (seed + 1) modulo 2**63, not a refused 2**63."""
    neuron = model()
    out = neuron.generate(torch.tensor([PROMPT, PROMPT]), max_new_tokens=3, do_sample=True, seed=2**63 - 1)
    assert out.shape == (2, len(PROMPT) + 3)
    assert_nothing_held(neuron)


def test_admit_takes_the_slot_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in anything admit builds (here the seeded sampler) leaves no slot held: the slot is taken last."""

    def broken(params: SamplingParams) -> None:
        raise RuntimeError("injected")

    neuron = model()
    monkeypatch.setattr(engine_module, "SequenceSampler", broken)
    for _ in range(3):  # more than the two slots
        with pytest.raises(RuntimeError, match="injected"):
            neuron.engine.admit("x", PROMPT, SamplingParams())
    monkeypatch.undo()
    assert_nothing_held(neuron)


def test_bad_prompts_and_images_at_admit_hold_nothing() -> None:
    neuron = model()
    engine = neuron.engine
    for bad, message in (([], "does not fit"), ([1] * 33, "does not fit"), ([3, 256], "vocabulary"), ([3, 1.5], "int")):
        with pytest.raises(InputError, match=message):
            engine.admit("bad", bad, SamplingParams())
    with pytest.raises(InputError, match="text-only"):
        engine.admit("bad", PROMPT, SamplingParams(), [object()])  # type: ignore[list-item]
    with pytest.raises(InputError, match="SamplingParams"):
        engine.admit("bad", PROMPT, {"temperature": 0.5})  # type: ignore[arg-type]
    assert_nothing_held(neuron)


def test_resume_checks_its_tokens_like_admit() -> None:
    """resume() refuses tokens admit would refuse (or fewer than the prompt) and changes nothing; then resumes."""
    neuron = model()
    engine = neuron.engine
    engine.admit("r", PROMPT, SamplingParams(), reuse=False)  # prefilled whole, though generated before
    try:
        engine.step({"r": len(PROMPT)})
        engine.preempt("r")
        tokens = list(engine.sequence("r").tokens)
        for bad, message in (
            ([*tokens, 256], "vocabulary"),
            ([*tokens, -1], "vocabulary"),
            ([*tokens, "7"], "integers"),
            ([*tokens] * 3, "does not fit"),
            (tokens[:3], "fewer than its 11-token prompt"),
        ):
            with pytest.raises(InputError, match=message):
                engine.resume("r", bad)
            assert engine.sequence("r").slot is None and engine.sequence("r").tokens == tokens
            assert engine.slots.free_count == engine.config.batch_size
        resumed = engine.resume("r", tokens)
        own = len(PROMPT) // engine.block_size * engine.block_size  # its own prompt blocks, still cached
        assert resumed.slot is not None and (resumed.computed, resumed.pending) == (own, len(tokens) - own)
    finally:
        engine.release("r")
    assert_nothing_held(neuron)
