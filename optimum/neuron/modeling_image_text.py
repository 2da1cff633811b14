"""`NeuronModelForImageTextToText`: load an image-text artifact and generate from the transformers processor's
output (``input_ids``, ``pixel_values``, ...) like transformers' ``AutoModelForImageTextToText``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .artifact import Artifact
from .errors import ArtifactError, InputError
from .modeling import NeuronModelForCausalLM, _real_tokens
from .models.registry import image_text_family
from .runtime.engine import Engine
from .runtime.images import ImageInput, placeholder_positions, real_tiles


class NeuronModelForImageTextToText(NeuronModelForCausalLM):
    """An image-text model (Idefics3 / SmolVLM) running an artifact's graphs: each image is encoded once by the
    vision-encoder graph when the first prefill chunk reaching its placeholders runs, its rows spliced into the chunks
    that hold them."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        family = image_text_family(engine.model_config)
        if engine.image_limits is None or family is None:
            raise ArtifactError(
                f"{engine.artifact.root} is a text-only artifact: load it with NeuronModelForCausalLM, or export an "
                "image-text model."
            )
        from transformers import AutoTokenizer

        self.family = family
        self.tokenizer = AutoTokenizer.from_pretrained(engine.artifact.root)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> NeuronModelForImageTextToText:
        """Load the image-text artifact exported to ``path``."""
        return cls(Engine(Artifact.open(path)))

    def generate(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """`NeuronModelForCausalLM.generate` with the processor's ``pixel_values [B, N, 3, S, S]`` (and
        ``pixel_attention_mask [B, N, S, S]``): row b's tiles, zero tiles being padding."""
        images = None
        if pixel_values is not None:
            images = self.images_of(input_ids, attention_mask, pixel_values, pixel_attention_mask)
        return super().generate(input_ids, attention_mask, images=images, **kwargs)

    def images_of(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor | None,
    ) -> list[list[ImageInput]]:
        """Each row's images: its real tiles, grouped per image as the processor expanded the prompt, and the prompt
        positions (among the real tokens) each image's rows go to."""
        if pixel_values.dim() != 5 or pixel_values.shape[0] != input_ids.shape[0]:
            raise InputError(
                f"pixel_values must be [batch, tiles, 3, H, W] with input_ids' batch, got {tuple(pixel_values.shape)}."
            )
        limits = self.engine.image_limits
        assert limits is not None
        rows: list[list[ImageInput]] = []
        for b, prompt in enumerate(_real_tokens(input_ids, attention_mask)):
            tiles = real_tiles(pixel_values[b], None if pixel_attention_mask is None else pixel_attention_mask[b])
            counts = self.family.tiles_per_image(prompt, self.tokenizer, limits.rows_per_tile)
            if sum(counts) != tiles.shape[0]:
                raise InputError(
                    f"row {b}: the prompt has placeholders for {sum(counts)} tiles but pixel_values holds "
                    f"{tiles.shape[0]}: pass the processor's output for these prompts and images."
                )
            positions = placeholder_positions(prompt, limits.image_token_id, [c * limits.rows_per_tile for c in counts])
            starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
            rows.append([ImageInput(tiles[a:z], pos) for a, z, pos in zip(starts, starts[1:], positions, strict=False)])
        return rows
