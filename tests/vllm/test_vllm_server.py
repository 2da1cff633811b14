"""``vllm serve`` over HTTP on 127.0.0.1 with the optimum-neuronx plugin: completions, chat completions
with the model's chat template, streaming, per-request refusals; greedy text equals the offline engine's;
``echo`` + ``logprobs`` (prompt logprobs) equal transformers'; a request needing a graph the artifact lacks gets
HTTP 400 naming the export flag; SmolLM2 answers a chat question readably and follows a JSON schema (structured
output). Each test runs in a fresh interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fixtures.llm.models import export_fixture
from tests.fixtures.llm.smollm2 import XDIST_GROUP
from tests.utils import subprocess_test
from tests.vllm.server import vllm_serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "hello world what is the capital of france"
MESSAGES = [{"role": "user", "content": "what is the capital of france"}]


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


@pytest.mark.xdist_group(XDIST_GROUP)
@subprocess_test
def test_serve_smollm2_answers_a_chat_question(tmp_path: Path) -> None:
    from tests.fixtures.llm.smollm2 import CHUNKED, smollm2_artifact

    artifact = smollm2_artifact(CHUNKED.format(backend="inductor"))  # the README's export
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with vllm_serve(artifact, tmp_path / "serve.log") as server:
        name = server.get("/v1/models")["data"][0]["id"]
        body = {"model": name, "messages": question, "max_tokens": 24, "temperature": 0.0}
        answer = server.post("/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


@pytest.mark.xdist_group(XDIST_GROUP)
@subprocess_test
def test_serve_smollm2_follows_a_json_schema(tmp_path: Path) -> None:
    """Structured output: vLLM's grammar bitmask applied by its own sampler on the host (``--decode_logits``)."""
    import jsonschema

    from tests.fixtures.llm.smollm2 import HOST_SAMPLING, smollm2_artifact

    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["country", "capital", "population"],
        "additionalProperties": False,
    }
    describe = [{"role": "user", "content": "Describe France as JSON: its name, capital and population."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "country", "schema": schema}}
    with vllm_serve(smollm2_artifact(HOST_SAMPLING), tmp_path / "serve.log") as server:
        name = server.get("/v1/models")["data"][0]["id"]
        body = {"model": name, "messages": describe, "max_tokens": 120, "temperature": 0.0}
        choice = server.post("/v1/chat/completions", {**body, "response_format": response_format})["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the grammar ended the object before max_tokens
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)  # parses and validates, or raises
