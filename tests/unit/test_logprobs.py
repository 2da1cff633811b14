"""Logprobs without a model: the logprob rule (vLLM's layout and rank), the seam rule of prompt logprobs over any
split into prefill calls, transformers-style scores, graph selection, and the refusals that name an export flag."""

from __future__ import annotations

import pytest
import torch

from optimum.neuron.config import NeuronConfig
from optimum.neuron.errors import InputError
from optimum.neuron.graphs import GraphKind, GraphSpec, graph_specs, select_graph
from optimum.neuron.runtime.logprobs import Logprobs, PromptScorer, token_logprobs
from optimum.neuron.runtime.sampling import SamplingParams

VOCAB = 11


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_token_logprobs_layout_and_rank() -> None:
    logits = logits_of(4)
    tokens = torch.tensor([0, 3, 7, 10])
    got = token_logprobs(logits, tokens, 3)
    expected = torch.log_softmax(logits, dim=-1)
    assert got.token_ids.shape == got.logprobs.shape == (4, 4)
    assert torch.equal(got.token_ids[:, 0], tokens)
    assert torch.allclose(got.scores, expected.gather(1, tokens[:, None])[:, 0])
    top = expected.topk(3, dim=-1)
    assert torch.equal(got.token_ids[:, 1:], top.indices) and torch.allclose(got.logprobs[:, 1:], top.values)
    for row, token in enumerate(tokens.tolist()):
        assert int(got.ranks[row]) == int((expected[row] >= expected[row, token]).sum())  # 1 = the most likely
    assert token_logprobs(logits, tokens, 0).token_ids.shape == (4, 1)
    assert token_logprobs(logits, tokens, -1).token_ids.shape == (4, 1 + VOCAB)


@pytest.mark.parametrize("splits", [[9], [1, 8], [4, 4, 1], [2, 3, 4], [8, 1]])
def test_seam_rule_over_any_split_equals_the_full_prompt(splits: list[int]) -> None:
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = logits_of(9, seed=2)  # the full-prompt forward: row p predicts token p + 1
    expected = token_logprobs(logits[:-1], torch.tensor(prompt[1:]), 2)
    scorer = PromptScorer(prompt, 2)
    start = 0
    for count in splits:
        if scorer.wants(start):
            scorer.add(start, logits[start : start + count])
        start += count
    assert scorer.complete
    got = scorer.result()
    assert len(got) == len(prompt) - 1, "the first prompt token has no logprob; the last row samples"
    for name in ("token_ids", "logprobs", "ranks"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_seam_rule_edges() -> None:
    one = PromptScorer([5], 1)
    assert one.complete and not one.wants(0) and len(one.result()) == 0
    scorer = PromptScorer([1, 2, 3, 4], 0)
    scorer.add(0, logits_of(2))
    scorer.reset()  # a preempted sequence recomputes its prompt from position 0
    assert scorer.scored == 0 and not scorer.complete
    scorer.add(0, logits_of(6))  # rows past the prompt (a resumed sequence's generated tokens) score nothing
    assert scorer.complete and len(scorer.result()) == 3
    with pytest.raises(AssertionError, match="in order"):
        PromptScorer([1, 2, 3, 4], 0).add(1, logits_of(2))


def test_empty_logprobs_keep_their_width() -> None:
    assert Logprobs.cat([], 4).token_ids.shape == (0, 5)


def test_scores_are_what_the_sampler_draws_from() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = logits_of(3, seed=4)
    assert torch.equal(SamplingParams().scores(logits, 8), logits), "greedy scores are the raw logits"
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=4, top_p=0.8)
    expected = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(4), TopPLogitsWarper(0.8)):
        expected = warper(None, expected)
    assert torch.equal(torch.isinf(params.scores(logits, 8)), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.allclose(params.scores(logits, 8)[finite], expected[finite])


def test_graph_variants_and_selection() -> None:
    def chosen(specs: tuple[GraphSpec, ...], kind: GraphKind, **options: bool) -> GraphSpec | None:
        found = select_graph(specs, kind, **options)
        return None if found is None else found[0]

    minimal = graph_specs(NeuronConfig(prefill_chunk_size=8, sequence_length=32, decode_logits=False))
    assert [s.name for s in minimal] == ["chunked_prefill", "token_generation"], "the minimal artifact gained a graph"
    assert chosen(minimal, GraphKind.TOKEN_GENERATION).samples_on_device  # type: ignore[union-attr]
    assert chosen(minimal, GraphKind.TOKEN_GENERATION, logits=True) is None
    assert chosen(minimal, GraphKind.CHUNKED_PREFILL, all_rows=True) is None
    default = graph_specs(NeuronConfig(prefill_chunk_size=8, sequence_length=32))
    assert [s.name for s in default] == ["chunked_prefill", "token_generation", "token_generation_logits"]
    assert chosen(default, GraphKind.TOKEN_GENERATION).samples_on_device  # type: ignore[union-attr]
    assert not chosen(default, GraphKind.TOKEN_GENERATION, logits=True).samples_on_device  # type: ignore[union-attr]
    full = graph_specs(NeuronConfig(sequence_length=32, prompt_logprobs=True, decode_logits=False))
    assert [s.name for s in full] == ["context_encoding", "context_encoding_all_rows", "token_generation"]
    host = graph_specs(NeuronConfig(sequence_length=32, on_device_sampling=False))
    assert [s.name for s in host] == ["context_encoding", "token_generation_logits"]
    assert chosen(host, GraphKind.TOKEN_GENERATION) is chosen(host, GraphKind.TOKEN_GENERATION, logits=True)


@pytest.mark.parametrize(
    ("params", "config", "flag"),
    [
        (SamplingParams(prompt_logprobs=0), NeuronConfig(), "--prompt_logprobs"),
        (SamplingParams(logprobs=2), NeuronConfig(prompt_logprobs=True, decode_logits=False), "--no_decode_logits"),
        (SamplingParams(return_logits=True), NeuronConfig(decode_logits=False), "--no_decode_logits"),
    ],
)
def test_a_request_needing_a_missing_graph_names_the_export_flag(
    params: SamplingParams, config: NeuronConfig, flag: str
) -> None:
    with pytest.raises(InputError, match=flag):
        params.check_graphs(config)


def test_one_token_needs_no_decode_logits() -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, max_tokens=1) samples only from the prefill."""
    minimal = NeuronConfig(prompt_logprobs=True, decode_logits=False)
    SamplingParams(logprobs=1, prompt_logprobs=1, max_tokens=1).check_graphs(minimal)
    with pytest.raises(InputError, match="--no_decode_logits"):
        SamplingParams(logprobs=1, prompt_logprobs=1, max_tokens=2).check_graphs(minimal)
    with pytest.raises(InputError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_available_graphs_pass() -> None:
    SamplingParams(prompt_logprobs=-1, logprobs=5).check_graphs(NeuronConfig(prompt_logprobs=True))
    SamplingParams(logprobs=0, return_logits=True).check_graphs(NeuronConfig())  # the default artifact serves them
    SamplingParams(logprobs=0).check_graphs(NeuronConfig(on_device_sampling=False, decode_logits=False))
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1).check_graphs(NeuronConfig())


@pytest.mark.parametrize("value", [-2, 1.5, "3"])
def test_invalid_logprob_counts_are_refused(value: object) -> None:
    with pytest.raises(InputError, match="logprobs"):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]
