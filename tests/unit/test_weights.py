"""Strict checkpoint mapping (DESIGN.md §9): every key named on error, tied embeddings handled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from optimum.neuron.errors import WeightLoadingError
from optimum.neuron.models.base import StaticDecoder
from optimum.neuron.models.registry import build_decoder
from optimum.neuron.weights import bind_weights, constants_of, map_state_dict, read_checkpoint
from tests.fixtures.llm.models import tiny_model

MISSING_KEY = "model.layers.1.mlp.up_proj.weight"


def decoder_and_state(family: str) -> tuple[StaticDecoder, dict[str, torch.Tensor]]:
    """The meta-device static decoder of a tiny ``family`` model and its checkpoint tensors."""
    folder = tiny_model(family)
    with torch.device("meta"):
        decoder = build_decoder(AutoConfig.from_pretrained(folder), 32, 8)
    return decoder, read_checkpoint(folder)


def test_tied_checkpoint_maps_exactly() -> None:
    decoder, state = decoder_and_state("llama")
    assert decoder.tied and "lm_head.weight" not in dict(decoder.named_parameters())
    mapped = map_state_dict(decoder, state, torch.float32)
    assert set(mapped) == set(dict(decoder.named_parameters()))
    for name, tensor in mapped.items():
        assert torch.equal(tensor, state[name]), name


def test_tied_checkpoint_with_explicit_lm_head_is_accepted() -> None:
    decoder, state = decoder_and_state("llama")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    assert "lm_head.weight" not in map_state_dict(decoder, state, torch.float32)


def test_untied_checkpoint_needs_lm_head() -> None:
    decoder, state = decoder_and_state("qwen2")
    assert not decoder.tied
    assert "lm_head.weight" in map_state_dict(decoder, state, torch.float32)
    del state["lm_head.weight"]
    with pytest.raises(WeightLoadingError, match=r"lm_head\.weight"):
        map_state_dict(decoder, state, torch.float32)


def test_unmapped_key_is_named() -> None:
    decoder, state = decoder_and_state("llama")
    state["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4)
    with pytest.raises(WeightLoadingError, match=r"model\.layers\.0\.self_attn\.extra_proj\.weight"):
        map_state_dict(decoder, state, torch.float32)


def test_missing_key_is_named() -> None:
    decoder, state = decoder_and_state("llama")
    del state[MISSING_KEY]
    with pytest.raises(WeightLoadingError, match=MISSING_KEY.replace(".", r"\.")):
        map_state_dict(decoder, state, torch.float32)


def test_shape_mismatch_is_named_with_both_shapes() -> None:
    decoder, state = decoder_and_state("llama")
    good = tuple(state[MISSING_KEY].shape)
    state[MISSING_KEY] = torch.zeros(good[0] + 1, good[1])
    with pytest.raises(WeightLoadingError, match=MISSING_KEY.replace(".", r"\.")) as info:
        map_state_dict(decoder, state, torch.float32)
    assert str((good[0] + 1, good[1])) in str(info.value) and str(good) in str(info.value)


def test_integer_tensor_refused() -> None:
    decoder, state = decoder_and_state("llama")
    state[MISSING_KEY] = state[MISSING_KEY].to(torch.int8)
    with pytest.raises(WeightLoadingError, match="quantized"):
        map_state_dict(decoder, state, torch.float32)


def test_rotary_inv_freq_ignored_and_cast_to_target_dtype() -> None:
    decoder, state = decoder_and_state("llama")
    state["model.rotary_emb.inv_freq"] = torch.ones(8)
    mapped = map_state_dict(decoder, state, torch.bfloat16)
    assert {t.dtype for t in mapped.values()} == {torch.bfloat16}


def test_bind_weights_is_strict_and_zero_copy() -> None:
    decoder, state = decoder_and_state("llama")
    weights = constants_of(decoder, map_state_dict(decoder, state, torch.float32))
    bind_weights(decoder, weights)
    assert decoder.model.embed_tokens.weight.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    with pytest.raises(WeightLoadingError, match="missing"):
        bind_weights(decoder, {k: v for k, v in weights.items() if k != MISSING_KEY})
    with pytest.raises(WeightLoadingError, match="unexpected"):
        bind_weights(decoder, {**weights, "surplus.weight": torch.zeros(1)})


def test_read_checkpoint_sharded(tmp_path: Path) -> None:
    _, state = decoder_and_state("llama")
    names = sorted(state)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = read_checkpoint(tmp_path)
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[k], state[k]) for k in names)


def test_read_checkpoint_without_weights_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadingError, match="--model"):
        read_checkpoint(tmp_path)
