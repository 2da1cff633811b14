"""Images of image-text prompts without the model: the checks of `runtime.images`, an image whose pixels vLLM did not
send (its rows are in the cached prefix) accepted only inside the cached prefix, and the prefix-cache keys of the
blocks holding images."""

from __future__ import annotations

import pytest
import torch

from optimum.neuron.errors import InputError
from optimum.neuron.runtime.images import ImageInput, ImageLimits, SequenceImages, check_images
from optimum.neuron.runtime.placement import CallerPlacement
from optimum.neuron.runtime.sampling import SamplingParams, SequenceSampler
from optimum.neuron.runtime.sequence import Sequence

IMAGE = 9
LIMITS = ImageLimits(max_images=2, tile_size=8, rows_per_tile=2, image_token_id=IMAGE)
PROMPT = [1, 2, IMAGE, IMAGE, 3, IMAGE, IMAGE, IMAGE, IMAGE, 4, 5]  # image 0 at 2-3 (1 tile), image 1 at 5-8 (2)


def images(first: torch.Tensor | None = None, second: torch.Tensor | None = None) -> list[ImageInput]:
    tile = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    return [
        ImageInput(tile if first is None else first, (2, 3)),
        ImageInput(torch.cat((tile, tile)) if second is None else second, (5, 6, 7, 8)),
    ]


def test_an_image_without_pixels_passes_the_position_checks_only() -> None:
    unsent = [ImageInput(None, (2, 3)), images()[1]]
    check_images(PROMPT, unsent, LIMITS)  # no tile shape to check: its rows are cached
    with pytest.raises(InputError, match="placeholder positions must increase"):
        check_images(PROMPT, [ImageInput(None, (2, 4)), images()[1]], LIMITS)
    with pytest.raises(InputError, match="shape"):
        check_images(PROMPT, images(first=torch.rand(1, 3, 4, 4)), LIMITS)


def test_an_image_without_pixels_is_taken_only_inside_the_cached_prefix() -> None:
    placement = CallerPlacement(num_blocks=9, block_size=4)

    def sequence(pictures: list[ImageInput]) -> Sequence:
        seq = Sequence("s", None, PROMPT, len(PROMPT), 32, SequenceSampler(SamplingParams()))
        seq.images = SequenceImages(pictures)
        return seq

    inside = sequence([ImageInput(None, (2, 3)), images()[1]])
    placement.admit(inside, [3, 5, 7], computed=4)  # image 0 lies in positions 0..3, all computed
    assert inside.computed == 4
    with pytest.raises(InputError, match="image without pixels at or past position 4"):
        placement.admit(sequence([images()[0], ImageInput(None, (5, 6, 7, 8))]), [3, 5, 7], computed=4)
    with pytest.raises(InputError, match="came without pixels"):
        SequenceImages([ImageInput(None, (2, 3))]).chunk_rows(0, 4, lambda pixels: pixels)


def test_block_keys_name_the_images_a_block_holds() -> None:
    first, other = SequenceImages(images()), SequenceImages(images(first=torch.zeros(1, 3, 8, 8)))
    assert first.keys(0, 2) is None, "a block before every image has no image key"
    assert first.keys(0, 4) == ((first.images[0].digest, 2),)
    assert first.keys(4, 8) == ((first.images[1].digest, 5),)
    assert first.keys(0, 4) != other.keys(0, 4), "another image's pixels must change the key"
    assert first.keys(4, 8) == other.keys(4, 8), "the same second image: the same key"
