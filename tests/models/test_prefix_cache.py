"""The engine's own paged placement under ``generate()``: a chat loop that re-sends its history prefills only each
new turn (the blocks of earlier calls are reused) and still generates transformers' tokens; ``use_prefix_cache=False``
prefills everything; a pool too small for a call is refused before anything runs, holding nothing."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from optimum.neuron import NeuronModelForCausalLM
from optimum.neuron.runtime.blocks import KVCacheFullError
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sequence import StepResult
from tests.contract.engine_tools import neuron_model, prompt
from tests.fixtures.llm.models import export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy

NEW = 6


def record_prefills(engine: Engine) -> list[tuple[Hashable, int, int]]:
    """A list that receives the ``(sequence, start, count)`` of every prefill the engine runs from now on."""
    ran: list[tuple[Hashable, int, int]] = []
    step = engine.step

    def recorded(*args: object, **kwargs: object) -> StepResult:
        result = step(*args, **kwargs)  # type: ignore[arg-type]
        ran.extend(result.prefills)
        return result

    engine.step = recorded  # type: ignore[method-assign]
    return ran


def test_chat_loop_prefills_only_each_new_turn() -> None:
    model = NeuronModelForCausalLM.from_pretrained(export_fixture("llama-2x8x16-eager"))  # its own: step is wrapped
    engine, block = model.engine, model.engine.block_size
    ran = record_prefills(engine)
    history: list[int] = []
    for turn in range(4):
        history = history + prompt(9 + 4 * turn, 40 + turn)  # the user's new turn
        out = model.generate(torch.tensor([history]), max_new_tokens=NEW, eos_token_id=[])[0, len(history) :]
        assert out.tolist() == hf_greedy(tiny_model("llama"), history, NEW), f"turn {turn}"
        ((_, start, count),) = ran[-1:]
        before = len(history) - (9 + 4 * turn)  # the history the previous calls computed (their last token: not)
        cached = 0 if turn == 0 else (before - 1) // block * block
        assert (start, count) == (cached, len(history) - cached), f"turn {turn}: prefilled {ran[-1]}"
        history = history + out.tolist()
        ran.clear()
    again = model.generate(torch.tensor([history]), max_new_tokens=NEW, eos_token_id=[], use_prefix_cache=False)
    assert ran[-1][1:] == (0, len(history)), "use_prefix_cache=False prefilled from a cached block"
    assert again[0, len(history) :].tolist() == hf_greedy(tiny_model("llama"), history, NEW)


def test_a_pool_too_small_for_the_call_is_refused_holding_nothing() -> None:
    model = neuron_model("llama-2x4x8-pool32-eager")  # 8 blocks of 4 positions
    ids = torch.tensor([prompt(14, 1), prompt(14, 2)])  # 14 + 12 positions each: 7 blocks, 14 together
    with pytest.raises(KVCacheFullError, match="--kv_cache_tokens"):
        model.generate(ids, max_new_tokens=12, eos_token_id=[])
    pool = model.engine.pool
    assert pool is not None and pool.held == 0 and pool.free_count == 8
    assert model.engine.slots.free_count == 2, "a refused call kept a slot"
    one = model.generate(ids[:1], max_new_tokens=12, eos_token_id=[])[0, 14:].tolist()
    assert one == hf_greedy(tiny_model("llama"), ids[0].tolist(), 12), "one sequence fits the pool"
    assert pool.held == 0 and pool.free_count == 8
