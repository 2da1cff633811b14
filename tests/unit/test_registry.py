"""Model registry: supported families, and a clear error for the others."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from optimum.neuron.errors import UnsupportedModelError
from optimum.neuron.models.registry import build_decoder, family_for, supported_model_types
from tests.fixtures.llm.models import FAMILIES, TINY_CONFIGS

SUPPORTED = ["gemma3", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe"]


def test_supported_model_types() -> None:
    assert supported_model_types() == sorted(supported_model_types())
    assert set(SUPPORTED) <= set(supported_model_types())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tiny_fixture_family_is_registered(family: str) -> None:
    model_type = TINY_CONFIGS[family]["model_type"]
    assert model_type in family_for(SimpleNamespace(model_type=model_type)).model_types


@pytest.mark.parametrize("model_type", ["gpt2", "my_new_arch", "", None])
def test_unsupported_model_type_lists_supported_families(model_type: str | None) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        family_for(SimpleNamespace(model_type=model_type))
    message = str(info.value)
    assert repr(model_type) in message
    for name in SUPPORTED:
        assert name in message


def test_config_without_model_type_is_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match="llama"):
        family_for(object())


def test_build_decoder_refuses_transformers_architecture_we_lack() -> None:
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        build_decoder(config, 32, 8)
