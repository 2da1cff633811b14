"""Tensor parallelism at the engine: 2 ranks (spawned processes, one gloo group) run a ``-tp2`` artifact with the
same calls. Greedy tokens equal transformers' for prompts of 1, C-1, C, C+1, 2C+1 tokens (chunked; the whole prompt
for context encoding), seeded sampling draws our rule's tokens from transformers' distributions, every rank
returns the same tokens, each rank's KV cache holds its own heads, and the bitwise padded-chunk rule (invariant 4)
holds on each rank. Also: the rank layout itself, and the typed errors."""

from __future__ import annotations

import os
from pathlib import Path

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
    heads = model.engine.kv_cache[0].shape[1]
    if EXPORT_FIXTURES[name].chunked:
        kv_inspection.check_padded_chunk_writes_on(model.engine)
    return {"greedy": greedy, "seeded": seeded, "kv_heads": heads}


ENGINE_FIXTURES = ("llama-2x4x8-kv1-tp2-eager", "qwen3-2x4x8-tp2-eager")
"""KV heads replicated (llama, one KV head) and split (qwen3, with q/k norm). The context-encoding and inductor `-tp2`
fixtures run through vLLM (`tests/vllm/test_vllm_parallel.py`); here too with ``OPTIMUM_NEURON_TP_ALL=1`` (CI's time
budget keeps them out of ``make test``: 100 s more)."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [f.name for f in TP_FIXTURES] if os.environ.get("OPTIMUM_NEURON_TP_ALL") == "1" else ENGINE_FIXTURES
)
def test_two_ranks_equal_transformers(name: str, tmp_path: Path) -> None:
    from tests.fixtures.llm.reference import hf_greedy, hf_sampled

    fixture = EXPORT_FIXTURES[name]
    export_fixture(name)  # built once here, not by both ranks
    ranks = run_on_ranks(2, rank_run, name, tmp=tmp_path)
    assert ranks[0] == ranks[1], "the ranks returned different tokens"
    model = fixture.model()
    for length, tokens in ranks[0]["greedy"].items():
        assert tokens == hf_greedy(model, prompt(length), NEW), f"greedy, prompt of {length}"
    for length, tokens in ranks[0]["seeded"].items():
        assert tokens == hf_sampled(model, prompt(length), NEW, SEEDED, 256), f"seeded, prompt of {length}"
    from transformers import AutoConfig

    kv_heads = AutoConfig.from_pretrained(model).num_key_value_heads
    assert ranks[0]["kv_heads"] == max(kv_heads // 2, 1), "each rank's cache holds its own KV heads"


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
    ("overrides", "message"),
    [
        ({"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 3}, "num_attention_heads=3"),
        ({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"intermediate_size": 129}, "intermediate_size=129"),
    ],
)
def test_export_refuses_configs_that_do_not_split(overrides: dict, message: str) -> None:
    from transformers import AutoConfig

    from optimum.neuron.models.registry import build_decoder

    config = AutoConfig.for_model("llama", **{"hidden_size": 64, "intermediate_size": 128, **overrides})
    with pytest.raises(IncompatibleConfigError, match=message) as info, torch.device("meta"):
        build_decoder(config, 32, 8, tp_degree=2)
    assert "--tensor_parallel_size" in str(info.value)


def test_tensor_parallel_artifact_outside_a_process_group_says_how_to_run_it() -> None:
    from optimum.neuron.modeling import NeuronModelForCausalLM

    with pytest.raises(IncompatibleConfigError, match="vllm serve"):
        NeuronModelForCausalLM.from_pretrained(export_fixture("llama-2x4x8-kv1-tp2-eager"))
