"""Speculative decoding on the verification graph (`--speculation_length 3`, issue 30).

Proposed tokens are given to `Engine.step` by hand: the next tokens of transformers' own greedy run (all kept) or
with one of them wrong (kept up to it, then the model's own token), so every test knows what must be kept. A sequence
generates across a chunk seam (prompts of 10 tokens, chunks of 8) and the KV window edge at 16, and its later steps
read the K/V its kept proposals wrote; the tokens must equal transformers' greedy ones for every family. Also: decodes
with and without proposals beside a prefill in one step, seeded sampling through the verification graph (the same
tokens as without it), `generate(prompt_lookup_num_tokens=k)` and the refusals.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optimum.neuron.errors import InputError
from optimum.neuron.graphs import GraphKind, GraphSpec, graph_args
from optimum.neuron.runtime.padding import VerifyRow, packed_verify_rows, verify_rows
from optimum.neuron.runtime.sampling import SamplingParams
from optimum.neuron.runtime.speculation import propose_lookup
from tests.contract.engine_tools import GREEDY, Recorder, engine_for, prompt
from tests.fixtures.llm.models import FAMILIES, export_fixture, fixture_named
from tests.fixtures.llm.reference import hf_greedy, hf_sampled
from tests.models.speculation import PLAN, K, proposal, spec_engine, spec_name, speculate


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_proposals_generate_transformers_tokens(family: str) -> None:
    ids = prompt(10, seed=60)
    reference = hf_greedy(fixture_named(spec_name(family, "eager")).model(), ids, 20)
    engine = spec_engine(family, "eager")
    recorder = Recorder(engine)
    assert speculate(engine, "s", ids, reference) == reference
    widths = verification_widths(recorder)
    assert set(widths) == {2, 3, K + 1} and widths[:3] == [4, 2, 3], "the narrowest width holding each proposal"


@pytest.mark.slow
def test_inductor_verification_graph_generates_transformers_tokens() -> None:
    engine = spec_engine("llama", "inductor")
    recorder = Recorder(engine)
    ids = prompt(10, seed=60)
    reference = hf_greedy(fixture_named(spec_name("llama", "inductor")).model(), ids, 20)
    assert speculate(engine, "s", ids, reference) == reference
    windows = {window for name, window in recorder.windows() if name == "verification"}
    assert windows == {16, 20, 24, 28}, "the verification graph runs in the fewest blocks covering each call"
    assert verification_widths(recorder) == [1 + n for n in PLAN], "a call computes the columns its proposal needs"


def verification_widths(recorder: Recorder) -> list[int]:
    """The columns of each verification call, in order (``input_ids [B, C]``, packed ``[1, N]``: one sequence's
    columns are its row's)."""
    return [args[0].shape[1] for name, args in recorder.calls if name == "verification"]


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_decodes_with_and_without_proposals_beside_a_prefill(backend: str) -> None:
    """Step 1: ``a`` prefills. Step 2: ``a`` decodes with proposals while ``b`` prefills its first chunk. Then both
    decode in one verification call, ``a`` with proposals and ``b`` without; ``b``'s tokens and ``a``'s equal
    transformers'. The call is packed (`GraphSpec.packed`): ``b``, proposing nothing, computes one column, and the
    free slots none."""
    engine = spec_engine("llama", backend)
    assert engine.specs["verification"].packed
    recorder = Recorder(engine)
    model = fixture_named(spec_name("llama", backend)).model()
    a_ids, b_ids = prompt(6, seed=61), prompt(12, seed=62)
    a_ref, b_ref = hf_greedy(model, a_ids, 22), hf_greedy(model, b_ids, 6)
    engine.admit("a", a_ids, GREEDY, reuse=False)
    engine.admit("b", b_ids, GREEDY, reuse=False)
    engine.step({"a": len(a_ids)})
    a, b = engine.sequence("a"), engine.sequence("b")
    result = engine.step({"a": 1, "b": 8}, drafts={"a": a_ref[1:4]})
    assert result.accepted["a"] == 3 and result.prefills == [("b", 0, 8)]
    assert result.width == 4, "the decode call's columns: the last token and the 3 proposed"
    engine.step({"a": 1, "b": 4}, drafts={"a": a_ref[5:7]})
    while len(b.generated) < len(b_ref):
        drafts = a_ref[len(a.generated) : len(a.generated) + 1]
        result = engine.step({"a": 1, "b": 1}, drafts={"a": drafts} if drafts else {})
        assert "b" not in result.accepted
        if drafts:  # a's last token and proposals, then b's last token
            assert verification_widths(recorder)[-1] == 2 + len(drafts) and result.width == (2 + len(drafts)) / 2
    assert b.generated == b_ref and a.generated == a_ref[: len(a.generated)]


def test_packed_columns_get_the_logits_of_padded_rows() -> None:
    """The packed verification graph computes each column as a graph of padded rows does: ``a``'s 4 columns then
    ``b``'s one give bitwise the logits of their rows (eager, the CPU kernels: a linear layer's row and a column's
    attention depend on that column only), and the padded columns change nothing."""
    engine = spec_engine("llama", "eager")
    for seq_id, seed in (("a", 71), ("b", 72)):
        engine.admit(seq_id, prompt(9, seed=seed), GREEDY, reuse=False)
        engine.step({seq_id: 9})
    a, b = engine.sequence("a"), engine.sequence("b")
    assert a.slot is not None and b.slot is not None
    engine.placement.ensure(a, 13)  # the blocks of a's 4 columns, as a step gives them
    rows = {a.slot: VerifyRow([a.tokens[-1], 5, 6, 7], 9, a.blocks), b.slot: VerifyRow([b.tokens[-1]], 9, b.blocks)}
    packed = engine.specs["verification"]
    padded = dataclasses.replace(packed, batch=2, tokens=K + 1, chunks=(K + 1,), chunk_size=K + 1, packed=False)
    width, bs = 16 // engine.block_size, engine.block_size

    def run(spec: GraphSpec, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return engine._module(spec)(*graph_args(GraphKind.VERIFICATION, inputs, engine.kv_cache))

    by_row = run(padded, verify_rows(2, rows, K + 1, width, bs))
    for columns in (5, 8):
        by_column = run(packed, packed_verify_rows([rows[a.slot], rows[b.slot]], columns, width, bs))
        assert by_column.shape[:2] == (1, columns)
        assert torch.equal(by_column[0, :4], by_row[a.slot]) and torch.equal(by_column[0, 4], by_row[b.slot, 0])


def test_seeded_sampling_through_the_verification_graph_draws_the_tokens_it_draws_without() -> None:
    """Each token is sampled from its row with the uniform it would have had without speculation, so proposing the
    tokens a sampled run draws (one wrong in three proposals) keeps them and draws the same ones."""
    engine = spec_engine("llama", "eager")
    model = fixture_named(spec_name("llama", "eager")).model()
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=50, seed=7)
    ids = prompt(10, seed=63)
    reference = hf_sampled(model, ids, 16, params, engine.config.max_topk)
    engine.admit("s", ids, params, reuse=False)
    engine.step({"s": len(ids)})
    sequence, step = engine.sequence("s"), 0
    while len(sequence.generated) < len(reference):
        drafts, keep = proposal(reference, len(sequence.generated), step)
        assert engine.step({"s": 1}, drafts={"s": drafts}).accepted.get("s", 0) == keep
        step += 1
    assert sequence.generated == reference


def test_generate_with_prompt_lookup_equals_generate_without() -> None:
    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(export_fixture(spec_name("llama", "eager")))
    recorder = Recorder(model.engine)
    ids = torch.tensor([prompt(5, seed=64) * 2 + prompt(3, seed=65)])  # its last bigram never recurs: no proposal yet
    plain = model.generate(ids, max_new_tokens=14)
    assert all(name != "verification" for name, _ in recorder.calls)
    looked = model.generate(ids, max_new_tokens=14, prompt_lookup_num_tokens=K)
    assert looked.tolist() == plain.tolist()
    reference = hf_greedy(fixture_named(spec_name("llama", "eager")).model(), ids[0].tolist(), 14)
    assert looked[0, ids.shape[1] :].tolist() == reference
    tokens = ids[0].tolist() + reference
    proposed = [propose_lookup(tokens[:n], K, set()) for n in range(ids.shape[1] + 1, len(tokens))]
    assert any(proposed), "the prompt gives prompt lookup something to propose"
    assert any(name == "verification" for name, _ in recorder.calls)


def test_proposals_past_the_sequence_length_or_max_tokens_are_cut() -> None:
    engine = spec_engine("llama", "eager")
    ids = prompt(28, seed=66)
    engine.admit("full", ids, GREEDY, reuse=False)
    engine.step({"full": len(ids)})  # computed 28 of 32: room for the last token and 3 more positions
    sequence = engine.sequence("full")
    result = engine.step({"full": 1}, drafts={"full": [5, 6, 7]})
    assert sequence.computed <= engine.config.sequence_length and result.accepted["full"] <= 2
    engine.release("full")
    engine.admit("short", prompt(6, seed=67), SamplingParams(max_tokens=2), reuse=False)
    engine.step({"short": 6})
    result = engine.step({"short": 1}, drafts={"short": [5, 6, 7]})  # its last token: nothing left to propose
    assert "short" not in result.accepted and len(engine.sequence("short").generated) == 2


def test_refusals_name_the_fix_and_change_nothing() -> None:
    engine = spec_engine("llama", "eager")
    ids = prompt(10, seed=68)
    engine.admit("a", ids, GREEDY, reuse=False)
    engine.admit("b", prompt(12, seed=69), GREEDY, reuse=False)
    with pytest.raises(InputError, match="not decoding"):
        engine.step({"a": len(ids)}, drafts={"a": [5]})
    engine.step({"a": len(ids)})
    sequence = engine.sequence("a")
    before = (list(sequence.tokens), sequence.computed, list(sequence.blocks))
    with pytest.raises(InputError, match="--speculation_length"):
        engine.step({"a": 1}, drafts={"a": [5, 6, 7, 8]})
    with pytest.raises(InputError, match="does not schedule"):
        engine.step({"a": 1}, drafts={"b": [5]})
    with pytest.raises(InputError, match="proposed token ids"):
        engine.step({"a": 1}, drafts={"a": [10_000]})
    assert (list(sequence.tokens), sequence.computed, list(sequence.blocks)) == before
    engine.step({"a": 1}, drafts={"a": [5]})  # the same sequence still steps
    plain = engine_for("eager")
    plain.admit("p", ids, GREEDY, reuse=False)
    plain.step({"p": len(ids)})
    with pytest.raises(InputError, match="--speculation_length"):
        plain.step({"p": 1}, drafts={"p": [5]})


def test_generate_refuses_more_lookup_tokens_than_the_artifact_verifies() -> None:
    from optimum.neuron import NeuronModelForCausalLM

    ids = torch.tensor([prompt(6, seed=70)])
    model = NeuronModelForCausalLM.from_pretrained(export_fixture(spec_name("llama", "eager")))
    with pytest.raises(InputError, match=f"--speculation_length {K + 1}"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=K + 1)
    plain = NeuronModelForCausalLM.from_pretrained(export_fixture("llama-2x4x8-eager"))
    with pytest.raises(InputError, match="--speculation_length"):
        plain.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=1)
    assert plain.engine.slots.free_count == plain.neuron_config.batch_size


def test_verification_graph_signature() -> None:
    engine = spec_engine("llama", "eager")
    spec = engine.specs["verification"]
    assert spec.kind is GraphKind.VERIFICATION and (spec.batch, spec.tokens) == (1, 2 * (K + 1)) and spec.packed
    assert not spec.samples_on_device and spec.windows == (16, 32)
    from optimum.neuron.config import NeuronConfig
    from optimum.neuron.graphs import graph_specs, symbolic_dims

    dims = symbolic_dims(spec)
    assert dims is not None and dims["block_table"][0] is dims["input_ids"][1], "one table row per column"
    rows = NeuronConfig(sequence_length=32, prefill_chunk_size=8, speculation_length=3, attention_kernel="sdpa")
    (unpacked,) = [s for s in graph_specs(rows) if s.kind is GraphKind.VERIFICATION]
    assert (unpacked.batch, unpacked.tokens, unpacked.packed) == (1, K + 1, False), "sdpa: rows, not packed columns"

    xla = NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", speculation_length=2, backend="xla")
    names = [s.name for s in graph_specs(xla) if s.kind is GraphKind.VERIFICATION]
    assert names == ["verification_w16", "verification"], "a static-shape backend compiles one per KV window"
    with pytest.raises(Exception, match="--speculation_length"):
        NeuronConfig(sequence_length=32, speculation_length=32)


def test_rewind_keeps_the_rows_of_the_shared_tokens_and_refuses_what_it_cannot() -> None:
    """A drafter's engine (`vllm.drafting.ModelDrafter`) follows a target's tokens with `Engine.rewind`: the rows of the
    tokens both lists share stay, the rest is computed again, and the next tokens are those of transformers after the
    new list."""
    from optimum.neuron.artifact import Artifact
    from optimum.neuron.runtime.engine import Engine

    fixture = fixture_named("llama-2x4x8-eager")
    engine = Engine(Artifact.open(export_fixture(fixture.name)), prefix_cache=False)
    ids = prompt(10, seed=70)
    engine.admit("a", ids, GREEDY)
    engine.step({"a": len(ids)})
    engine.step({"a": 1})
    other = [*engine.sequence("a").tokens[:11], 5, 6]  # the first 11 rows (the prompt's and one token's) stay
    sequence = engine.rewind("a", other)
    assert (sequence.tokens, sequence.computed, sequence.pending) == (other, 11, 2)
    result = engine.step({"a": 2})
    assert result.tokens["a"] == hf_greedy(fixture.model(), other, 1)[0]
    before = (list(sequence.tokens), sequence.computed)
    with pytest.raises(InputError, match="fewer than its 10-token prompt"):
        engine.rewind("a", ids[:9])
    with pytest.raises(InputError, match="vocabulary"):
        engine.rewind("a", [*ids, 10_000])
    assert (sequence.tokens, sequence.computed) == before, "a refused rewind changed the sequence"
    shared = Engine(Artifact.open(export_fixture(fixture.name)))  # prefix caching: a block may be another's
    shared.admit("b", ids, GREEDY)
    with pytest.raises(InputError, match="prefix_cache=False"):
        shared.rewind("b", ids)
