"""`NeuronConfig`: validation with typed errors that name the fix, frozen, JSON with versions and hash."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from optimum.exporters.neuron.__main__ import add_export_arguments, config_from_args
from optimum.neuron.config import NeuronConfig, load_config_file, runtime_versions
from optimum.neuron.errors import ArtifactError, IncompatibleConfigError, InputError
from optimum.neuron.graphs import GraphKind, graph_fields, graph_specs
from optimum.neuron.runtime.sampling import SamplingParams

GRAPHS = ["chunked_prefill", "token_generation"]

INVALID = [
    ({"sequence_length": 32, "prefill_chunk_size": 33}, "--prefill_chunk_size"),
    ({"prefill_chunk_size": -1}, "--prefill_chunk_size"),
    ({"prefill_chunk_size": 2.5}, "--prefill_chunk_size"),
    ({"prefill_chunk_size": True}, "--prefill_chunk_size"),
    ({"tp_degree": 0}, "--tensor_parallel_size N"),
    ({"tp_degree": 1.5}, "--tensor_parallel_size N"),
    ({"tp_degree": 2, "backend": "xla"}, "--tensor_parallel_size 1"),
    ({"tp_degree": 2, "backend": "xla"}, "cannot run it across ranks on XLA:CPU"),
    ({"batch_size": 0}, "--batch_size"),
    ({"batch_size": -3}, "--batch_size"),
    ({"batch_size": True}, "--batch_size"),
    ({"sequence_length": 0}, "--sequence_length"),
    ({"sequence_length": "32"}, "--sequence_length"),
    ({"max_topk": 0}, "--max_topk"),
    ({"max_topk": -5}, "--max_topk"),
    ({"auto_cast_type": "fp64"}, "--auto_cast_type"),
    ({"auto_cast_type": "float32"}, "--auto_cast_type"),
    ({"backend": "tpu"}, "--backend inductor"),
    ({"device": "tpu"}, "--device cpu"),
    ({"backend": "neuron", "device": "cpu"}, "--device neuron"),
    ({"backend": "inductor", "device": "neuron"}, "--backend neuron"),
    ({"backend": "xla", "device": "cuda"}, "--backend inductor --device cuda"),
    ({"on_device_sampling": "yes"}, "on_device_sampling must be a bool"),
    ({"linear_kernel": "mkl"}, "--linear_kernel auto"),
    ({"linear_kernel": "packed", "auto_cast_type": "bf16"}, "--linear_kernel auto"),
    ({"linear_kernel": "packed", "backend": "xla"}, "--linear_kernel auto"),
    ({"linear_kernel": "packed", "device": "cuda"}, "--linear_kernel auto"),
    ({"attention_kernel": "flash"}, "--attention_kernel"),
    ({"attention_kernel": "paged", "auto_cast_type": "bf16"}, "--attention_kernel auto"),
    ({"attention_kernel": "paged", "backend": "xla"}, "--attention_kernel auto"),
    ({"sequence_length": 32, "kv_block_size": 3}, "--kv_block_size with a divisor of them, e.g. 2"),
    ({"sequence_length": 64, "kv_buckets": "16", "kv_block_size": 32}, "every KV window [16, 64]"),
    ({"kv_block_size": -4}, "--kv_block_size N"),
    ({"kv_block_size": 1.5}, "--kv_block_size N"),
    ({"sequence_length": 32, "kv_cache_tokens": 16}, "--kv_cache_tokens 32"),
    ({"sequence_length": 32, "kv_block_size": 8, "kv_cache_tokens": 36}, "--kv_cache_tokens 40"),
    ({"kv_cache_tokens": True}, "--kv_cache_tokens N"),
    ({"max_loras": 2}, "--max_lora_rank 16"),
    ({"max_lora_rank": 8}, "--max_loras 4"),
    ({"max_loras": -1, "max_lora_rank": 8}, "--max_loras N"),
    ({"max_loras": 2, "max_lora_rank": 8, "lora_target_modules": "q_proj,lm_head"}, "--lora_target_modules all"),
    ({"mixed_batch": 1}, "mixed_batch must be a bool"),
    ({"mixed_batch": True}, "--mixed_batch is not available here: it joins decode rows with a prefill chunk"),
    ({"mixed_batch": True, "prefill_chunk_size": 8, "backend": "xla"}, "export with --backend inductor or eager"),
    ({"mixed_batch": True, "prefill_chunk_size": 8, "max_loras": 2, "max_lora_rank": 8}, "adapter slots"),
    ({"mixed_batch": True, "prefill_chunk_size": 8, "image_tiles": 5, "image_size": 64}, "splice image rows"),
    ({"mixed_batch": True, "prefill_chunk_size": 8, "tp_degree": 2}, "--tensor_parallel_size 1"),
]


def chunked(**changes: object) -> NeuronConfig:
    """A valid chunked-prefill config (batch 2, S 32, C 8) with ``changes`` applied."""
    fields = {"batch_size": 2, "sequence_length": 32, "prefill_chunk_size": 8, "backend": "eager", **changes}
    return NeuronConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "fix"), INVALID, ids=[repr(c) for c, _ in INVALID])
def test_invalid_field_raises_typed_error_naming_the_fix(changes: dict, fix: str) -> None:
    with pytest.raises(IncompatibleConfigError) as info:
        NeuronConfig(**changes)
    assert fix in str(info.value)


@pytest.mark.parametrize(
    ("changes", "packs"),
    [
        ({}, True),
        ({"backend": "inductor"}, True),
        ({"linear_kernel": "aten"}, False),
        ({"auto_cast_type": "bf16"}, False),
        ({"backend": "xla"}, False),
        ({"device": "cuda", "backend": "inductor"}, False),
    ],
)
def test_linear_kernel_auto_packs_fp32_cpu_graphs(changes: dict, packs: bool) -> None:
    assert chunked(**changes).packed_linears is packs


@pytest.mark.parametrize(
    ("changes", "block", "blocks"),
    [
        ({"sequence_length": 1024, "batch_size": 4}, 32, 4 * 1024 // 32 + 1),  # windows 256, 512, 1024
        ({"sequence_length": 32, "kv_buckets": "16"}, 16, 2 * 32 // 16 + 1),
        ({"sequence_length": 24, "kv_buckets": "none"}, 8, 2 * 24 // 8 + 1),
        ({"sequence_length": 1024, "kv_block_size": 64, "kv_cache_tokens": 2048}, 64, 2048 // 64 + 1),
    ],
)
def test_paged_cache_block_size_and_blocks(changes: dict, block: int, blocks: int) -> None:
    """``kv_block_size=0`` picks the largest of 32, 16, ... dividing the sequence length and every window; the cache
    holds the pool (``batch_size x sequence_length`` by default) and the scratch block."""
    config = chunked(prefill_chunk_size=8, **changes)
    assert (config.block_size, config.kv_blocks) == (block, blocks)
    recorded = json.loads(config.to_json([]))["kv_cache"]
    assert recorded == {"block_size": block, "blocks": blocks, "tokens": (blocks - 1) * block}


def test_typed_error_is_also_a_value_error() -> None:
    with pytest.raises(ValueError):
        NeuronConfig(batch_size=0)


@pytest.mark.parametrize("chunk", [0, 1, 8, 32])
def test_chunk_bounds_are_inclusive(chunk: int) -> None:
    assert chunked(prefill_chunk_size=chunk).prefill_chunk_size == chunk


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_torch_dtype(name: str, dtype: torch.dtype) -> None:
    assert chunked(auto_cast_type=name).torch_dtype is dtype


def test_frozen() -> None:
    config = chunked()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 4  # type: ignore[misc]


def test_derive_validates_and_leaves_original() -> None:
    config = chunked()
    assert config.derive(prefill_chunk_size=16).prefill_chunk_size == 16
    assert config.prefill_chunk_size == 8
    with pytest.raises(IncompatibleConfigError, match="--prefill_chunk_size"):
        config.derive(prefill_chunk_size=64)


def test_json_round_trip_with_versions_graphs_and_hash() -> None:
    config = chunked(auto_cast_type="bf16", max_topk=16, on_device_sampling=False)
    text = config.to_json(GRAPHS)
    body = json.loads(text)
    assert body["versions"] == runtime_versions()
    assert body["graphs"] == GRAPHS
    assert isinstance(body["hash"], str) and len(body["hash"]) == 16
    loaded = load_config_file(text)
    assert loaded == config
    assert loaded.compile_fields() == config.compile_fields()
    assert loaded.extra == {"graphs": GRAPHS, "versions": runtime_versions()}


def test_hash_depends_on_fields() -> None:
    first = json.loads(chunked().to_json(GRAPHS))["hash"]
    assert json.loads(chunked(batch_size=3).to_json(GRAPHS))["hash"] != first
    assert json.loads(chunked().to_json(GRAPHS))["hash"] == first


def tampered(**edits: object) -> str:
    """The JSON of a valid config with ``edits`` applied to its body (hash left as it was)."""
    body = json.loads(chunked().to_json(GRAPHS))
    body.update(edits)
    return json.dumps(body)


@pytest.mark.parametrize("edits", [{"batch_size": 4}, {"prefill_chunk_size": 16}, {"hash": "0" * 16}])
def test_tampered_fields_rejected(edits: dict) -> None:
    with pytest.raises(ArtifactError, match="hash mismatch"):
        load_config_file(tampered(**edits))


def test_other_versions_rejected_with_reexport_fix() -> None:
    other = {**runtime_versions(), "optimum-neuronx": "0.0.0-other"}
    with pytest.raises(ArtifactError, match="re-export") as info:
        load_config_file(tampered(versions=other))
    assert "0.0.0-other" in str(info.value)


def test_xla_config_records_torch_xla_and_refuses_another() -> None:
    body = json.loads(chunked(backend="xla").to_json(GRAPHS))
    assert body["versions"] == runtime_versions("xla") and "torch-xla" in body["versions"]
    assert "torch-xla" not in runtime_versions("eager")
    other = {**runtime_versions("xla"), "torch-xla": "2.8.0"}
    with pytest.raises(ArtifactError, match="re-export") as info:
        load_config_file(json.dumps({**body, "versions": other}))
    assert "2.8.0" in str(info.value) and ".venv-xla" in str(info.value)


def test_other_torch_version_rejected() -> None:
    with pytest.raises(ArtifactError, match="re-export"):
        load_config_file(tampered(versions={**runtime_versions(), "torch": "1.0.0"}))


def test_missing_versions_rejected() -> None:
    body = json.loads(chunked().to_json(GRAPHS))
    del body["versions"]
    with pytest.raises(ArtifactError, match="re-export"):
        load_config_file(json.dumps(body))


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '"a string"', "null"])
def test_malformed_json_rejected(text: str) -> None:
    with pytest.raises(ArtifactError, match="re-export"):
        load_config_file(text)


def test_cache_key_depends_on_compile_fields_and_model_only() -> None:
    config = chunked()
    key = config.cache_key("model-a")
    assert key == chunked().cache_key("model-a")
    assert key != config.cache_key("model-b")
    assert key != chunked(batch_size=3).cache_key("model-a")
    assert key == dataclasses.replace(config, extra={"note": "ignored"}).cache_key("model-a")


def test_other_version_with_other_fields_reported_as_version_mismatch() -> None:
    body = json.loads(chunked().to_json(GRAPHS))
    body.update(new_field=1, versions={**runtime_versions(), "optimum-neuronx": "9.9.9"})
    with pytest.raises(ArtifactError, match="exported with") as info:
        load_config_file(json.dumps(body))
    assert "hash" not in str(info.value)


def exported_config(*flags: str) -> NeuronConfig:
    """The config an ``optimum-cli export neuron`` of a chunked model (S 32, C 8) with ``flags`` builds, parsed by
    the export CLI's own argument parser."""
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    return config_from_args(
        parser.parse_args(["--model", "m", "--sequence_length", "32", "--prefill_chunk_size", "8", *flags, "out"])
    )


@pytest.mark.parametrize(
    ("flags", "graphs"),
    [
        ((), ["chunked_prefill", "token_generation", "token_generation_logits"]),
        (("--no_decode_logits",), ["chunked_prefill", "token_generation"]),
        (("--no_on_device_sampling",), ["chunked_prefill", "token_generation_logits"]),  # valid alone
    ],
)
def test_the_default_export_compiles_the_logits_graph_and_no_decode_logits_leaves_it_out(
    flags: tuple[str, ...], graphs: list[str]
) -> None:
    config = exported_config(*flags)
    assert [spec.name for spec in graph_specs(config)] == graphs
    asks_logits = SamplingParams(logprobs=5, return_logits=True)
    if "token_generation_logits" in graphs:
        asks_logits.check_graphs(config)
    else:
        with pytest.raises(InputError, match=r"exported with --no_decode_logits .*: re-export without --no_decode"):
            asks_logits.check_graphs(config)


def test_mixed_batch_adds_the_mixed_graph_and_changes_no_other() -> None:
    """``--mixed_batch`` adds one graph, the token-generation rows beside a chunk; the other graphs keep their specs
    (and so their keys in the per-graph cache: `graphs.SPEC_FIELDS`)."""
    plain, mixed = graph_specs(chunked()), graph_specs(chunked(mixed_batch=True))
    assert [s.name for s in mixed] == [s.name for s in plain] + ["mixed"]
    assert mixed[:-1] == plain
    spec = mixed[-1]
    assert (spec.kind, spec.batch, spec.tokens, spec.chunks) == (GraphKind.MIXED, 2, 8, plain[0].chunks)
    assert graph_fields(chunked()) == graph_fields(chunked(mixed_batch=True))
