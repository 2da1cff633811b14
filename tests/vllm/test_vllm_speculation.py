"""vLLM speculation on an artifact with a verification graph (``--speculation_length 3``): the worker drafts with
vLLM's ``NgramProposer`` or a draft artifact in an engine of its own, the engine keeps the drafts its own sampler
agrees with, vLLM counts the rest as rejected. Greedy and seeded tokens equal transformers' (speculation changes how
many tokens a step yields, never which), vLLM's spec-decode counters count the drafts the runner kept, and every slot is
freed. The refusals (another method, more tokens than the artifact verifies, an artifact without the graph, async
scheduling, a draft that is not a one-rank chunked artifact of the target's vocabulary and batch) are in
test_vllm_platform.py."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.fixtures.llm.models import export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy, hf_sampled
from tests.utils import settled, subprocess_test
from tests.vllm.server import vllm_serve
from tests.vllm.test_vllm_offline import run_until_done

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
FIXTURE = "llama-2x4x8-spec3-eager"
SELF_DRAFT = "llama-2x4x8-eager"
"""The target's own tiny llama as a draft artifact: its greedy drafts are the target's greedy tokens."""

SEQUENCE_LENGTH = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
COPYING = (58, 56)
"""Seeds of prompts (`prompt`) after which the tiny llama's greedy output repeats a token and what followed it once:
the n-gram proposer's draft is then right once (found with vLLM's own n-gram matcher over transformers' tokens)."""


def prompt(seed: int) -> list[int]:
    length = 6 + seed % 5
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(100 + seed)).tolist()


def spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens), summed over engines."""
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name] = counters.get(metric.name, 0.0) + float(metric.value)
    return counters


@subprocess_test
def test_ngram_speculation_serves_transformers_tokens_and_counts_what_it_kept() -> None:
    from vllm import LLM, SamplingParams

    from optimum.neuron.artifact import read_config
    from optimum.neuron.runtime.sampling import SamplingParams as OurParams

    artifact, model = export_fixture(FIXTURE), tiny_model("llama")
    every = {"verify_every_proposal": True}  # the tiny model's few steps would not teach `DraftGate` that it pays
    llm = LLM(model=str(artifact), seed=0, speculative_config=NGRAM, additional_config=every, disable_log_stats=False)
    prompts = [prompt(seed) for seed in COPYING]
    news = [SEQUENCE_LENGTH - len(p) for p in prompts]  # to the end of the cache: drafts are cut at its edge
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in news]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # one step, two rows
    for ids, new, out in zip(prompts, news, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, ids, new), f"greedy after {len(ids)} tokens"
    counters = spec_counters(llm)
    assert counters["vllm:spec_decode_num_drafts"] > 0, counters
    assert counters["vllm:spec_decode_num_draft_tokens"] >= counters["vllm:spec_decode_num_drafts"], counters
    assert counters["vllm:spec_decode_num_accepted_tokens"] >= len(COPYING), f"a right draft was not kept: {counters}"
    # Without a kept draft each request decodes its tokens but the first one step at a time: sum(n - 1) rows in
    # all, whether the engine core got both requests in its first step or (a loaded machine) stepped one first.
    rows = sum(len(r["decodes"]) for r in llm.collective_rpc("step_records")[0])
    assert rows < sum(n - 1 for n in news), "no decode row yielded more than one token"

    knobs = {"temperature": 1.3, "top_k": 40, "top_p": 0.9, "seed": 21}
    ids = prompt(COPYING[0])  # all cached but its last token: vLLM pads its first step with -1 drafts (no proposal)
    new = SEQUENCE_LENGTH - len(ids)
    sampled = (
        llm.generate(
            [{"prompt_token_ids": ids}], SamplingParams(max_tokens=new, ignore_eos=True, **knobs), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    ours = OurParams(do_sample=True, **knobs)
    assert list(sampled) == hf_sampled(model, ids, new, ours, read_config(artifact).max_topk), "seeded sampling"
    assert settled(lambda: llm.collective_rpc("slot_usage"), [{}]) == [{}], "a finished request kept its KV slot"


@subprocess_test
def test_the_drafter_proposes_for_verifiable_decodes_within_the_schedulers_budget() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_match

    from optimum.neuron.artifact import Artifact
    from optimum.neuron.runtime.engine import Engine
    from optimum.neuron.runtime.sampling import SamplingParams as OurParams
    from optimum.neuron.vllm.drafting import NgramDrafter

    artifact = export_fixture(FIXTURE)
    schedule = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 0]]}
    config = EngineArgs(model=str(artifact), speculative_config=schedule).create_engine_config()
    drafter = NgramDrafter.of(config)
    assert drafter is not None and drafter.k == 3
    engine = Engine(Artifact.open(artifact))
    for seed in range(64):  # the first prompt whose greedy token appeared in it: vLLM's matcher proposes after it
        engine.release("plain")
        engine.admit("plain", prompt(seed) * 2, OurParams(), reuse=False)
        engine.step({"plain": len(prompt(seed)) * 2})
        history = engine.sequence("plain").tokens
        expected = vllm_match(np.array(history, dtype=np.int32), 1, 2, SEQUENCE_LENGTH, 3).tolist()
        if expected:
            break
    assert expected, "no prompt to propose after"
    engine.admit("prefilling", list(range(3, 23)), OurParams(), reuse=False)
    engine.step({"prefilling": 8})
    ids = ["plain", "prefilling"]
    drafts = drafter.draft(engine, ids)
    assert (drafts.req_ids, drafts.draft_token_ids) == (ids, [expected, []]), "a prefilling request: no draft"
    assert drafter.draft(engine, ids, budget=1).draft_token_ids == [expected[:1], []]
    assert drafter.draft(engine, ids, budget=0).draft_token_ids == [[], []], "the schedule turned speculation off"


def test_vllm_serve_with_a_draft_artifact_answers_transformers_tokens_and_counts_in_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm serve --speculative-config '{"method": "draft_model", ...}'`` over HTTP, the draft being the target's own
    tiny model: greedy and seeded completions equal transformers', every greedy draft is kept (``/metrics``), fewer
    decode steps than tokens, and no slot of the target or the draft is left held."""
    from optimum.neuron.artifact import read_config
    from optimum.neuron.runtime.sampling import SamplingParams as OurParams

    artifact, model = export_fixture(FIXTURE), tiny_model("llama")
    draft = {"method": "draft_model", "model": str(export_fixture(SELF_DRAFT)), "num_speculative_tokens": 3}
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # /collective_rpc: the runner's step records and slots
    with vllm_serve(artifact, tmp_path / "serve.log", "--speculative-config", json.dumps(draft)) as server:
        name = server.get("/v1/models")["data"][0]["id"]
        asked = [(prompt(3), SEQUENCE_LENGTH - len(prompt(3))), (prompt(4), 7)]  # to the cache's end; max_tokens
        with ThreadPoolExecutor(2) as pool:  # both in flight together: steps of two rows
            answers = list(pool.map(lambda a: completion(server, name, a[0], a[1], temperature=0.0), asked))
        for (ids, new), tokens in zip(asked, answers, strict=True):
            assert tokens == hf_greedy(model, ids, new), f"greedy after {len(ids)} tokens"
        counters = metric_counters(server)
        drafted, kept = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
        assert drafted >= 6 and kept == drafted, f"the model's own greedy drafts were not all kept: {counters}"
        steps = [r for r in server.rpc("step_records")[0] if r["decodes"]]
        assert len(steps) <= (asked[0][1] - 1) // 4 + 3, f"{len(steps)} decode steps for {asked[0][1]} tokens"
        knobs = {"temperature": 1.3, "top_k": 40, "top_p": 0.9, "seed": 21}
        ids = prompt(5)
        new = SEQUENCE_LENGTH - len(ids)
        want = hf_sampled(model, ids, new, OurParams(do_sample=True, **knobs), read_config(artifact).max_topk)
        assert completion(server, name, ids, new, **knobs) == want, "seeded sampling with greedy drafts"
        assert settled(lambda: server.rpc("slot_usage"), [{}]) == [{}], "a finished request kept its KV slot"
        assert server.rpc("draft_slot_usage") == [{}], "a finished request kept its draft slot"


def completion(server: Any, name: str, ids: list[int], new: int, **knobs: Any) -> list[int]:
    """The token ids of a completion of the prompt ``ids``."""
    body = {"model": name, "prompt": ids, "max_tokens": new, "ignore_eos": True, "return_token_ids": True, **knobs}
    return list(server.post("/v1/completions", body)["choices"][0]["token_ids"])


def metric_counters(server: Any) -> dict[str, float]:
    """vLLM's spec-decode counters from ``/metrics`` (Prometheus text), summed over engines."""
    import urllib.request

    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    counters: dict[str, float] = {}
    for found in re.finditer(r"^(vllm:spec_decode_num_\w+?)(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE):
        counters[found.group(1)] = counters.get(found.group(1), 0.0) + float(found.group(2))
    return counters


@subprocess_test
def test_a_request_aborted_while_speculating_frees_its_target_and_draft_slots() -> None:
    """With a draft artifact, a request aborted after its drafts were verified (mid-decode) gives back its KV slot and
    its draft slot; the request beside it keeps transformers' tokens."""
    import os

    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # each `step()` is one scheduler step (no race with the core)
    spec = {"method": "draft_model", "model": str(export_fixture(SELF_DRAFT)), "num_speculative_tokens": 3}
    llm = LLM(model=str(export_fixture(FIXTURE)), seed=0, speculative_config=spec)
    engine, outputs = llm.llm_engine, {}
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request("kept", {"prompt_token_ids": prompt(1)}, greedy)
    engine.add_request("gone", {"prompt_token_ids": prompt(2)}, greedy)
    for _ in range(8):  # until 'gone' decodes past its first token: the drafter has proposed for it
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        if len(outputs.get("gone", [])) >= 2:
            break
    assert 2 <= len(outputs["gone"]) < 16, f"'gone' should be decoding on drafts when aborted: {outputs}"
    engine.abort_request(["gone"])
    run_until_done(engine, outputs)
    engine.step()  # in-process, the workers learn of the finished requests from this step's scheduler output
    assert outputs["kept"] == hf_greedy(tiny_model("llama"), prompt(1), 16), "the request left running changed"
    assert settled(lambda: llm.collective_rpc("slot_usage"), [{}]) == [{}], "an aborted request kept its KV slot"
    assert llm.collective_rpc("draft_slot_usage") == [{}], "an aborted request kept its draft slot"


@subprocess_test
def test_the_draft_model_follows_the_accepted_tokens() -> None:
    """The drafter's proposals are the draft model's greedy tokens after what the target kept, round after round: the
    draft is the target's own model, one sequence greedy (every draft kept), one sampled (drafts partly kept, so the
    draft sequence is rewound past rejected tokens)."""
    from vllm.engine.arg_utils import EngineArgs

    from optimum.neuron.artifact import Artifact
    from optimum.neuron.runtime.engine import Engine
    from optimum.neuron.runtime.sampling import SamplingParams as OurParams
    from optimum.neuron.vllm.drafting import ModelDrafter

    artifact, model = export_fixture(FIXTURE), tiny_model("llama")
    spec = {"method": "draft_model", "model": str(export_fixture(SELF_DRAFT)), "num_speculative_tokens": 3}
    drafter = ModelDrafter.of(EngineArgs(model=str(artifact), speculative_config=spec).create_engine_config())
    target = Engine(Artifact.open(artifact))
    ids = ["greedy", "sampled"]
    target.admit("greedy", prompt(6), OurParams(), reuse=False)
    target.admit("sampled", prompt(7), OurParams(do_sample=True, temperature=1.0, seed=3), reuse=False)
    target.step({r: target.sequence(r).pending for r in ids})
    kept: dict[str, list[int]] = {r: [] for r in ids}
    for _ in range(5):  # propose, verify, and propose again after what the target kept
        drafts = drafter.draft(target, ids)
        for seq_id, proposed in zip(ids, drafts.draft_token_ids, strict=True):
            tokens = target.sequence(seq_id).tokens
            assert proposed == hf_greedy(model, tokens, 3), f"{seq_id}: not the draft model's greedy tokens"
        result = target.step({r: 1 for r in ids}, drafts=dict(zip(ids, drafts.draft_token_ids, strict=True)))
        for seq_id in ids:
            kept[seq_id].append(result.accepted.get(seq_id, 0))
    assert kept["greedy"] == [3] * 5, f"the model's own greedy drafts were not all kept: {kept}"
    assert 0 < sum(kept["sampled"]) < 15, f"sampling kept all or none of the drafts: {kept}"
    assert drafter.draft(target, ids, budget=0).draft_token_ids == [[], []], "the schedule turned speculation off"
    target.release("greedy")
    drafts = drafter.draft(target, ["sampled"], budget=1)
    assert drafts.draft_token_ids == [hf_greedy(model, target.sequence("sampled").tokens, 1)]
    assert set(drafter.engine.held_blocks()) == {"sampled"}, "the draft sequence of a released request was kept"
    target.admit("prefilling", list(range(3, 23)), OurParams(), reuse=False)
    target.step({"prefilling": 8})
    assert drafter.draft(target, ["prefilling"]).draft_token_ids == [[]], "a prefilling request: no draft"
