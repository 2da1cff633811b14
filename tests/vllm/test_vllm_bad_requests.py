"""A bad request is that request's error, never a dead engine; a dead engine makes ``vllm serve`` exit non-zero.

One ``vllm serve`` (tiny llama, chunked, inductor) takes every bad request of docs/vllm.md's list: each gets HTTP
4xx naming what to fix, and after each every KV slot is free, the server is healthy and a greedy request still
equals the artifact's own ``generate()``. ``n`` larger than the free slots waits and completes. A failure only a
step can meet (injected through a test worker extension, `tests.vllm.faults`) fails that request alone (HTTP 500 /
an error event) while a request beside it completes. Last, the engine core is killed during a stream: the stream ends
with an error and ``vllm serve`` exits with `supervision.ENGINE_DIED_EXIT_CODE` (a graceful stop exits with 0: every
other server test checks it, `tests.vllm.server.vllm_serve`).
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.llm.models import export_fixture
from tests.utils import settled, subprocess_test
from tests.vllm.server import Server, vllm_serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
FIXTURE = "llama-2x4x8-inductor"
PROMPT = [17, 42, 99, 5, 250]
MARKED = [7, 7, 7, 30, 31]
"""A prompt the injected fault fails on (`FaultInjection.arm_fault`)."""
NEW = 6
SAMPLED = {"temperature": 0.8}
BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str]] = [
    # (case, body fields, a fragment of the error message)
    ("seed not an integer", {"seed": 1.5, **SAMPLED}, "seed"),
    ("seed >= 2**64", {"seed": 2**64, **SAMPLED}, "seed"),
    ("temperature a string", {"temperature": "hot"}, "temperature"),
    ("top_p 0", {"top_p": 0, **SAMPLED}, "top_p"),
    ("top_p > 1", {"top_p": 1.5, **SAMPLED}, "top_p"),
    ("top_k negative", {"top_k": -3, **SAMPLED}, "top_k"),
    ("top_k above max_topk", {"top_k": 1000, **SAMPLED}, "--max_topk"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -2}, "max_tokens"),
    ("logprobs above the maximum", {"logprobs": 30}, "max allowed: 20"),
    ("logprobs without the logits graph", {"logprobs": 2}, "re-export without --no_decode_logits"),
    ("logit_bias outside the vocabulary", {"logit_bias": {"300": 1.0}}, "logit_bias"),
    ("penalty without the logits graph", {"presence_penalty": 0.5}, "re-export without --no_decode_logits"),
    ("prompt id outside the vocabulary", {"prompt": [5, 6, 300]}, "vocabulary"),
    ("prompt longer than the artifact", {"prompt": list(range(3, 40))}, "32"),
    ("prompt logprobs without their graph", {"echo": True, "logprobs": 1, "max_tokens": 1}, "--prompt_logprobs"),
]


def reference(artifact: Path, ids: list[int]) -> list[int]:
    """Greedy tokens of the artifact's own ``generate()``."""
    import torch

    from tests.contract.engine_tools import loaded

    out = loaded(artifact).generate(torch.tensor([ids]), max_new_tokens=NEW, eos_token_id=[])
    return out[0, len(ids) :].tolist()


def completion(server: Server, model: str, **fields: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW, "ignore_eos": True, "return_token_ids": True}
    return dict(server.post("/v1/completions", {**body, "temperature": 0.0, **fields}))


def assert_still_serving(server: Server, model: str, want: list[int], case: str) -> None:
    """Every slot free, healthy, and a greedy request equal to ``want``."""
    assert settled(lambda: server.rpc("slot_usage"), [{}]) == [{}], f"{case}: a KV slot is still held"
    assert server.get_status("/health") == 200, f"{case}: the server is not healthy"
    assert completion(server, model)["choices"][0]["token_ids"] == want, f"{case}: greedy output changed"


def runtime_refuses_seed(seed: int) -> bool:
    """Whether the runtime's sampling checks refuse ``seed`` (a negative seed is vLLM-valid: the runtime decides)."""
    from vllm import SamplingParams

    from optimum.neuron.errors import InputError
    from optimum.neuron.vllm.sampling import to_sampling_params

    try:
        to_sampling_params(SamplingParams(seed=seed, **SAMPLED))
    except InputError:
        return True
    return False


@subprocess_test
def test_bad_requests_get_4xx_and_leave_the_server_serving(tmp_path: Path) -> None:
    """Then the engine core is killed during a stream: the stream ends with an error, vllm serve exits non-zero."""
    from optimum.neuron.vllm.supervision import ENGINE_DIED_EXIT_CODE

    artifact = export_fixture(FIXTURE)
    want = reference(artifact, PROMPT)
    os.environ.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=str(Path.cwd()))  # /collective_rpc; the extension
    flags = ("--worker-extension-cls", "tests.vllm.faults.FaultInjection")
    with vllm_serve(artifact, tmp_path / "serve.log", *flags, exit_status=ENGINE_DIED_EXIT_CODE) as server:
        model = server.get("/v1/models")["data"][0]["id"]
        base = {"model": model, "prompt": PROMPT, "max_tokens": NEW}
        for case, fields, fragment in BAD_COMPLETIONS:
            status, body = server.post_error("/v1/completions", {**base, **fields})
            assert 400 <= status < 500 and fragment in body, (case, status, body)
            assert_still_serving(server, model, want, case)
        nan = json.dumps(base)[:-1] + ', "temperature": NaN}'
        status, body = server.post_raw("/v1/completions", nan.encode())
        assert status == 400 and "temperature" in body, ("temperature NaN", status, body)
        status, body = server.post_error("/v1/completions", {**base, "seed": -5, **SAMPLED})
        assert status == (400 if runtime_refuses_seed(-5) else 200), ("negative seed", status, body)
        check_chat_refusals(server, model)
        assert_still_serving(server, model, want, "chat")
        fanned = completion(server, model, n=3, seed=1, **SAMPLED)["choices"]  # 3 sequences, 2 slots: one waits
        assert len(fanned) == 3 and all(len(c["token_ids"]) == NEW for c in fanned), fanned
        check_one_failed_request_leaves_the_others(server, model, want)
        assert_still_serving(server, model, want, "injected fault")
        core = server.engine_core()
        server.rpc("slow_steps", 0.2)  # 25 tokens take >= 5 s: the kill at the 2nd event lands mid-stream
        body = {"model": model, "prompt": PROMPT, "max_tokens": 25, "ignore_eos": True, "temperature": 0.0}
        events = server.stream("/v1/completions", body, on_event=lambda n: n == 2 and os.kill(core.pid, signal.SIGKILL))
        server.process.wait(120)  # exits on its own; its status is checked when the block ends
    assert len(events) < 25 and "error" in events[-1], events[-2:]
    log = (tmp_path / "serve.log").read_text()
    assert "injected fault" in log, "the failed request is logged with its cause"
    assert f"exits with status {ENGINE_DIED_EXIT_CODE}" in log


def check_chat_refusals(server: Server, model: str) -> None:
    """``top_logprobs`` above the maximum, and an image sent to a text-only artifact."""
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg=="
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixel}"}}
    cases = {
        "top_logprobs": ([{"role": "user", "content": "hello"}], {"logprobs": True, "top_logprobs": 30}),
        "image": ([{"role": "user", "content": [{"type": "text", "text": "what"}, image]}], {}),
    }
    for case, (messages, fields) in cases.items():
        body = {"model": model, "messages": messages, "max_tokens": NEW, **fields}
        status, answer = server.post_error("/v1/chat/completions", body)
        assert 400 <= status < 500, (case, status, answer)


def check_one_failed_request_leaves_the_others(server: Server, model: str, want: list[int]) -> None:
    """A step failure of one request: that request errors (HTTP 500, or an error event when streaming), the one
    scheduled beside it completes unchanged."""
    server.rpc("arm_fault", json.dumps(MARKED[:3]))
    marked = {"model": model, "prompt": MARKED, "max_tokens": NEW, "temperature": 0.0}
    with ThreadPoolExecutor(2) as pool:
        failing = pool.submit(server.post_error, "/v1/completions", marked)
        beside = pool.submit(completion, server, model)
        status, body = failing.result()
        assert beside.result()["choices"][0]["token_ids"] == want, "the request beside the failed one"
    assert status == 500 and "error" in body, (status, body)
    events = server.stream("/v1/completions", marked)
    assert events and "error" in events[-1], events
