"""vLLM's sampling through the runner, driven by hand-built scheduler steps (no vLLM engine), on the eager fixture
exported with the graphs returning logits (``-logprobs``).

Requests that need more than temperature / top-k / top-p go through vLLM's own sampler (`host_sampling.HostSampling`);
their greedy tokens must equal vLLM's documented semantics applied to transformers' logits (penalties, logit_bias,
min_tokens, bad words, allowed token ids, a grammar bitmask). Logprobs and prompt logprobs reach vLLM's output
structures with transformers' values; seeded host sampling reproduces; a plain request decoding beside a host
sampled one keeps its tokens; slots are given back.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from vllm import SamplingParams as VllmParams

from optimum.neuron.artifact import Artifact
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.vllm import compat
from optimum.neuron.vllm.runner import Runner
from tests.contract.engine_tools import alone, prompt
from tests.fixtures.llm.models import export_fixture, tiny_model
from tests.fixtures.llm.reference import reference_model
from tests.vllm.steps import CHUNK, Driver, new_request

pytestmark = [pytest.mark.vllm]
NEW = 8
Rule = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
"""vLLM's semantics of one request: (logits, prompt, output so far) -> the logits greedy picks from."""


@pytest.fixture
def runner() -> Runner:
    return Runner(_logprobs_engine())


def hf_logits(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(tiny_model("llama"))(torch.tensor([ids])).logits[0, -1].float()


def reference(ids: list[int], rule: Rule, new: int = NEW) -> list[int]:
    """Greedy tokens of transformers' logits under ``rule``."""
    out: list[int] = []
    for _ in range(new):
        out.append(int(rule(hf_logits(ids + out), ids, out).argmax()))
    return out


def penalized(bias: dict[int, float], repetition: float, frequency: float, presence: float) -> Rule:
    """vLLM's order: logit_bias (a logits processor), then the repetition penalty (prompt and output tokens:
    positive logits divided, negative multiplied), then frequency (x count in the output) and presence (once)."""

    def rule(logits: torch.Tensor, ids: list[int], out: list[int]) -> torch.Tensor:
        logits = logits.clone()
        for token, value in bias.items():
            logits[token] += value
        seen = sorted(set(ids) | set(out))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - frequency * counts - presence * (counts > 0).float()

    return rule


def drive(runner: Runner, ids: list[int], params: VllmParams, new: int = NEW, req: str = "a") -> Driver:
    """Prompt in two uneven steps, then ``new - 1`` decodes, then finished."""
    d = Driver(runner)
    d.run({req: 5}, [new_request(req, ids, params)])
    d.run({req: len(ids) - 5})
    for _ in range(new - 1):
        d.run({req: 1})
    d.run({}, finished={req})
    assert runner.engine.slots.free_count == runner.engine.config.batch_size, "a slot was kept"
    return d


def test_penalties_and_logit_bias_follow_vllm_semantics(runner: Runner) -> None:
    ids = prompt(CHUNK + 6, 21) + prompt(4, 21)  # repeats: the repetition penalty has work
    plain = reference(ids, lambda x, *_: x)
    bias = {plain[1]: -4.0, 77: 6.0}
    rule = penalized(bias, repetition=1.4, frequency=0.7, presence=0.5)
    want = reference(ids, rule)
    assert want != plain, "the parameters must change the greedy tokens for this test to mean anything"
    params = VllmParams(
        temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.5, logit_bias=bias
    )
    assert drive(runner, ids, params).out["a"] == want


def test_min_tokens_bad_words_and_allowed_ids_follow_vllm_semantics(runner: Runner) -> None:
    from vllm.tokenizers import get_tokenizer

    ids = prompt(CHUNK + 2, 22)
    allowed = list(range(40, 60))
    first = int(hf_logits(ids)[allowed].argmax()) + 40  # the first token greedy picks among the allowed ones
    tokenizer = get_tokenizer(str(export_fixture("llama-2x4x8-eager")))  # vLLM's wrapper, as its front end uses
    words = [tokenizer.decode([45])]
    params = VllmParams(
        temperature=0.0, min_tokens=3, stop_token_ids=[first], allowed_token_ids=allowed, bad_words=words
    )
    params.update_from_tokenizer(tokenizer)  # what vLLM's front end does
    banned = {tokens[-1] for tokens in params.bad_words_token_ids or []}
    assert banned == {45}

    def rule(logits: torch.Tensor, _: list[int], out: list[int]) -> torch.Tensor:
        masked = torch.full_like(logits, -torch.inf)
        masked[allowed] = logits[allowed]
        masked[sorted(banned)] = -torch.inf
        if len(out) < 3:
            masked[first] = -torch.inf
        return masked

    want = reference(ids, rule)
    assert want[0] != first and all(t in allowed and t not in banned for t in want)
    assert drive(runner, ids, params).out["a"] == want


def test_grammar_bitmask_restricts_tokens(runner: Runner) -> None:
    """The bitmask vLLM's scheduler sends with ``sample_tokens`` (here hand-made: 3 tokens allowed) is applied."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.core.sched.output import GrammarOutput

    ids, allowed = prompt(CHUNK - 2, 23), [7, 90, 223]  # 223: bit 31 of its word, the sign bit
    bits = np.zeros((1, 256 // 32), dtype=np.uint32)
    for token in allowed:
        bits[0, token // 32] |= np.uint32(1 << (token % 32))

    def rule(logits: torch.Tensor, *_: object) -> torch.Tensor:
        masked = torch.full_like(logits, -torch.inf)
        masked[allowed] = logits[allowed]
        return masked

    d = Driver(runner)
    d.grammar = GrammarOutput(["g"], bits.view(np.int32))
    params = VllmParams(temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["x", "y"]), logprobs=2)
    d.run({"g": len(ids)}, [new_request("g", ids, params)])
    for _ in range(3):
        d.run({"g": 1})
    assert d.out["g"] == reference(ids, rule, 4)
    last = d.last.logprobs["g"]  # type: ignore[union-attr]
    assert set(last.token_ids[0, 1:].tolist()) <= set(allowed), "vLLM's logprobs are taken after the bitmask"


def test_seeded_host_sampling_reproduces_and_a_plain_neighbour_keeps_its_tokens(runner: Runner) -> None:
    ids, other = prompt(CHUNK + 1, 24), prompt(5, 25)
    want_other = alone(_logprobs_engine(caller_blocks=False), other, 6)
    runs = []
    for seed in (5, 5, 6):
        params = VllmParams(temperature=1.2, top_k=30, presence_penalty=0.3, seed=seed)
        d = Driver(runner)
        d.run({"s": len(ids), "p": len(other)}, [new_request("s", ids, params), new_request("p", other)])
        for _ in range(5):
            d.run({"s": 1, "p": 1})
        d.run({}, finished={"s", "p"})
        runs.append(d.out["s"])
        assert d.out["p"] == want_other, "a plain request decoding beside a host-sampled one changed its tokens"
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_logprobs_and_prompt_logprobs_reach_vllm_outputs() -> None:
    runner = Runner(_logprobs_engine())
    ids = prompt(3 * CHUNK + 5, 26)
    d = Driver(runner)
    params = VllmParams(temperature=0.0, logprobs=3, prompt_logprobs=2)
    d.run({"a": 6}, [new_request("a", ids, params)])
    assert not d.last.prompt_logprobs, "prompt logprobs are returned once, when the prompt completes"  # type: ignore[union-attr]
    d.run({"a": CHUNK + 3})
    d.run({"a": len(ids) - 6 - CHUNK - 3})
    out = compat.runner_output(d.last.req_ids, d.last.sampled, d.last.logprobs, d.last.prompt_logprobs)  # type: ignore[union-attr]
    tensors = out.prompt_logprobs_dict["a"]
    with torch.no_grad():
        logits = reference_model(tiny_model("llama"))(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    want = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert tensors.logprobs.shape == (len(ids) - 1, 3) and tensors.logprob_token_ids.dtype == torch.int32
    assert torch.allclose(tensors.logprobs[:, 0], want, atol=1e-4)
    first = d.out["a"][0]
    lists = out.logprobs
    assert lists.logprob_token_ids[0, 0] == first and lists.sampled_token_ranks[0] == 1
    assert np.allclose(lists.logprobs[0, 1:], expected[-1].topk(3).values.numpy(), atol=1e-4)


def _logprobs_engine(caller_blocks: bool = True) -> Engine:
    """A fresh engine on the eager fixture with the graphs returning logits (``--prompt_logprobs``, and the
    token-generation graph returning logits that the other fixtures leave out), placing blocks as the runner's does
    (given by vLLM) unless ``caller_blocks`` is off."""
    return Engine(Artifact.open(export_fixture("llama-2x4x8-logprobs-eager")), caller_blocks=caller_blocks)
