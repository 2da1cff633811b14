"""``vllm serve`` over HTTP on 127.0.0.1 with the optimum-neuronx plugin: completions, chat completions
with the model's chat template, streaming, per-request refusals; greedy text equals the offline engine's;
``echo`` + ``logprobs`` (prompt logprobs) equal transformers'; a request needing a graph the artifact lacks gets
HTTP 400 naming the export flag; SmolLM2's default export answers a chat question readably and serves logprobs,
a presence penalty, min_tokens, logit_bias and a JSON schema (structured output) with right results. Each test
runs in a fresh interpreter."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.llm.models import export_fixture
from tests.fixtures.llm.smollm2 import XDIST_GROUP
from tests.utils import subprocess_test
from tests.vllm.server import Server, vllm_serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "hello world what is the capital of france"
MESSAGES = [{"role": "user", "content": "what is the capital of france"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def offline(artifact: Path) -> tuple[str, str]:
    """Greedy completion and chat texts of the offline engine, for `PROMPT` and `MESSAGES`."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(artifact), seed=0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    llm.llm_engine.engine_core.shutdown()
    return completion, chat


@subprocess_test
def test_serve_completions_chat_and_streaming_equal_offline(tmp_path: Path) -> None:
    artifact = export_fixture("llama-2x4x8-inductor")
    want_completion, want_chat = offline(artifact)
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with vllm_serve(artifact, tmp_path / "serve.log") as server:
        name = server.get("/v1/models")["data"][0]["id"]
        assert name == str(artifact)
        completion = server.post("/v1/completions", {"model": name, "prompt": PROMPT, **greedy})
        assert completion["choices"][0]["text"] == want_completion
        assert completion["usage"]["completion_tokens"] == 8
        chat = server.post("/v1/chat/completions", {"model": name, "messages": MESSAGES, **greedy})
        assert chat["choices"][0]["message"]["content"] == want_chat
        events = server.stream("/v1/completions", {"model": name, "prompt": PROMPT, **greedy})
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want_completion
        chunks = server.stream("/v1/chat/completions", {"model": name, "messages": MESSAGES, **greedy})
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        assert "".join(deltas) == want_chat
        echo = {"model": name, "prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1}
        status, body = server.post_error("/v1/completions", echo)  # this artifact has no prompt-logprobs graph
        assert status == 400 and "--prompt_logprobs" in body, (status, body)
        penalty = {"model": name, "prompt": PROMPT, "max_tokens": 4, "presence_penalty": 0.5}
        status, body = server.post_error("/v1/completions", penalty)  # nor the token-generation graph of logits
        assert status == 400 and "re-export without --no_decode_logits" in body, (status, body)
        status, body = server.post_error("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 40})
        assert status == 400 and "32" in body, (status, body)  # longer than the compiled sequence length
        again = server.post("/v1/completions", {"model": name, "prompt": PROMPT, **greedy})
        assert again["choices"][0]["text"] == want_completion, "a refused request disturbed the server"
    assert "optimum-neuronx serving" in (tmp_path / "serve.log").read_text()


@subprocess_test
def test_serve_echo_logprobs_equal_transformers(tmp_path: Path) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt echoed with each token's logprob."""
    from tests.fixtures.llm.models import tiny_model
    from tests.fixtures.llm.reference import reference_model

    artifact = export_fixture("llama-2x4x8-logprobs-inductor")
    ids = torch.randint(3, 256, (3 * 8 + 5,), generator=torch.Generator().manual_seed(31)).tolist()
    with torch.no_grad():
        logits = reference_model(tiny_model("llama"))(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    with vllm_serve(artifact, tmp_path / "serve.log") as server:
        name = server.get("/v1/models")["data"][0]["id"]
        body = {"model": name, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0.0}
        choice = server.post("/v1/completions", body)["choices"][0]
    scores = choice["logprobs"]["token_logprobs"]
    assert len(scores) == len(ids) + 1 and scores[0] is None, "the first prompt token has no logprob"
    want = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scores[1 : len(ids)]), want, atol=1e-4), "prompt logprobs"
    assert abs(scores[-1] - float(expected[-1].max())) <= 1e-4, "the greedy token's own logprob"


MIN_TOKENS = 24
"""More tokens than SmolLM2's greedy answer to `QUESTION` holds before its EOS."""
BIASED = 1000
"""The token id a +100 logit bias makes every generated token."""
COUNTRY = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["country", "capital", "population"],
    "additionalProperties": False,
}


@pytest.mark.xdist_group(XDIST_GROUP)
@subprocess_test
def test_serve_smollm2_default_export_serves_every_request(tmp_path: Path) -> None:
    """The README's export, the default `NeuronConfig` but for its shapes (so with the token-generation graph
    returning logits), answers a chat question, then ``logprobs: 5``, ``presence_penalty``, ``min_tokens``,
    ``logit_bias`` and a JSON schema with HTTP 200 and right results: vLLM's host sampling on a default artifact."""
    from tests.fixtures.llm import smollm2 as smol

    artifact = smol.smollm2_artifact(smol.CHUNKED.format(backend="inductor"))
    assert "token_generation_logits" in json.loads((artifact / "neuron_config.json").read_text())["graphs"]
    ids = smol.chat_ids(QUESTION[0]["content"])[0].tolist()
    with torch.no_grad():
        first = torch.log_softmax(smol.reference()(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    with vllm_serve(artifact, tmp_path / "serve.log") as server:
        name = server.get("/v1/models")["data"][0]["id"]
        body = {"model": name, "messages": QUESTION, "max_tokens": 24, "temperature": 0.0}
        assert "Paris" in ok(server, "/v1/chat/completions", body)["message"]["content"]

        def complete(**fields: Any) -> dict[str, Any]:
            body = {"model": name, "prompt": ids, "temperature": 0.0, "return_token_ids": True, **fields}
            return ok(server, "/v1/completions", body)

        plain = complete(max_tokens=MIN_TOKENS)
        assert plain["finish_reason"] == "stop" and len(plain["token_ids"]) < MIN_TOKENS, plain  # stops at EOS
        check_logprobs(complete(max_tokens=MIN_TOKENS, logprobs=5, return_tokens_as_token_ids=True), plain, first)
        check_presence_penalty(complete, plain)
        check_min_tokens(complete(max_tokens=2 * MIN_TOKENS, min_tokens=MIN_TOKENS), plain)
        biased = complete(max_tokens=6, logit_bias={str(BIASED): 100.0}, ignore_eos=True)
        assert biased["token_ids"] == [BIASED] * 6, biased
        check_json_schema(server, name)


def ok(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The first choice of a POST that must answer HTTP 200."""
    status, text = server.post_error(path, body)
    assert status == 200, (body, status, text)
    return dict(json.loads(text)["choices"][0])


def check_logprobs(scored: dict[str, Any], plain: dict[str, Any], first: torch.Tensor) -> None:
    """Five candidates per token, the greedy token's logprob their maximum, the same tokens as without logprobs, and
    the first token's logprobs equal to transformers' (``first``: its log-softmax)."""
    assert scored["token_ids"] == plain["token_ids"], "asking logprobs changed the greedy tokens"
    found = scored["logprobs"]
    assert len(found["top_logprobs"]) == len(found["token_logprobs"]) == len(plain["token_ids"])
    for token, chosen, top in zip(plain["token_ids"], found["token_logprobs"], found["top_logprobs"], strict=True):
        assert len(top) == 5 and f"token_id:{token}" in top, top
        assert chosen == pytest.approx(max(top.values()), abs=1e-6), (chosen, top)
    for key, value in found["top_logprobs"][0].items():
        assert value == pytest.approx(float(first[int(key.removeprefix("token_id:"))]), abs=1e-3), key
    assert min(found["top_logprobs"][0].values()) >= float(first.topk(5).values[-1]) - 1e-3, "not the top five"


def check_presence_penalty(complete: Callable[..., dict[str, Any]], plain: dict[str, Any]) -> None:
    """A strong presence penalty changes the greedy continuation (its prefix before the first repeated token
    aside) and repeats fewer tokens."""
    unpenalized = complete(max_tokens=MIN_TOKENS, ignore_eos=True)["token_ids"]
    penalized = complete(max_tokens=MIN_TOKENS, ignore_eos=True, presence_penalty=2.0)["token_ids"]
    assert unpenalized[: len(plain["token_ids"])] == plain["token_ids"]
    assert len(penalized) == MIN_TOKENS and penalized != unpenalized, penalized
    assert len(set(penalized)) > len(set(unpenalized)), (penalized, unpenalized)


def check_min_tokens(longer: dict[str, Any], plain: dict[str, Any]) -> None:
    """``min_tokens`` past the greedy EOS: the same answer up to it, then no EOS before ``min_tokens`` tokens."""
    stop = len(plain["token_ids"]) - 1  # plain's last token is its EOS
    assert len(longer["token_ids"]) >= MIN_TOKENS, longer
    assert longer["token_ids"][:stop] == plain["token_ids"][:stop]
    assert plain["token_ids"][stop] not in longer["token_ids"][:MIN_TOKENS], "EOS before min_tokens"


def check_json_schema(server: Server, name: str) -> None:
    """Structured output: vLLM's grammar bitmask applied by its own sampler on the host; the answer parses as JSON
    that the schema validates."""
    import jsonschema

    describe = [{"role": "user", "content": "Describe France as JSON: its name, capital and population."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY}}
    body = {"model": name, "messages": describe, "max_tokens": 120, "temperature": 0.0}
    choice = ok(server, "/v1/chat/completions", {**body, "response_format": response_format})
    assert choice["finish_reason"] == "stop", choice  # the grammar ended the object before max_tokens
    jsonschema.validate(json.loads(choice["message"]["content"]), COUNTRY)  # parses and validates, or raises
