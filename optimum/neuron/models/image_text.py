"""Image-text families: a language decoder of a registered family, a vision encoder, and how the checkpoint and its
processor are laid out (`ImageTextFamily`); the decoder that carries both (`ImageTextDecoder`); and the rule fitting
a `NeuronConfig` to the model's tiles (`fit_images`).

An image-text artifact records the whole model's ``config.json`` (vLLM picks its multimodal processor from it); its
prefill graphs splice image rows (`layers.splice`) and it has one more graph, the vision encoder (`vision`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..errors import IncompatibleConfigError
from .base import StaticDecoder
from .family import Family, StateRule

if TYPE_CHECKING:
    from ..config import NeuronConfig


@dataclass(frozen=True)
class ImageTiles:
    """What a checkpoint's processor makes of images."""

    size: int
    """Pixels per side of a tile."""
    most_per_image: int
    """The most tiles one image becomes (the largest split plus the global tile)."""
    rows_per_tile: int
    """Image rows (placeholder tokens) per tile."""


@dataclass(frozen=True)
class ImageTextFamily:
    """A registered image-text model family."""

    name: str
    model_types: tuple[str, ...]
    language_config: Callable[[Any], Any]
    """The config of the language decoder (a model type of a registered text `Family`)."""
    vision: Callable[[Any, int], tuple[nn.Module, nn.Module]]
    """``(hf_config, language hidden size) -> (vision_model, connector)``: the modules of the vision-encoder graph."""
    checkpoint_layout: StateRule
    """Renames the checkpoint's keys to the static model's (applied before the language family's own rules)."""
    tiles: Callable[[Any, Path], ImageTiles]
    """``(hf_config, checkpoint folder) -> ImageTiles``, read from the checkpoint's processor."""
    rows_per_tile: Callable[[Any, int], int]
    """``(hf_config, tile pixels) -> image rows per tile`` the vision encoder makes."""
    tiles_per_image: Callable[[Sequence[int], Any, int], list[int]]
    """``(expanded prompt, tokenizer, rows per tile) -> tiles of each image``, read from the processor's expansion
    (transformers' processors hand the model every tile of a prompt in one tensor)."""


class ImageTextDecoder(StaticDecoder):
    """A static decoder (the language model) that also holds the vision encoder's modules."""

    def __init__(self, family: Family, image_family: ImageTextFamily, hf_config: Any, max_topk: int) -> None:
        language = image_family.language_config(hf_config)
        rules = (image_family.checkpoint_layout, *family.checkpoint_rules)
        super().__init__(dataclasses.replace(family, checkpoint_rules=rules), language, max_topk)
        self.vision_model, self.connector = image_family.vision(hf_config, language.hidden_size)
        self.image_token_id = int(hf_config.image_token_id)


def fit_images(config: NeuronConfig, image_family: ImageTextFamily | None, hf_config: Any, model_dir: Path) -> Any:
    """``config`` with its image fields set for the model: unchanged for a text-only model (which must leave them 0),
    else ``image_size`` and the defaults of ``image_tiles`` and ``max_images`` from the processor's tiles."""
    names = ("image_tiles", "image_size", "max_images")
    if image_family is None:
        given = [n for n in names if getattr(config, n)]
        if given:
            raise IncompatibleConfigError(f"{given} apply to image-text models only: drop --{' --'.join(given)}.")
        return config
    tiles = image_family.tiles(hf_config, model_dir)
    if config.image_size not in (0, tiles.size):
        raise IncompatibleConfigError(
            f"image_size={config.image_size} but the model's processor makes {tiles.size}-pixel tiles: drop "
            "--image_size (it is read from the processor)."
        )
    largest = tiles.most_per_image * tiles.rows_per_tile
    return config.derive(
        image_size=tiles.size,
        image_tiles=config.image_tiles or tiles.most_per_image,
        max_images=config.max_images or max(1, config.sequence_length // largest),
    )
