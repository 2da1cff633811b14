"""Idefics3 / SmolVLM (``Idefics3ForConditionalGeneration``): a llama language model, a SigLIP vision tower and a
pixel-shuffle connector (`models.vision`).

The processor turns an image into full square tiles (rows x cols of ``max_image_size`` plus a global tile) and
expands its ``<image>`` placeholder into, per tile, a few marker tokens and ``image_seq_len`` ``<image>`` tokens; the
vision encoder gives one row per ``<image>`` token, in prompt order (transformers' ``inputs_merger``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError, UnsupportedModelError
from ..weights import rename_prefixes
from .image_text import ImageTextFamily, ImageTiles
from .vision import PixelShuffleConnector, VisionTower

_LAYOUT = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)


def checkpoint_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' ``Idefics3ForConditionalGeneration`` keys (``model.text_model.*``, ``model.vision_model.*``,
    ``model.connector.*``, ``lm_head.weight``) -> the static model's (``model.*``, ``vision_model.*``, ``connector.*``,
    ``lm_head.weight``). Anything else is left for the strict map to refuse."""
    return rename_prefixes(state, _LAYOUT)


def language_config(hf_config: Any) -> Any:
    """The language model's config, with the embedding tying transformers applies to the whole model."""
    text = copy.deepcopy(hf_config.text_config)
    text.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
    return text


def vision_modules(hf_config: Any, language_hidden: int) -> tuple[nn.Module, nn.Module]:
    """The vision tower and the connector."""
    if hf_config.vision_config.num_channels != 3:
        raise UnsupportedModelError(
            f"vision_config.num_channels={hf_config.vision_config.num_channels}: only RGB (3) tiles are implemented."
        )
    return VisionTower(hf_config.vision_config), PixelShuffleConnector(hf_config, language_hidden)


def rows_per_tile(hf_config: Any, tile: int) -> int:
    """Image rows of one ``tile``-pixel tile: its patches, merged ``scale_factor ** 2`` at a time by pixel shuffle."""
    return (tile // hf_config.vision_config.patch_size) ** 2 // hf_config.scale_factor**2


def image_tiles(hf_config: Any, model_dir: Path) -> ImageTiles:
    """The tile size, most tiles per image and rows per tile the checkpoint's processor makes (read with
    transformers' own image processor); `UnsupportedModelError` when they do not fit the vision config."""
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        images = AutoImageProcessor.from_pretrained(model_dir)
        seq_len = AutoProcessor.from_pretrained(model_dir).image_seq_len
    except (OSError, ValueError) as err:
        raise UnsupportedModelError(
            f"cannot read the Idefics3 processor of {model_dir} ({err}): an image-text export needs the checkpoint's "
            "processor_config.json / preprocessor_config.json and tokenizer files beside config.json."
        ) from err
    tile, longest = images.max_image_size["longest_edge"], images.size["longest_edge"]
    most = images.get_number_of_image_patches(longest, longest)[0] if images.do_image_splitting else 1
    vision = hf_config.vision_config
    rows = rows_per_tile(hf_config, tile)
    if tile % vision.patch_size or tile > vision.image_size or rows != seq_len:
        raise UnsupportedModelError(
            f"the processor's tiles ({tile} px, image_seq_len={seq_len}) do not fit the vision tower (image_size="
            f"{vision.image_size}, patch_size={vision.patch_size}, scale_factor={hf_config.scale_factor}): fix "
            "max_image_size or image_seq_len in the processor config."
        )
    return ImageTiles(size=tile, most_per_image=max(most, 1), rows_per_tile=rows)


def tiles_per_image(prompt: Sequence[int], tokenizer: Any, rows: int) -> list[int]:
    """The tiles of each image of a prompt expanded by the Idefics3 processor: every run of ``rows`` image tokens is
    one tile, and an image ends with its global tile, the run right after ``<global-img>``."""
    image_id, global_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<image>", "<global-img>"))
    positions = [p for p, token in enumerate(prompt) if token == image_id]
    counts, tiles = [], 0
    for first in positions[::rows]:
        tiles += 1
        if first > 0 and prompt[first - 1] == global_id:
            counts.append(tiles)
            tiles = 0
    if tiles or len(positions) % rows:
        raise InputError(
            "the prompt's image tokens do not form whole images (each ends with a <global-img> tile of "
            f"{rows} image tokens): expand the prompt with the model's processor."
        )
    return counts


IDEFICS3 = ImageTextFamily(
    name="idefics3",
    model_types=("idefics3", "smolvlm"),
    language_config=language_config,
    vision=vision_modules,
    checkpoint_layout=checkpoint_layout,
    tiles=image_tiles,
    rows_per_tile=rows_per_tile,
    tiles_per_image=tiles_per_image,
)
