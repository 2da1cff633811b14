"""``vllm serve`` over HTTP on 127.0.0.1 with the optimum-neuronx plugin: completions, chat completions
with the model's chat template, streaming, per-request refusals; greedy text equals the offline engine's;
SmolLM2 answers a chat question readably. Each test runs in a fresh interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest

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
        status, body = server.post_error(
            "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4, "presence_penalty": 0.5}
        )
        assert status == 400 and "presence_penalty" in body, (status, body)
        status, body = server.post_error("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 40})
        assert status == 400 and "32" in body, (status, body)  # longer than the compiled sequence length
        again = server.post("/v1/completions", {"model": name, "prompt": PROMPT, **greedy})
        assert again["choices"][0]["text"] == want_completion, "a refused request disturbed the server"
    assert "optimum-neuronx serving" in (tmp_path / "serve.log").read_text()


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
