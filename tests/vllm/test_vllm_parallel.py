"""Scaling out through vLLM's own executors: data parallelism (``vllm serve --data-parallel-size 2``: two engine
replicas of one artifact, load-balanced by vLLM's front end) and tensor parallelism (a ``-tp2`` artifact: vLLM's
multiprocess executor starts one worker per rank, the degree read from the artifact). Each test runs in a fresh
interpreter."""

from __future__ import annotations

import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.fixtures.llm.models import export_fixture, tiny_model
from tests.utils import subprocess_test
from tests.vllm.server import Server, vllm_serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NEW_TOKENS = 6


def prompts(count: int) -> list[list[int]]:
    """``count`` random prompts of 3 to 19 tokens (fixed seed): some fit one chunk, some span several."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (3 + 3 * i,), generator=gen).tolist() for i in range(count)]


def finished_per_engine(server: Server) -> Counter[str]:
    """Requests each engine replica finished, from vLLM's Prometheus ``/metrics`` (label ``engine``)."""
    import urllib.request

    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    counts: Counter[str] = Counter()
    for match in re.finditer(r"^vllm:request_success_total\{([^}]*)\} ([0-9.e+]+)$", text, re.MULTILINE):
        engine = re.search(r'engine="(\d+)"', match.group(1))
        if engine:
            counts[engine.group(1)] += int(float(match.group(2)))
    return counts


SEEDED = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 11}


def tp_reference(name: str, asked: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """transformers' greedy tokens of each prompt, and our seeded rule's tokens for the first one."""
    from optimum.neuron.runtime.sampling import SamplingParams
    from tests.fixtures.llm.models import EXPORT_FIXTURES
    from tests.fixtures.llm.reference import hf_greedy, hf_sampled

    model = EXPORT_FIXTURES[name].model()
    seeded = hf_sampled(model, asked[0], NEW_TOKENS, SamplingParams(do_sample=True, **SEEDED), 256)
    return [hf_greedy(model, ids, NEW_TOKENS) for ids in asked], seeded


OFFLINE_FIXTURES = ("llama-2x1x32-ce-kv1-tp2-eager",) + (
    ("llama-2x4x8-kv1-tp2-eager",) if os.environ.get("OPTIMUM_NEURON_TP_ALL") == "1" else ()
)
"""Context encoding here; chunked prefill runs through `vllm serve` below and, with ``OPTIMUM_NEURON_TP_ALL=1``, here
too (45 s more, out of CI's time budget)."""


@subprocess_test
def test_tensor_parallel_offline_equals_transformers() -> None:
    """``vllm.LLM`` on 2-rank artifacts (one KV head, replicated on both ranks)."""
    from vllm import LLM, SamplingParams

    asked = prompts(4)
    for name in OFFLINE_FIXTURES:
        want, want_seeded = tp_reference(name, asked)
        llm = LLM(model=str(export_fixture(name)), seed=0)
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in asked], greedy, use_tqdm=False)
        seeded = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **SEEDED)
        sampled = llm.generate([{"prompt_token_ids": asked[0]}], seeded, use_tqdm=False)[0].outputs[0].token_ids
        llm.llm_engine.engine_core.shutdown()
        assert [list(o.outputs[0].token_ids) for o in outputs] == want, f"{name}: greedy tokens"
        assert list(sampled) == want_seeded, f"{name}: seeded tokens"


@subprocess_test
def test_tensor_parallel_server_equals_transformers(tmp_path: Path) -> None:
    """``vllm serve`` of the 2-rank inductor artifact (qwen3: KV heads split over the ranks; the engine's own test of
    it, tests/models/test_tensor_parallel.py, shares its export): concurrent greedy requests and a seeded one."""
    name = "qwen3-2x4x8-tp2-inductor"
    artifact = export_fixture(name)
    asked = prompts(4)
    want, want_seeded = tp_reference(name, asked)
    with vllm_serve(artifact, tmp_path / "serve.log") as server:
        model = server.get("/v1/models")["data"][0]["id"]
        base = {"model": model, "max_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True}

        def complete(ids: list[int], **params: object) -> list[int]:
            body = {**base, "prompt": ids, "temperature": 0.0, **params}
            return server.post("/v1/completions", body)["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(asked)) as pool:
            got = list(pool.map(complete, asked))
        seeded = complete(asked[0], **SEEDED)
    assert got == want, "greedy tokens"
    assert seeded == want_seeded, "seeded tokens"
    log = (tmp_path / "serve.log").read_text()
    assert "(rank 0 of 2)" in log and "(rank 1 of 2)" in log, "one worker per rank"


@subprocess_test
def test_data_parallel_server_equals_transformers_on_both_replicas(tmp_path: Path) -> None:
    """qwen3_moe: vLLM runs the replicas of an MoE model in lockstep, and a replica with nothing scheduled runs
    the worker's ``execute_dummy_batch`` while the other steps (the path a dense model never takes)."""
    from tests.fixtures.llm.reference import hf_greedy

    family = "qwen3_moe"
    artifact = export_fixture(f"{family}-2x4x8-eager")
    asked = prompts(6)
    want = [hf_greedy(tiny_model(family), ids, NEW_TOKENS) for ids in asked]
    flags = ("--data-parallel-size", "2", "--api-server-count", "1")
    with vllm_serve(artifact, tmp_path / "serve.log", *flags) as server:
        name = server.get("/v1/models")["data"][0]["id"]
        greedy = {"model": name, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}

        def complete(ids: list[int]) -> list[int]:
            body = {**greedy, "prompt": ids, "return_token_ids": True}
            return server.post("/v1/completions", body)["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(asked)) as pool:
            got = list(pool.map(complete, asked))
        alone = [complete(ids) for ids in asked[:2]]  # one at a time: the other replica idles in lockstep
        served = finished_per_engine(server)
        health = server.get_status("/health")
    assert got == want, "DP=2 greedy tokens differ from transformers'"
    assert alone == want[:2], "requests sent alone differ"
    assert sorted(served) == ["0", "1"] and sum(served.values()) == len(asked) + 2, f"requests per replica: {served}"
    assert health == 200, "a replica died (an idle MoE replica calls the worker's execute_dummy_batch)"
