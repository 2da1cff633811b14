"""`Engine.step` is atomic (issue 25, deliverable 2): it returns a `StepResult`, or raises leaving every sequence
as it was (tokens, cache progress, generator state, prompt-logprob scorer), and the same step retried then gives
what a run without the failure gives.

One step mixes every stage: sequence ``a`` decodes (sampled on device by the toolkit's own seeded rule: its uniform
is drawn from its generator before the graph runs), sequence ``b`` prefills a prompt of three chunks while its prompt
logprobs are gathered, then gets its first token from a `HostSampler`. A failure is injected at each stage: in the
token-generation graph, in the first and in the second prefill chunk (after the graph wrote the cache), and in the
`HostSampler` (after it drew from a generator). The image cache's restoration is pinned in `test_idefics3.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from optimum.neuron.artifact import Artifact
from optimum.neuron.graphs import GraphKind
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sampling import SamplingParams
from optimum.neuron.runtime.sequence import Sequence, StepResult
from tests.contract.engine_tools import prompt
from tests.fixtures.llm.models import export_fixture

FIXTURE = "llama-2x4x8-logprobs-eager"
"""Batch 2, chunk 8, sequence length 32, with the graphs returning logits (host sampling, logprobs)."""
A_PROMPT, B_PROMPT = prompt(5, seed=40), prompt(20, seed=41)  # b: chunks of 8, 8 and 4 tokens
STAGES = ["decode graph", "first prefill chunk", "second prefill chunk", "host sampler"]


class Injected(RuntimeError):
    """The failure a test injects."""


class DrawingSampler:
    """A `HostSampler` that draws one uniform from each row's generator (as vLLM's sampler does), picks by inverse CDF
    over the softmax, and raises after drawing while ``fail`` is set."""

    def __init__(self) -> None:
        self.fail = False

    def sample(self, logits: torch.Tensor, rows: Mapping[int, Sequence]) -> tuple[dict[int, int], torch.Tensor]:
        tokens = {}
        for slot, sequence in rows.items():
            uniform = torch.rand((), generator=sequence.sampler.generator)
            cdf = torch.softmax(logits[slot], dim=-1).cumsum(-1)
            tokens[slot] = min(int((cdf <= uniform).sum()), logits.shape[-1] - 1)
        if self.fail:
            raise Injected("host sampler")
        return tokens, logits


class FailingGraphs:
    """Wraps the engine's graphs of one kind: the ``nth`` call (1-based) runs the real graph, then raises."""

    def __init__(self, engine: Engine, kind: GraphKind, nth: int) -> None:
        self.calls, self.nth, self.armed = 0, nth, True
        for name, spec in engine.specs.items():
            if spec.kind is kind:
                engine.graphs[name] = self._wrap(engine.graphs[name])

    def _wrap(self, graph: Any) -> Any:
        def call(*args: Any) -> Any:
            out = graph(*args)
            self.calls += 1
            if self.armed and self.calls == self.nth:
                self.armed = False
                raise Injected(f"graph call {self.nth}")
            return out

        return call


def setup(engine: Engine) -> DrawingSampler:
    """Sequence ``a`` prefilled (its first token sampled) and ready to decode; ``b`` admitted, nothing computed."""
    sampler = DrawingSampler()
    engine.admit("a", A_PROMPT, SamplingParams(do_sample=True, seed=3, temperature=0.7))
    engine.step({"a": len(A_PROMPT)}, sampler)
    host = SamplingParams(do_sample=True, seed=11, logprobs=1, prompt_logprobs=2, host="the HostSampler's own")
    engine.admit("b", B_PROMPT, host)
    return sampler


def state(engine: Engine) -> dict[str, tuple]:
    """What a step may change in each sequence, copied."""
    out = {}
    for seq_id in ("a", "b"):
        s = engine.sequence(seq_id)
        scorer = None if s.scorer is None else (id(s.scorer), s.scorer.scored, len(s.scorer.parts))
        out[seq_id] = (list(s.tokens), s.computed, s.slot, s.sampler.generator.get_state().clone(), scorer)
    return out


def same_state(x: dict[str, tuple], y: dict[str, tuple]) -> bool:
    return all(
        a[:3] == b[:3] and torch.equal(a[3], b[3]) and a[4] == b[4] for a, b in zip(x.values(), y.values(), strict=True)
    )


def summary(result: StepResult) -> tuple:
    """The tokens of a step and its logprobs and prompt logprobs, comparable with ``==``."""
    logprobs = {k: (v.token_ids.tolist(), v.logprobs.tolist()) for k, v in result.logprobs.items()}
    prompt_logprobs = {k: (v.token_ids.tolist(), v.logprobs.tolist()) for k, v in result.prompt_logprobs.items()}
    return result.tokens, logprobs, prompt_logprobs, result.decodes, result.prefills


def run(engine: Engine, sampler: DrawingSampler) -> list[tuple]:
    """The step under test, then three decode steps of both sequences."""
    out = [summary(engine.step({"a": 1, "b": len(B_PROMPT)}, sampler))]
    for _ in range(3):
        out.append(summary(engine.step({"a": 1, "b": 1}, sampler)))
    return out


def fresh() -> Engine:
    return Engine(Artifact.open(export_fixture(FIXTURE)))


@pytest.fixture(scope="module")
def expected() -> list[tuple]:
    """What the steps give without any failure."""
    engine = fresh()
    return run(engine, setup(engine))


@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_step_changes_nothing_and_its_retry_gives_the_same_tokens(stage: str, expected: list[tuple]) -> None:
    engine = fresh()
    sampler = setup(engine)
    before = state(engine)
    if stage == "host sampler":
        sampler.fail = True
    else:
        kind = GraphKind.TOKEN_GENERATION if stage == "decode graph" else engine.prefill_kind
        failing = FailingGraphs(engine, kind, 2 if stage == "second prefill chunk" else 1)
    with pytest.raises(Injected):
        engine.step({"a": 1, "b": len(B_PROMPT)}, sampler)
    if stage != "host sampler":
        assert failing.calls == failing.nth, "the failure was injected where intended"
    after = state(engine)
    assert same_state(after, before), f"a step failing in the {stage} changed a sequence"
    assert engine.slots.free_count == 0
    sampler.fail = False
    assert run(engine, sampler) == expected


def test_checkpoints_restore_the_scorer_of_a_prompt_scored_over_two_steps() -> None:
    """b's prompt is scored over two steps; the second fails after its first chunk added rows: the rows of the first
    step stay, those of the failed one go."""
    engine = fresh()
    sampler = setup(engine)
    engine.step({"b": 8}, sampler)
    scorer = engine.sequence("b").scorer
    assert scorer is not None and scorer.scored == 8
    parts = list(scorer.parts)
    FailingGraphs(engine, engine.prefill_kind, 1)
    with pytest.raises(Injected):
        engine.step({"b": 12}, sampler)
    assert engine.sequence("b").scorer is scorer and scorer.scored == 8
    assert len(scorer.parts) == len(parts) and all(p is q for p, q in zip(scorer.parts, parts, strict=True))
    assert engine.sequence("b").computed == 8
    assert len(engine.step({"b": 12}, sampler).prompt_logprobs["b"]) == len(B_PROMPT) - 1
