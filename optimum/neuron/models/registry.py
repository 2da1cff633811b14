"""Model registry: transformers ``model_type`` -> static-decoder `Family`."""

from __future__ import annotations

from typing import Any

from ..errors import IncompatibleConfigError, UnsupportedModelError
from .base import StaticDecoder
from .family import Family
from .gemma3 import GEMMA3, GEMMA3_MULTIMODAL
from .idefics3 import IDEFICS3
from .image_text import ImageTextDecoder, ImageTextFamily
from .layers.parallel import check_tensor_parallel, make_row_parallel, rank_config
from .llama import LLAMA
from .mistral import MISTRAL
from .phi3 import PHI3
from .qwen2 import QWEN2
from .qwen3 import QWEN3
from .qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    t: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA3, GEMMA3_MULTIMODAL, PHI3, QWEN3_MOE) for t in f.model_types
}

IMAGE_TEXT_FAMILIES: dict[str, ImageTextFamily] = {t: f for f in (IDEFICS3,) for t in f.model_types}
"""Image-text families: served with images (a vision-encoder graph, image rows spliced into prefill chunks)."""


def supported_model_types() -> list[str]:
    """The ``model_type`` values that can be exported."""
    return sorted([*FAMILIES, *IMAGE_TEXT_FAMILIES])


def image_text_family(hf_config: Any) -> ImageTextFamily | None:
    """The image-text family of ``hf_config``, None for a text-only model."""
    return IMAGE_TEXT_FAMILIES.get(getattr(hf_config, "model_type", None))  # type: ignore[arg-type]


def language_config(hf_config: Any) -> Any:
    """The config of the language decoder of ``hf_config`` (what the KV cache and vocabulary follow): the text config
    of an image-text model, else `served_config`."""
    image_family = image_text_family(hf_config)
    return image_family.language_config(hf_config) if image_family else served_config(hf_config)


def family_for(hf_config: Any) -> Family:
    """The family of a transformers config, or `UnsupportedModelError` naming the supported ones."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())}."
        )
    return FAMILIES[model_type]


def served_config(hf_config: Any) -> Any:
    """The config of the decoder this toolkit builds from ``hf_config``: the config itself, or for a
    multimodal checkpoint served as text its text decoder's config (what an artifact records as its ``config.json``);
    an image-text model's whole config."""
    if image_text_family(hf_config):
        return hf_config
    family = family_for(hf_config)
    return family.text_config(hf_config) if family.text_config else hf_config


def build_decoder(hf_config: Any, sequence_length: int, max_topk: int, tp_degree: int = 1) -> StaticDecoder:
    """An uninitialized static decoder for ``hf_config`` (weights are loaded separately); for ``tp_degree > 1``
    the decoder of one tensor-parallel rank (`layers.parallel`: one rank's heads and intermediate size, o/down
    projections followed by an all-reduce)."""
    image_family = image_text_family(hf_config)
    if image_family is not None:
        if tp_degree > 1:
            raise IncompatibleConfigError(
                "tensor parallelism is not implemented for image-text models: export with --tensor_parallel_size 1."
            )
        language = image_family.language_config(hf_config)
        family = family_for(language)
        family.check(language, sequence_length)
        return ImageTextDecoder(family, image_family, hf_config, max_topk)
    hf_config = served_config(hf_config)
    family = family_for(hf_config)
    family.check(hf_config, sequence_length)
    if tp_degree == 1:
        return StaticDecoder(family, hf_config, max_topk)
    check_tensor_parallel(hf_config, tp_degree)
    decoder = StaticDecoder(family, rank_config(hf_config, tp_degree), max_topk)
    make_row_parallel(decoder)
    return decoder
