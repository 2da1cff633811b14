"""The mixed graph (`--mixed_batch`): a step's decode rows and one prefill chunk in one call.

A short sequence decodes while a long prompt (21 tokens: chunk seams at 8 and 16, the KV window edge at 16) is fed
beside it, a piece per step (5 tokens, or 11: one chunk in the mixed call and the rest in a plain prefill call). Every
such step must run the mixed graph, and both sequences must get transformers' greedy tokens and the tokens (and the
long prompt's logits) of the same steps on the fixture without the mixed graph, which runs token generation and then
chunked prefill: bitwise on eager, where both run the same kernels row by row.
"""

from __future__ import annotations

import pytest
import torch

from optimum.neuron.artifact import Artifact
from optimum.neuron.graphs import GraphKind
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sampling import SamplingParams
from tests.contract.engine_tools import GREEDY, Recorder, prompt
from tests.fixtures.llm.models import MIXED_FIXTURES, export_fixture, fixture_named
from tests.fixtures.llm.reference import hf_greedy

NEW = 6
SHORT, LONG = prompt(3, seed=81), prompt(21, seed=82)


def engine(name: str) -> Engine:
    return Engine(Artifact.open(export_fixture(name)))


def twin(name: str) -> str:
    """The fixture without the mixed graph (the same model, weights and other graphs)."""
    return name.replace("-mixed", "")


def interleave(
    engine: Engine, piece: int, short_params: SamplingParams = GREEDY
) -> tuple[dict[str, list[int]], list[bool], torch.Tensor]:
    """``a`` (SHORT) prefilled alone, then decoding while ``b`` (LONG) is fed ``piece`` tokens a step; both then
    decode together to NEW tokens. Returns each one's tokens, whether each step ran the mixed graph, and the logits of
    ``b``'s first token (its prefill's last chunk)."""
    engine.admit("a", SHORT, short_params, reuse=False)
    tokens: dict[str, list[int]] = {"a": [engine.step({"a": len(SHORT)}).tokens["a"]], "b": []}
    engine.admit("b", LONG, GREEDY, reuse=False)
    mixed, logits = [], torch.empty(0)
    while len(tokens["a"]) < NEW or len(tokens["b"]) < NEW:
        work = {}
        for seq_id in ("a", "b"):
            sequence = engine.sequence(seq_id)
            if len(tokens[seq_id]) < NEW:
                work[seq_id] = 1 if sequence.decoding else min(sequence.pending, piece)
        result = engine.step(work)
        mixed.append(result.mixed)
        for seq_id, token in result.tokens.items():
            tokens[seq_id].append(token)
        if "b" in result.logits and len(tokens["b"]) == 1:
            logits = result.logits["b"]
    for seq_id in ("a", "b"):
        engine.release(seq_id)
    return tokens, mixed, logits


@pytest.mark.parametrize(
    "name", [pytest.param(f.name, marks=[pytest.mark.slow] if f.backend == "inductor" else []) for f in MIXED_FIXTURES]
)
def test_decodes_beside_each_chunk_run_in_one_call_and_keep_every_token(name: str) -> None:
    model = fixture_named(name).model()
    mixed_engine = engine(name)
    recorder = Recorder(mixed_engine)
    got, mixed, logits = interleave(mixed_engine, 5)
    feeding = -(-len(LONG) // 5)  # the steps that feed b's prompt, a decoding beside each
    assert mixed == [True] * feeding + [False] * (len(mixed) - feeding), "every step with a chunk ran the mixed graph"
    assert [n for n, _ in recorder.calls].count(GraphKind.MIXED.value) == feeding
    assert got["a"] == hf_greedy(model, SHORT, NEW), f"{name}: the decoding sequence"
    assert got["b"] == hf_greedy(model, LONG, NEW), f"{name}: the prompt fed beside it"
    plain, _, plain_logits = interleave(engine(twin(name)), 5)
    assert got == plain
    if fixture_named(name).backend == "eager":
        assert torch.equal(logits, plain_logits), "the chunk's logits are the chunked-prefill graph's, bitwise"
    else:
        torch.testing.assert_close(logits, plain_logits, rtol=0, atol=1e-5)


def test_a_range_longer_than_a_chunk_runs_its_first_chunk_mixed_and_the_rest_alone() -> None:
    name = "llama-2x4x8-mixed-eager"
    mixed_engine = engine(name)
    recorder = Recorder(mixed_engine)
    got, mixed, _ = interleave(mixed_engine, 11)  # 11 then 10 tokens: 8 in the mixed call, the rest in a plain one
    calls = [n for n, _ in recorder.calls]
    assert calls[:6] == ["chunked_prefill", "mixed", "chunked_prefill", "mixed", "chunked_prefill", "token_generation"]
    assert mixed[:2] == [True, True]
    assert got == interleave(engine(twin(name)), 11)[0]
    assert got["b"] == hf_greedy(fixture_named(name).model(), LONG, NEW)


def test_seeded_sampling_beside_a_chunk_draws_what_token_generation_draws() -> None:
    """The mixed graph returns the decode rows' logits, sampled on the host with the graph's rule and the sequence's
    own uniforms: the same tokens as token generation's on-device sampling."""
    params = SamplingParams(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, seed=7)
    name = "llama-2x4x8-mixed-eager"
    got, mixed, _ = interleave(engine(name), 5, params)
    assert any(mixed)
    assert got == interleave(engine(twin(name)), 5, params)[0]
