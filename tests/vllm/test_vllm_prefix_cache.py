"""vLLM's KV cache manager places requests in the artifact's paged cache (each test in a fresh interpreter).

* Prefix caching, through ``vllm serve`` over HTTP: a prompt sent again, and a prompt that shares all but its last 25
  tokens with an earlier one, are served from the cached blocks: vLLM's ``vllm:prefix_cache_hits`` grows by the
  cached part, the runner's step records show that only the other tokens were prefilled, and the tokens equal
  transformers'. (Image-text prompts: `tests/vllm/test_vllm_multimodal.py`.)
* A pool smaller than the slots need at full length: vLLM preempts (``vllm:num_preemptions``) and recomputes, every
  output still equals transformers', and after 100 aborted requests no block is held, by vLLM
  (``vllm:kv_cache_usage_perc``) or by the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.llm.models import export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy
from tests.utils import settled, subprocess_test
from tests.vllm.server import vllm_serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BLOCK = 4
"""The fixtures' KV block size."""


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def metric(llm: Any, name: str) -> float:
    """The value of vLLM's metric ``name`` summed over its labels (``LLM.get_metrics``)."""
    return sum(float(m.value) for m in llm.get_metrics() if m.name == name)


@subprocess_test
def test_a_small_pool_preempts_recomputes_and_leaks_no_block() -> None:
    import os

    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    artifact = export_fixture("llama-2x4x8-pool32-eager")  # 8 blocks of 4: one sequence at its full 32 positions
    prompts = [prompt(14, 10 + i) for i in range(4)]  # each grows to 26 positions (7 blocks): two do not fit
    llm = LLM(model=str(artifact), seed=0, disable_log_stats=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(12), use_tqdm=False)
    model = tiny_model("llama")
    for ids, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, ids, 12), "a preempted request changed its tokens"
    assert metric(llm, "vllm:num_preemptions") > 0, "the pool was large enough: nothing was preempted"
    engine = llm.llm_engine
    for i in range(100):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt(6 + i % 20, 100 + i)}, greedy(20))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(100)])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # the workers learn of the aborts from the next scheduler output
    assert metric(llm, "vllm:kv_cache_usage_perc") == 0, "vLLM still counts blocks in use after the aborts"
    assert settled(lambda: llm.collective_rpc("block_usage"), [{}]) == [{}], "the engine still holds blocks"


def served_counter(server: Any, name: str) -> float:
    """vLLM's Prometheus counter ``name`` (``_total``) summed over its labels, from the server's ``/metrics``."""
    import re
    import urllib.request

    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    pattern = rf"^{re.escape(name)}_total(?:\{{[^}}]*\}})? ([0-9.e+]+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


@subprocess_test
def test_vllm_serve_serves_resent_and_shared_prompts_from_cached_blocks(tmp_path: Path) -> None:
    """The same through ``vllm serve`` over HTTP: prompts as token ids on ``/v1/completions``, the hits from
    ``/metrics``, the prefills from the runner's records (``/collective_rpc``)."""
    import os

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc
    artifact = export_fixture("llama-2x8x16-eager")
    shared = prompt(45, 4)
    first, second = shared + prompt(25, 5), shared + prompt(25, 6)
    model = tiny_model("llama")
    with vllm_serve(artifact, tmp_path / "serve.log") as server:
        name = server.get("/v1/models")["data"][0]["id"]
        for ids, cached in ((first, 0), (first, 17 * BLOCK), (second, 11 * BLOCK)):
            hits, steps = served_counter(server, "vllm:prefix_cache_hits"), len(server.rpc("step_records")[0])
            body = {"model": name, "prompt": ids, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            body["return_token_ids"] = True
            choice = server.post("/v1/completions", body)["choices"][0]
            assert choice["token_ids"] == hf_greedy(model, ids, 6), f"cached {cached}: not transformers' tokens"
            assert served_counter(server, "vllm:prefix_cache_hits") - hits == cached, f"hits for {cached} cached"
            prefills = [p for r in server.rpc("step_records")[0][steps:] for p in r["prefills"]]
            assert prefills[0][1] == cached and sum(p[2] for p in prefills) == len(ids) - cached, prefills
