"""`vllm.LLM` on exported artifacts through the optimum-neuronx platform plugin (each test in a fresh
interpreter: a vLLM engine holds process-global state).

Greedy tokens must equal `NeuronModelForCausalLM.generate` on the same artifact and transformers, for
chunked and context-encoding artifacts, alone and batched; every other family (sliding windows, Gemma 3,
Phi-3, Qwen3-MoE) serves transformers' greedy tokens and our sampling rule's draws from transformers'
distributions; prompts longer than vLLM's default token budgets complete; a long prompt's chunks interleave
with the decodes of a running request.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.contract.engine_tools import loaded
from tests.fixtures.llm.models import cache_dir, export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy, hf_sampled
from tests.utils import settled, subprocess_test

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CHUNK = 8
NEW_TOKENS = 6


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed + length)).tolist()


def greedy(max_tokens: int = NEW_TOKENS) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def vllm_tokens(llm: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def prefilled_tokens(records: list[dict[str, Any]]) -> Counter[str]:
    """Prompt tokens fed per request over the runner's recorded steps."""
    fed: Counter[str] = Counter()
    for r in records:
        for req, _, count in r["prefills"]:
            fed[req] += count
    return fed


def our_tokens(artifact: Path, ids: list[int], new: int = NEW_TOKENS) -> list[int]:
    model = loaded(artifact)
    return model.generate(torch.tensor([ids]), max_new_tokens=new, eos_token_id=[])[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", ["llama-2x4x8-inductor", "llama-2x1x32-ce-inductor"])
@subprocess_test
def test_llm_generate_equals_generate_and_transformers(name: str) -> None:
    from vllm import LLM

    artifact = export_fixture(name)
    short, long = prompt(3), prompt(2 * CHUNK + 5)
    llm = LLM(model=str(artifact), seed=0)
    alone = [vllm_tokens(llm, [p], greedy())[0] for p in (short, long)]
    together = vllm_tokens(llm, [short, long], greedy())
    for ids, got, batched in zip((short, long), alone, together, strict=True):
        assert got == our_tokens(artifact, ids), f"{name}: vLLM != generate() for {len(ids)} tokens"
        assert got == hf_greedy(tiny_model("llama"), ids, NEW_TOKENS), f"{name}: vLLM != transformers"
        assert batched == got, f"{name}: batched output differs from the prompt alone"


@subprocess_test
def test_a_larger_token_budget_runs_several_chunks_per_step() -> None:
    """``--max-num-batched-tokens 3C`` on a chunked artifact is kept: a prompt of 2C + 5 tokens is fed in one step
    (three chunk calls), beside a short one, and both get generate()'s tokens."""
    from vllm import LLM

    artifact = export_fixture("llama-2x4x8-eager")
    llm = LLM(model=str(artifact), seed=0, max_num_batched_tokens=3 * CHUNK)
    assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 3 * CHUNK
    short, long = prompt(3), prompt(2 * CHUNK + 5)
    got = vllm_tokens(llm, [long, short], greedy())
    assert got == [our_tokens(artifact, ids) for ids in (long, short)]
    records = llm.collective_rpc("step_records")[0]
    per_step = [prefilled_tokens([r]) for r in records]  # a record lists each chunk call
    assert max(step[req] for step in per_step for req in step) == 2 * CHUNK + 5, "the prompt took several steps"


SERVED_FAMILIES = ("mistral", "qwen2", "gemma3", "phi3", "qwen3_moe")
"""Families vLLM serves here beyond llama: a uniform sliding window below the chunk (mistral), a sliding
layer beside a full one (qwen2), interleaved sliding and global layers with their own rope (gemma3), fused
projections and partial rotary (phi3), mixture of experts (qwen3_moe). The plugin has no per-family code:
one engine per family, in one interpreter, is enough."""


@subprocess_test
def test_llm_generate_serves_each_family() -> None:
    import os

    from vllm import LLM
    from vllm import SamplingParams as VllmSampling

    from optimum.neuron.artifact import read_config
    from optimum.neuron.runtime.sampling import SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: one import for all
    knobs = {"temperature": 1.3, "top_k": 40, "top_p": 0.9, "seed": 21}
    short, long = prompt(CHUNK - 1, 7), prompt(3 * CHUNK + 2, 8)  # both generations cross the sliding windows
    for family in SERVED_FAMILIES:
        # the eager artifact: the contract suite checks every backend's graphs, this that the plugin serves them
        artifact, model = export_fixture(f"{family}-2x4x8-eager"), tiny_model(family)
        llm = LLM(model=str(artifact), seed=0)
        together = vllm_tokens(llm, [short, long], greedy())
        assert together == [hf_greedy(model, ids, NEW_TOKENS) for ids in (short, long)], f"{family}: greedy"
        sampled = vllm_tokens(llm, [long], VllmSampling(max_tokens=NEW_TOKENS, ignore_eos=True, **knobs))[0]
        ours = SamplingParams(do_sample=True, **knobs)
        assert sampled == hf_sampled(model, long, NEW_TOKENS, ours, read_config(artifact).max_topk), family
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("name", ["llama-2x4x8-inductor", "llama-2x4x8-mixed-eager"])
@subprocess_test
def test_long_prompt_chunks_interleave_with_running_decodes(name: str) -> None:
    """The decodes of a running request share every step that feeds a long prompt's chunk; with ``--mixed_batch``
    (``-mixed``) such a step is one mixed-graph call."""
    from vllm import LLM

    # The engine core in this process: `generate` adds both requests before the first step. In its own process the
    # core may step before the second one arrives (seen under load: the short request finished first, alone).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    artifact = export_fixture(name)
    short, long = prompt(3, 1), prompt(3 * CHUNK, 2)
    llm = LLM(model=str(artifact), seed=0)
    # The short request is admitted first and decodes while the long prompt is fed chunk by chunk.
    out = vllm_tokens(llm, [short, long], greedy(max_tokens=8))
    assert out == [our_tokens(artifact, short, 8), our_tokens(artifact, long, 8)]
    records = llm.collective_rpc("step_records")[0]
    fed = prefilled_tokens(records)
    long_id = max(fed, key=lambda req: fed[req])
    chunk_steps = [r for r in records if any(p[0] == long_id for p in r["prefills"])]
    assert len(chunk_steps) >= 3, f"the long prompt was not fed in chunks: {records}"
    for r in chunk_steps[1:]:
        assert r["decodes"], f"step {r['index']} fed a chunk of the long prompt but decoded nothing: {records}"
        assert r["mixed"] == name.endswith("-mixed-eager"), f"step {r['index']}: {records}"
    assert out[1] == hf_greedy(tiny_model("llama"), long, 8)
    budget = CHUNK
    assert all(len(r["decodes"]) + sum(p[2] for p in r["prefills"]) <= budget for r in records), records
    # (no slot check here: an in-process core releases the last finished request at its next step, which never comes;
    # the other tests check it with the core in its own process)


@subprocess_test
def test_n_parallel_samples_are_seeded_wait_for_slots_and_free_them() -> None:
    """n=3 on a 2-slot artifact: vLLM's front end fans the request out into 3 requests of their own (seeds seed+i);
    the third waits for a slot instead of failing; the same seed gives the same 3 completions; no slot is kept."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(export_fixture("llama-2x4x8-inductor")), seed=0)
    ids = prompt(CHUNK + 3, 5)

    def completions(seed: int) -> list[list[int]]:
        params = SamplingParams(n=3, seed=seed, temperature=1.0, top_k=50, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs
        return [list(c.token_ids) for c in outputs]

    first, again, other = completions(7), completions(7), completions(8)
    assert len(first) == 3 and all(len(t) == NEW_TOKENS for t in first)
    assert first == again, "the same seed gave other completions"
    assert len({tuple(t) for t in first}) == 3, "the 3 children sampled the same tokens"
    assert other != first, "seeds 7 and 8 agree"
    assert settled(lambda: llm.collective_rpc("slot_usage"), [{}]) == [{}], "a child request kept its KV slot"


LONG = 8300
"""A prompt longer than vLLM's default token budgets (2048 for ``vllm serve``, 8192 for ``LLM``)."""


def long_artifact(chunk: int) -> Path:
    """A tiny llama exported (eager) with room for `LONG` tokens, chunked or context encoding."""
    from optimum.exporters.neuron.export import export
    from optimum.neuron import NeuronConfig

    config = NeuronConfig(
        batch_size=1, sequence_length=8448, prefill_chunk_size=chunk, backend="eager", decode_logits=False
    )
    name = f"llama-1x{8448 // chunk}x{chunk}-eager" if chunk else "llama-1x1x8448-ce-eager"
    return export(tiny_model("llama"), cache_dir() / "fixtures" / name, config)


@pytest.mark.parametrize("chunk", [1024, 0], ids=["chunked", "context-encoding"])
@subprocess_test
def test_prompt_longer_than_default_budgets_completes(chunk: int) -> None:
    from vllm import LLM

    artifact = long_artifact(chunk)
    ids = prompt(LONG, 3)
    want = our_tokens(artifact, ids, 4)  # before the engine starts: a large eager prefill after it stalled
    llm = LLM(model=str(artifact), seed=0)
    assert vllm_tokens(llm, [ids], greedy(4)) == [want]
    records = llm.collective_rpc("step_records")[0]
    fed = [p for r in records for p in r["prefills"]]
    assert sum(p[2] for p in fed) == LONG
    if chunk:
        assert max(p[2] for p in fed) <= chunk, "vLLM scheduled more than one chunk of the prompt at once"
    else:
        assert len(fed) == 1, "a context-encoding artifact must get the whole prompt in one step"


def run_until_done(engine: Any, outputs: dict[str, list[int]], limit: int = 200) -> None:
    """Step ``engine`` until it has no unfinished request, recording each request's latest tokens."""
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
    raise AssertionError(f"requests still unfinished after {limit} steps")


@subprocess_test
def test_aborted_requests_give_their_slots_back() -> None:
    import os

    from vllm import LLM

    # The engine core runs in this process, so each `step()` is exactly one scheduler step: with the
    # core in its own process it runs ahead of the client, and "mid-prefill" / "mid-decode" become races.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    artifact = export_fixture("llama-2x4x8-inductor")
    short, long, other = prompt(3, 4), prompt(3 * CHUNK, 5), prompt(5, 6)
    want = {"short": our_tokens(artifact, short, 12), "after": our_tokens(artifact, long, 4)}
    llm = LLM(model=str(artifact), seed=0)
    engine, outputs = llm.llm_engine, {}
    engine.add_request("short", {"prompt_token_ids": short}, greedy(12))
    engine.add_request("long", {"prompt_token_ids": long}, greedy(4))
    engine.step()  # short's prompt and the first part of long's
    engine.abort_request(["long"])  # mid-prefill
    engine.add_request("other", {"prompt_token_ids": other}, greedy(8))
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
    assert 1 <= len(outputs.get("other", [])) < 8, "'other' should be decoding when it is aborted"
    engine.abort_request(["other"])  # mid-decode
    run_until_done(engine, outputs)
    # Workers learn that a request finished from the next step's scheduler output; the engine core's busy
    # loop runs that step by itself when it has its own process. In-process, this step delivers it.
    engine.step()
    assert outputs["short"] == want["short"], "the request left running changed its tokens"
    assert settled(lambda: llm.collective_rpc("slot_usage"), [{}]) == [{}], "an aborted request kept its KV slot"
    records = llm.collective_rpc("step_records")[0]
    fed = prefilled_tokens(records)
    assert 0 < min(fed.values()) < len(long), f"no request was aborted mid-prefill: {records}"
    # Both slots are free again: two requests fill the artifact's batch and finish with the right tokens.
    assert vllm_tokens(llm, [long, short], greedy(4)) == [want["after"], want["short"][:4]]


@subprocess_test
def test_async_and_sync_scheduling_serve_the_same_tokens_and_free_every_slot() -> None:
    """vLLM schedules step N+1 while our worker runs step N (async, its default) or waits for it: both serve the same
    tokens as `generate()`. Three requests on a 2-slot artifact (one waits for a slot), one stopped by a stop token
    mid-run (under async it is already in the next step: that extra decode is dropped and its slot still freed)."""
    from vllm import LLM, SamplingParams

    artifact = export_fixture("llama-2x4x8-inductor")
    prompts = [prompt(3, 7), prompt(2 * CHUNK + 1, 8), prompt(5, 9)]
    want = [our_tokens(artifact, ids, 10) for ids in prompts]
    stop_at = next(i for i in range(2, 10) if want[1][i] not in want[1][:i])
    want[1] = want[1][: stop_at + 1]  # vLLM's token ids end with the stop token
    params = [greedy(10), SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[want[1][-1]]), greedy(10)]
    for asynchronous in (True, False):
        llm = LLM(model=str(artifact), seed=0, async_scheduling=asynchronous)
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is asynchronous
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want, f"async_scheduling={asynchronous}"
        assert outputs[1].outputs[0].finish_reason == "stop"
        slots = settled(functools.partial(llm.collective_rpc, "slot_usage"), [{}])
        assert slots == [{}], f"async_scheduling={asynchronous}: a slot is still held"
        llm.llm_engine.engine_core.shutdown()


@subprocess_test
def test_an_int8_kv_artifact_serves_generates_tokens() -> None:
    """``--kv_cache_dtype int8``: vLLM places requests in the int8 cache (its spec says int8, with the artifact's
    blocks) and returns `generate()`'s greedy tokens, batched."""
    import os

    from vllm import LLM

    from optimum.neuron.artifact import read_config

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its worker is reachable
    artifact = export_fixture("llama-2x4x8-kvint8-eager")
    short, long = prompt(3), prompt(2 * CHUNK + 5)
    want = [our_tokens(artifact, ids) for ids in (short, long)]
    llm = LLM(model=str(artifact), seed=0)
    assert vllm_tokens(llm, [short, long], greedy()) == want
    specs = llm.collective_rpc("get_kv_cache_spec")[0]
    assert {spec.dtype for spec in specs.values()} == {torch.int8}
    memory = llm.collective_rpc("determine_available_memory")[0]
    assert memory == read_config(artifact).kv_blocks * sum(spec.page_size_bytes for spec in specs.values())
    assert memory == llm.collective_rpc(_engine_cache_bytes)[0]  # the int8 values and their scales, every byte


def _engine_cache_bytes(worker: Any) -> int:
    from optimum.neuron.models.layers.kv_cache import cache_bytes

    return cache_bytes(worker.runner.engine.kv_cache)
