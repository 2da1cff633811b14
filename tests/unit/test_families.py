"""Per-layer structure of the families against transformers' own modules (no compile): which layers slide
and with what window, which layers are sparse MoE, and the config fields each family refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from optimum.neuron.errors import UnsupportedModelError
from optimum.neuron.models.base import StaticDecoder
from optimum.neuron.models.family import Family, layer_windows, transformers_rotary
from optimum.neuron.models.layers.moe import SparseMoeBlock
from optimum.neuron.models.registry import build_decoder, family_for

SMALL = {
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

VARIANTS: dict[str, dict[str, Any]] = {
    "qwen2-max-window-layers": {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 6,
        "max_window_layers": 2,
    },
    "qwen2-window-off": {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 6},
    "qwen3-sliding": {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    "qwen3_moe-sliding": {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 7, "head_dim": 8},
    "gemma3-pattern": {"model_type": "gemma3_text", "head_dim": 8, "sliding_window": 9, "sliding_window_pattern": 2},
    "mistral-window": {"model_type": "mistral", "sliding_window": 4},
    "mistral-none": {"model_type": "mistral", "sliding_window": None},
    "phi3-window": {"model_type": "phi3", "sliding_window": 11},
}


def configs(name: str, layers: int = 4, **extra: Any) -> Any:
    fields = {**SMALL, "num_hidden_layers": layers, **VARIANTS[name], **extra}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def ours(hf_config: Any) -> StaticDecoder:
    with torch.device("meta"):
        return build_decoder(hf_config, 64, 8)


def theirs(hf_config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def their_window(model: torch.nn.Module, hf_config: Any, index: int) -> int | None:
    """The window transformers applies to layer ``index``: the layer's own ``sliding_window`` where it keeps
    one per layer, else the model-wide mask choice (mistral, Phi-3: sliding everywhere when set)."""
    attention = model.model.layers[index].self_attn
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return hf_config.sliding_window


@pytest.mark.parametrize("name", list(VARIANTS))
def test_layer_windows_are_transformers(name: str) -> None:
    hf_config = configs(name)
    model, decoder = theirs(hf_config), ours(hf_config)
    expected = [their_window(model, hf_config, i) for i in range(hf_config.num_hidden_layers)]
    assert layer_windows(family_for(hf_config), hf_config) == expected
    assert [layer.self_attn.options.window for layer in decoder.model.layers] == expected
    assert decoder.windows == sorted({w for w in expected if w is not None})


@pytest.mark.parametrize(("step", "only_dense"), [(1, []), (2, []), (1, [0, 3]), (3, [2])])
def test_sparse_layers_are_transformers(step: int, only_dense: list[int]) -> None:
    hf_config = configs(
        "qwen3_moe-sliding",
        layers=6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        decoder_sparse_step=step,
        mlp_only_layers=only_dense,
    )
    model, decoder = theirs(hf_config), ours(hf_config)
    expected = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in decoder.model.layers] == expected
    assert any(expected)


REFUSED = [
    ("gemma3-pattern", {"attn_logit_softcapping": 50.0}, 64, "attn_logit_softcapping"),
    ("gemma3-pattern", {"use_bidirectional_attention": True}, 64, "use_bidirectional_attention"),
    (
        "phi3-window",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
            },
            "original_max_position_embeddings": 32,  # Phi-3 keeps it at the top level
            "max_position_embeddings": 128,
        },
        64,
        "rope_parameters.rope_type",
    ),
    (
        "mistral-window",
        {
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            "max_position_embeddings": 48,
        },
        64,
        "rope_parameters.rope_type",
    ),
]


@pytest.mark.parametrize(("name", "fields", "sequence_length", "field"), REFUSED)
def test_unimplemented_config_field_is_named(
    name: str, fields: dict[str, Any], sequence_length: int, field: str
) -> None:
    hf_config = configs(name, **fields)
    with pytest.raises(UnsupportedModelError, match=field.replace(".", r"\.")), torch.device("meta"):
        build_decoder(hf_config, sequence_length, 8)


def test_longrope_within_its_original_length_is_accepted() -> None:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_config = configs("phi3-window", **REFUSED[2][1])
    with torch.device("meta"):
        decoder = build_decoder(hf_config, 32, 8)  # refused above at 64 > original_max_position_embeddings
    hf_rotary = Phi3RotaryEmbedding(hf_config)  # what transformers uses up to that length: the short factors
    assert torch.equal(decoder.model.rotary_emb.inv_freq, hf_rotary.original_inv_freq)
    assert decoder.model.rotary_emb.scaling == hf_rotary.attention_scaling > 1.0


def test_sliding_layers_without_a_window_are_refused() -> None:
    hf_config = configs("qwen2-window-off")
    hf_config.layer_types = ["sliding_attention"] * hf_config.num_hidden_layers
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        ours(hf_config)


FAMILY_CONFIGS = {
    "llama": {"model_type": "llama"},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 8},
    "mistral": {"model_type": "mistral"},
    "gemma3": {"model_type": "gemma3_text", "head_dim": 8},
    "phi3": {"model_type": "phi3"},
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 8},
}


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_default_rotary_and_biases_are_transformers(name: str) -> None:
    """The defaults every family relies on build transformers' own rotary class and its attention biases."""
    fields = {**SMALL, "num_hidden_layers": 2, **FAMILY_CONFIGS[name]}
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    family = family_for(hf_config)
    model = theirs(hf_config)
    assert type(family.rotary(hf_config)) is type(model.model.rotary_emb)
    attention = model.model.layers[0].self_attn
    q_proj = attention.qkv_proj if family.fused_qkv else attention.q_proj
    assert family.qkv_bias(hf_config) == (q_proj.bias is not None)
    assert family.o_bias(hf_config) == (attention.o_proj.bias is not None)


def test_a_family_states_only_what_differs() -> None:
    """A `Family` given only its name gets the common case: transformers' rotary module found by name, the
    config's ``attention_bias``, the rope check, the config's own layer types."""
    family = Family(name="new", model_types=("new",))
    hf_config = configs("qwen3-sliding", attention_bias=True)
    assert type(family.rotary(hf_config)).__name__ == "Qwen3RotaryEmbedding"
    assert family.qkv_bias(hf_config) and family.o_bias(hf_config)
    assert family.layer_types(hf_config) == list(hf_config.layer_types)
    hf_config.rope_parameters = {"rope_type": "unknown-kind"}
    with pytest.raises(UnsupportedModelError, match="rope_type"):
        family.check(hf_config, 64)


def test_a_model_without_one_rotary_class_is_refused_naming_the_hook() -> None:
    bert_like = type("BertLikeConfig", (), {"__module__": "transformers.models.bert.configuration_bert"})
    with pytest.raises(UnsupportedModelError, match=r"Family\.rotary"):  # modeling_bert defines no rotary module
        transformers_rotary(bert_like())
