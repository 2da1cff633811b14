"""Tensor parallelism at the engine: 2 ranks (spawned processes, one gloo group) run a ``-tp2`` artifact with the
same calls. Greedy tokens equal transformers' for prompts of 1, C-1, C, C+1, 2C+1 tokens (chunked; the whole prompt
for context encoding), seeded sampling draws our rule's tokens from transformers' distributions, every rank
returns the same tokens, each rank's KV cache holds its own heads, and the bitwise padded-chunk rule (invariant 4)
holds on each rank. Also: the rank layout itself, and the typed errors."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.runtime.sampling import SamplingParams
from tests.fixtures.llm.models import EXPORT_FIXTURES, TP_FIXTURES, export_fixture
from tests.models.ranks import run_on_ranks

CHUNK = 8
LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1)
NEW = 6
SEEDED = SamplingParams(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=11)


def prompt(length: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def rank_run(name: str) -> dict:
    """On one rank: greedy and seeded tokens of `LENGTHS` (two prompts per generate call, both KV slots), the KV
    cache's head count, and (chunked artifacts) the bitwise padded-chunk check."""
    from optimum.neuron.modeling import NeuronModelForCausalLM
    from tests.contract import kv_inspection

    model = NeuronModelForCausalLM.from_pretrained(export_fixture(name))
    greedy, seeded = {}, {}
    for pair in (LENGTHS[:2], LENGTHS[2:4], LENGTHS[4:]):
        for length in pair:
            ids = torch.tensor([prompt(length)])
            greedy[length] = model.generate(ids, max_new_tokens=NEW, eos_token_id=[])[0, length:].tolist()
        ids = torch.tensor([prompt(pair[0])])
        args = {"do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 11}
        seeded[pair[0]] = model.generate(ids, max_new_tokens=NEW, eos_token_id=[], **args)[0, pair[0] :].tolist()
    result = {"greedy": greedy, "seeded": seeded, "kv_heads": model.engine.kv_cache[0].shape[1]}
    if EXPORT_FIXTURES[name].speculation:
        result["lookup"] = lookup_run(model, EXPORT_FIXTURES[name].model())
    if EXPORT_FIXTURES[name].chunked:  # last: it keeps the slots it fills
        kv_inspection.check_padded_chunk_writes_on(model.engine)
    return result


def lookup_run(model: Any, reference: Path) -> dict[str, Any]:
    """Prompt lookup on a rank (`LOOKUP_PROMPT` repeats itself, so proposals are made): the greedy tokens, and how many
    verification calls ran."""
    from tests.contract.engine_tools import Recorder

    recorder = Recorder(model.engine)
    ids = lookup_prompt(reference)
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, eos_token_id=[], prompt_lookup_num_tokens=3)
    verified = sum(name == "verification" for name, _ in recorder.calls)
    return {"tokens": out[0, len(ids) :].tolist(), "verified": verified}


@functools.cache
def lookup_prompt(reference: Path) -> list[int]:
    """A prompt (6 tokens, twice) after which prompt lookup proposes tokens at some step of the greedy run of the
    transformers model at ``reference`` (the first such seed: each rank finds the same)."""
    from optimum.neuron.runtime.speculation import propose_lookup
    from tests.fixtures.llm.reference import hf_greedy

    for seed in range(200):
        ids = torch.randint(3, 256, (6,), generator=torch.Generator().manual_seed(seed)).tolist() * 2
        out = hf_greedy(reference, ids, NEW)
        if any(propose_lookup(ids + out[:i], 3, set()) for i in range(1, NEW)):
            return ids
    raise AssertionError("no prompt makes prompt lookup propose a token")


def ranks_run(names: list[str]) -> dict[str, dict]:
    """`rank_run` of each fixture in turn, on one rank (one spawn of the ranks for all of them)."""
    return {name: rank_run(name) for name in names}


ENGINE_FIXTURES = (
    *(f.name for f in TP_FIXTURES if f.backend == "eager" and f.chunked),
    "qwen3-2x4x8-tp2-inductor",
    "llama-2x4x8-h6-kv3-tp2-spec3-eager",  # the verification graph on two ranks (prompt lookup)
)
"""Every family, chunked, on eager: KV heads replicated (llama, one KV head), split (the others) and padded (llama
with 6 / 3 heads); and qwen3 on inductor (its AOTInductor graphs with their all-reduces, loaded by each rank; served
through vLLM too). The context-encoding `-tp2` fixture runs through vLLM (`tests/vllm/test_vllm_parallel.py`); here too
with ``OPTIMUM_NEURON_TP_ALL=1`` (CI's time budget keeps them out of ``make test``)."""


def _mismatches(name: str, result: dict) -> list[str]:
    """What of one fixture's rank-0 result differs from transformers (greedy, seeded) and from the layout."""
    from transformers import AutoConfig

    from optimum.neuron.models.layers.parallel import head_layout
    from tests.fixtures.llm.reference import hf_greedy, hf_sampled

    model = EXPORT_FIXTURES[name].model()
    wrong = [
        f"{name}: greedy, prompt of {n}" for n, t in result["greedy"].items() if t != hf_greedy(model, prompt(n), NEW)
    ]
    wrong += [
        f"{name}: seeded, prompt of {n}"
        for n, t in result["seeded"].items()
        if t != hf_sampled(model, prompt(n), NEW, SEEDED, 256)
    ]
    if result["kv_heads"] != head_layout(AutoConfig.from_pretrained(model), 2).rank_kv_heads:
        wrong.append(f"{name}: a rank's cache holds {result['kv_heads']} KV heads")
    if "lookup" in result and result["lookup"]["tokens"] != hf_greedy(model, lookup_prompt(model), NEW):
        wrong.append(f"{name}: greedy with prompt lookup")
    if "lookup" in result and not result["lookup"]["verified"]:
        wrong.append(f"{name}: prompt lookup proposed nothing, the verification graph never ran")
    return wrong


@pytest.mark.slow
def test_two_ranks_equal_transformers(tmp_path: Path) -> None:
    names = [f.name for f in TP_FIXTURES] if os.environ.get("OPTIMUM_NEURON_TP_ALL") == "1" else list(ENGINE_FIXTURES)
    for name in names:
        export_fixture(name)  # built once here, not by both ranks
    ranks = run_on_ranks(2, ranks_run, names, tmp=tmp_path)
    assert ranks[0] == ranks[1], "the ranks returned different tokens"
    wrong = [w for name in names for w in _mismatches(name, ranks[0][name])]
    assert not wrong, wrong


def test_rank_layout_splits_and_replicates() -> None:
    """q/gate/up rows and o/down columns split in blocks; one KV head replicated on both ranks; the rest shared."""
    from transformers import AutoConfig

    from optimum.neuron.models.layers.parallel import rank_config, shard_weights

    config = AutoConfig.for_model("llama", hidden_size=8, num_attention_heads=4, num_key_value_heads=1, head_dim=2)
    config.intermediate_size = 6
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(64.0).reshape(8, 8),
        "model.layers.0.self_attn.k_proj.weight": torch.arange(16.0).reshape(2, 8),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(64.0).reshape(8, 8),
        "model.layers.0.mlp.up_proj.weight": torch.arange(48.0).reshape(6, 8),
        "model.layers.0.mlp.down_proj.weight": torch.arange(48.0).reshape(8, 6),
        "model.norm.weight": torch.ones(8),
    }
    for rank in (0, 1):
        shard = shard_weights(full, config, 2, rank)
        assert torch.equal(
            shard["model.layers.0.self_attn.q_proj.weight"],
            full["model.layers.0.self_attn.q_proj.weight"][4 * rank : 4 * rank + 4],
        )
        assert torch.equal(
            shard["model.layers.0.self_attn.k_proj.weight"], full["model.layers.0.self_attn.k_proj.weight"]
        )
        assert torch.equal(
            shard["model.layers.0.self_attn.o_proj.weight"],
            full["model.layers.0.self_attn.o_proj.weight"][:, 4 * rank : 4 * rank + 4],
        )
        assert torch.equal(
            shard["model.layers.0.mlp.up_proj.weight"],
            full["model.layers.0.mlp.up_proj.weight"][3 * rank : 3 * rank + 3],
        )
        assert torch.equal(
            shard["model.layers.0.mlp.down_proj.weight"],
            full["model.layers.0.mlp.down_proj.weight"][:, 3 * rank : 3 * rank + 3],
        )
        assert shard["model.norm.weight"] is full["model.norm.weight"]
    local = rank_config(config, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim, local.intermediate_size) == (
        2,
        1,
        2,
        3,
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "degree", "padded", "per_rank"),
    [
        (9, 3, 2, (12, 4), (6, 2)),  # SmolLM2: KV heads padded to 4, each group of 3 stays whole
        (9, 3, 3, (9, 3), (3, 1)),  # splits: nothing padded
        (3, 1, 2, (4, 1), (2, 1)),  # one KV head replicated on both ranks, its group padded to 4
        (8, 2, 4, (8, 2), (2, 1)),  # each KV head on two ranks
        (6, 3, 4, (8, 4), (2, 1)),  # 3 KV heads over 4 ranks: padded to 4 rather than replicated
    ],
)
def test_head_layout_pads_heads_that_do_not_split(
    heads: int, kv_heads: int, degree: int, padded: tuple[int, int], per_rank: tuple[int, int]
) -> None:
    from optimum.neuron.models.layers.parallel import HeadLayout

    layout = HeadLayout(heads, kv_heads, 2, degree)
    assert (layout.padded_heads, layout.padded_kv_heads) == padded
    assert (layout.rank_heads, layout.rank_kv_heads) == per_rank
    q = torch.arange(1.0, heads * 2 + 1).reshape(heads * 2, 1)  # one input feature, rows numbered from 1
    rows = layout.pad_q(q, 0).reshape(layout.padded_kv_heads, layout.padded_group, 2)
    for g in range(kv_heads):  # each real group keeps its heads, in order, then zero heads
        group = q.reshape(kv_heads, heads // kv_heads, 2)[g]
        assert torch.equal(rows[g, : heads // kv_heads], group[..., 0] if group.dim() == 3 else group)
        assert not rows[g, heads // kv_heads :].any()
    assert not rows[kv_heads:].any(), "padded KV heads' groups are zero"
    assert layout.pad_q(q.t(), 1).t().equal(layout.pad_q(q, 0)), "o columns padded as q rows"


@pytest.mark.parametrize(("heads", "kv_heads", "degree"), [(6, 3, 2), (6, 2, 4)])
def test_padded_heads_add_nothing(heads: int, kv_heads: int, degree: int) -> None:
    """The ranks of a padded layout compute the model's attention: 6 query / 3 KV heads on 2 ranks (8 / 4 padded:
    a zero KV head and its group) and 6 / 2 on 4 ranks (each group of 3 padded to 4, each KV head on two ranks).
    Each rank's real `Attention` runs on its slice of the weights and of the KV cache; their o outputs summed by
    hand (what the all-reduce does) equal the unsplit layer's output."""
    from transformers import AutoConfig

    from optimum.neuron.models.base import attention_of
    from optimum.neuron.models.layers.attention import DecodeContext
    from optimum.neuron.models.layers.parallel import head_layout, rank_config, shard_weights
    from optimum.neuron.models.registry import family_for

    config = AutoConfig.for_model(
        "llama", hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8
    )
    family, local, layout = family_for(config), rank_config(config, degree), head_layout(config, degree)
    torch.manual_seed(0)
    full = attention_of(family, config, 0)
    for p in full.parameters():
        p.data.normal_()
    x, rope = torch.randn(2, 1, 48), (torch.ones(2, 1, 1, 8), torch.zeros(2, 1, 1, 8))
    table = torch.tensor([[1, 2], [3, 4]])  # blocks of 4 positions: a window of 8, block 0 the scratch block
    context = DecodeContext.build(torch.tensor([[3], [5]]), torch.tensor([[7], [17]]), table, 4)
    cache = [torch.randn(5, kv_heads, 4, 8) for _ in "KV"]  # 5 blocks of 4 positions, the model's KV heads
    expected = full(x, rope, [c.clone() for c in cache], context)
    extra = layout.padded_kv_heads - kv_heads
    padded = [torch.cat([c, torch.randn(5, extra, 4, 8)], dim=1) for c in cache]  # a padded KV head: any values
    weights = {f"self_attn.{name}": tensor for name, tensor in full.state_dict().items()}  # the names it shards by
    total = torch.zeros_like(expected)
    for rank in range(degree):
        part = attention_of(family, local, 0)
        shard = shard_weights(weights, config, degree, rank)
        part.load_state_dict({name.removeprefix("self_attn."): t for name, t in shard.items()}, strict=True)
        rows = layout.kv_rows(rank)
        first, last = rows.start // 8, rows.stop // 8
        total += part(x, rope, [c[:, first:last].clone() for c in padded], context)
    torch.testing.assert_close(total, expected)


@pytest.mark.parametrize(
    ("model_type", "overrides", "message"),
    [
        ("llama", {"intermediate_size": 129}, "intermediate_size=129"),
        ("qwen3_moe", {"moe_intermediate_size": 33, "num_experts": 2}, "moe_intermediate_size=33"),
    ],
)
def test_export_refuses_configs_that_do_not_split(model_type: str, overrides: dict, message: str) -> None:
    from transformers import AutoConfig

    from optimum.neuron.models.registry import build_decoder

    config = AutoConfig.for_model(model_type, **{"hidden_size": 64, "intermediate_size": 128, **overrides})
    with pytest.raises(IncompatibleConfigError, match=message) as info, torch.device("meta"):
        build_decoder(config, 32, 8, tp_degree=2)
    assert "--tensor_parallel_size" in str(info.value)


def test_tensor_parallel_artifact_outside_a_process_group_says_how_to_run_it() -> None:
    from optimum.neuron.modeling import NeuronModelForCausalLM

    with pytest.raises(IncompatibleConfigError, match="vllm serve"):
        NeuronModelForCausalLM.from_pretrained(export_fixture("llama-2x4x8-kv1-tp2-eager"))
