"""Logprobs and scores on every backend (eager, inductor; xla in .venv-xla), against transformers (fp32):

* prompt logprobs through chunked prefill and context encoding, prompts of 1, C-1, C, C+1 and 3C+5 tokens, equal
  transformers' log_softmax of the full-prompt forward within 1e-4, seams included; fed in uneven steps too;
  ``score()`` of a padded batch;
* sampled-token logprobs under greedy equal transformers' top-5 at each step (the first token's from the prefill
  logits); the graph returning logits runs only on the steps where a decoding sequence needs them, and a seeded
  temperature / top-k / top-p sequence decoding beside them (its rows then sampled on the host from that graph's
  logits) draws exactly the tokens it draws alone with on-device sampling;
* ``generate(output_scores=True, output_logits=True)`` equals transformers' ``generate`` outputs.
"""

from __future__ import annotations

import pytest
import torch

from optimum.neuron.errors import InputError
from optimum.neuron.graphs import GraphKind
from optimum.neuron.runtime.generate import generate_tokens, score_prompts
from optimum.neuron.runtime.sampling import SamplingParams
from tests.contract.engine_tools import BACKENDS, Recorder, neuron_model, prompt
from tests.fixtures.llm.models import tiny_model
from tests.fixtures.llm.reference import reference_model
from tests.models.exports import CHUNK

PROMPT_LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
TOLERANCE = 1e-4
TOP = 3
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)


def logprobs_fixture(backend: str, chunked: bool) -> str:
    return f"llama-2x4x8-logprobs-{backend}" if chunked else f"llama-2x1x32-ce-logprobs-{backend}"


def reference_logprobs(ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax ``[L, V]`` of the full-prompt forward (row p predicts token p + 1)."""
    with torch.no_grad():
        logits = reference_model(tiny_model("llama"))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_prompt_logprobs(got: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor, ids: list[int]) -> None:
    expected = reference_logprobs(ids)[:-1]
    assert got.shape == (len(ids) - 1,), "one logprob per prompt token but the first"
    if len(ids) == 1:
        return
    want = expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=TOLERANCE), f"{len(ids)} tokens: {(got - want).abs().max():.2e}"
    ref_top = expected.topk(TOP, dim=-1)
    assert torch.equal(top_ids, ref_top.indices), f"{len(ids)} tokens: top-{TOP} ids differ"
    assert torch.allclose(top_values, ref_top.values, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["chunked", "ce"])
def test_prompt_logprobs_match_transformers(mode: str, backend: str) -> None:
    model = neuron_model(logprobs_fixture(backend, mode == "chunked"))
    for length in PROMPT_LENGTHS:
        ids = prompt(length, length)
        got = score_prompts(model.engine, [ids], top=TOP)[0]
        check_prompt_logprobs(got.scores, got.token_ids[:, 1:], got.logprobs[:, 1:], ids)
    short, long = prompt(CHUNK - 1, 1), prompt(3 * CHUNK + 5, 2)
    batch, mask = torch.zeros(2, len(long), dtype=torch.long), torch.zeros(2, len(long), dtype=torch.long)
    batch[0, -len(short) :], mask[0, -len(short) :] = torch.tensor(short), 1  # left-padded
    batch[1], mask[1] = torch.tensor(long), 1
    for row, scores in zip((short, long), model.score(batch, attention_mask=mask), strict=True):
        want = reference_logprobs(row)[:-1].gather(1, torch.tensor(row[1:])[:, None])[:, 0]
        assert torch.allclose(scores, want, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_across_steps_equal_one_step(backend: str) -> None:
    engine = neuron_model(logprobs_fixture(backend, chunked=True)).engine
    ids = prompt(3 * CHUNK + 5, 3)
    engine.admit("split", ids, SamplingParams(prompt_logprobs=TOP))
    try:
        results = [engine.step({"split": count}) for count in (5, CHUNK + 4, CHUNK - 1, 5)]  # seams mid-chunk
    finally:
        engine.release("split")
    assert [bool(r.prompt_logprobs) for r in results] == [False] * 3 + [True], "returned once, when the prompt is in"
    got = results[-1].prompt_logprobs["split"]
    check_prompt_logprobs(got.scores, got.token_ids[:, 1:], got.logprobs[:, 1:], ids)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_top_logprobs_match_transformers(backend: str) -> None:
    engine = neuron_model(logprobs_fixture(backend, chunked=True)).engine
    ids, other, steps = prompt(CHUNK + 3, 11), prompt(5, 12), 6
    want_other = generate_tokens(engine, [other], steps + 2, SAMPLED, set())[0]  # on-device sampling: no logits
    engine.admit("lp", ids, SamplingParams(logprobs=5), reuse=False)
    engine.admit("plain", other, SAMPLED, reuse=False)  # prefilled whole, though generated above
    graphs = dict(engine.graphs)
    recorder = Recorder(engine)
    try:
        results = [engine.step({"lp": len(ids), "plain": len(other)})]
        results += [engine.step({"lp": 1, "plain": 1}) for _ in range(steps)]
        tokens = engine.sequence("lp").generated
        engine.release("lp")
        engine.step({"plain": 1})  # alone again: back to the graph sampling on device
        plain = engine.sequence("plain").generated
    finally:
        engine.release("lp")
        engine.release("plain")
        engine.graphs.update(graphs)
    specs = [engine.specs[name] for name, _ in recorder.calls]
    on_device = [s.samples_on_device for s in specs if s.kind is GraphKind.TOKEN_GENERATION]
    assert on_device == [False] * steps + [True], "the graph returning logits must run only when needed"
    assert plain == want_other, "a seeded sequence sampled from the logits graph's rows changed its tokens"
    expected = reference_logprobs(ids + tokens)[len(ids) - 1 : -1]
    assert int(expected[0].argmax()) == tokens[0]
    for step, (result, token) in enumerate(zip(results, tokens, strict=True)):
        got = result.logprobs["lp"]
        assert got.token_ids[0, 0] == token and int(got.ranks[0]) == 1, "greedy: the sampled token ranks first"
        top = expected[step].topk(5)
        assert torch.equal(got.token_ids[0, 1:], top.indices), f"step {step}: top-5 ids differ"
        assert torch.allclose(got.logprobs[0, 1:], top.values, atol=TOLERANCE), f"step {step}"
        assert abs(float(got.logprobs[0, 0]) - float(expected[step, token])) <= TOLERANCE
        assert "plain" in result.logits and "plain" not in result.logprobs


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_with_logprobs_runs_on_an_artifact_without_decode_logits(backend: str) -> None:
    """max_tokens=1: the token and its logprobs come from the prefill logits; a decode past it is refused."""
    engine = neuron_model(f"llama-2x4x8-{backend}").engine  # --no_decode_logits
    ids = prompt(CHUNK + 2, 14)
    engine.admit("one", ids, SamplingParams(logprobs=2, max_tokens=1), reuse=False)
    try:
        result = engine.step({"one": len(ids)})
        with pytest.raises(InputError, match="max_tokens=1"):
            engine.step({"one": 1})
    finally:
        engine.release("one")
    got, expected = result.logprobs["one"], reference_logprobs(ids)[-1]
    assert int(got.token_ids[0, 0]) == result.tokens["one"] == int(expected.argmax())
    assert torch.allclose(got.logprobs[0, 1:], expected.topk(2).values, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_scores_and_logits_match_transformers(backend: str) -> None:
    model = neuron_model(logprobs_fixture(backend, chunked=True))
    ids, new = torch.tensor([prompt(CHUNK + 2, 13)]), 5
    ours = model.generate(
        ids, max_new_tokens=new, eos_token_id=[], return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    ref = reference_model(tiny_model("llama")).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    assert torch.equal(ours.sequences, ref.sequences)
    assert len(ours.scores) == len(ours.logits) == new
    for step in range(new):
        assert torch.allclose(ours.logits[step], ref.logits[step], atol=TOLERANCE), f"logits, step {step}"
        assert torch.allclose(ours.scores[step], ref.scores[step], atol=TOLERANCE), f"scores, step {step}"
