"""Strict checkpoint mapping (DESIGN.md §9): every key named on error, tied embeddings handled."""

from __future__ import annotations

import json
import re
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


# --- family checkpoint layouts: fused (Phi-3), per-expert (Qwen3-MoE), multimodal (Gemma 3) ------------------

EXPERTS = "model.layers.0.mlp.experts"


def test_phi3_fused_projections_map_as_they_are() -> None:
    decoder, state = decoder_and_state("phi3")
    names = set(dict(decoder.named_parameters()))
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    unfused = (".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")
    assert not any(n.endswith(unfused) for n in names), "an unfused copy beside the fused one"
    mapped = map_state_dict(decoder, state, torch.float32)
    assert all(torch.equal(mapped[k], state[k]) for k in mapped)


def test_experts_are_stacked_as_transformers_stacks_them() -> None:
    from tests.fixtures.llm.reference import reference_model

    decoder, state = decoder_and_state("qwen3_moe")
    assert f"{EXPERTS}.0.gate_proj.weight" in state, "the checkpoint stores one tensor per expert"
    mapped = map_state_dict(decoder, state, torch.float32)
    theirs = reference_model(tiny_model("qwen3_moe")).state_dict()
    for name in (f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj", "model.layers.0.mlp.gate.weight"):
        assert torch.equal(mapped[name], theirs[name]), name
    assert "model.layers.1.mlp.gate_proj.weight" in mapped, "mlp_only_layers keeps layer 1 dense"


def test_missing_expert_tensor_is_named() -> None:
    decoder, state = decoder_and_state("qwen3_moe")
    del state[f"{EXPERTS}.2.up_proj.weight"]
    with pytest.raises(WeightLoadingError, match=re.escape(f"{EXPERTS}.2.up_proj.weight")):
        map_state_dict(decoder, state, torch.float32)


def test_extra_expert_is_a_shape_error_naming_the_stacked_key() -> None:
    decoder, state = decoder_and_state("qwen3_moe")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        state[f"{EXPERTS}.4.{proj}.weight"] = state[f"{EXPERTS}.0.{proj}.weight"].clone()
    with pytest.raises(WeightLoadingError, match=re.escape(f"{EXPERTS}.gate_up_proj")):
        map_state_dict(decoder, state, torch.float32)


def test_multimodal_gemma3_keys_map_to_the_text_decoder() -> None:
    decoder, state = decoder_and_state("gemma3")
    multimodal = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    multimodal["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(4)
    multimodal["model.multi_modal_projector.mm_input_projection_weight"] = torch.ones(4, 4)
    mapped = map_state_dict(decoder, multimodal, torch.float32)
    assert set(mapped) == set(dict(decoder.named_parameters()))
    assert all(torch.equal(mapped[k], state[k]) for k in mapped)
    older = {k.replace("model.", "language_model.model.", 1): v for k, v in state.items()}
    assert set(map_state_dict(decoder, older, torch.float32)) == set(mapped)
