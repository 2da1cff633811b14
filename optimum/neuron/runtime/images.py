"""Images of image-text artifacts: which prompt positions take which image rows, and the per-image cache.

An image of a prompt is its tiles (``pixels [t, 3, S, S]``) and the prompt positions its ``t * rows_per_tile`` rows
go to, in order (`ImageInput`). `placeholder_positions` is the rule that finds them in an expanded prompt:
transformers' ``inputs_merger`` fills the image-token positions, in prompt order, with the images' rows in order.

`SequenceImages` holds one sequence's images and the cache of their rows. A prefill chunk covering positions
``[start, start + n)`` asks `SequenceImages.chunk_rows` for its image rows: every image with a position in the chunk
is encoded if its rows are not cached yet (so an image is encoded when the first chunk intersecting its positions is
prefilled, once), its rows at the chunk's positions are copied out, and its cached rows are dropped once the chunk
holds its last position. An image's span may straddle chunks; several images may share a chunk. Pixels are kept
for the sequence's life (a preempted sequence is recomputed from position 0 and encodes its images again); the
cached rows go with the sequence when it is released or preempted.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import InputError

Encode = Callable[[torch.Tensor], torch.Tensor]
"""Pixels of one image ``[t, 3, S, S]`` -> its rows ``[t * rows_per_tile, H]`` (the vision-encoder graph)."""


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt."""

    pixels: torch.Tensor | None
    """Its tiles, ``[t, 3, S, S]``, in the order of their placeholders; None when its rows are already in the
    sequence's KV blocks (a prefix-cache hit covers every one of its positions: vLLM then sends no pixels)."""
    positions: tuple[int, ...]
    """The prompt positions its rows go to, increasing: ``t * rows_per_tile`` of them."""

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of its pixels (dtype, shape and bytes): what tells two images apart in a prefix-cache key."""
        if self.pixels is None:
            raise InputError("an image without pixels has no digest: pass its pixels to place it in the prefix cache.")
        pixels = self.pixels.detach().cpu().contiguous()
        header = f"{pixels.dtype}{tuple(pixels.shape)}".encode()
        return hashlib.sha256(header + pixels.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class ImageLimits:
    """What an artifact accepts as images."""

    max_images: int
    tile_size: int
    rows_per_tile: int
    image_token_id: int


def placeholder_positions(
    prompt: Sequence[int], image_token_id: int, row_counts: Sequence[int]
) -> list[tuple[int, ...]]:
    """The positions each image's rows go to: image ``i`` takes the next ``row_counts[i]`` positions of ``prompt``
    holding ``image_token_id``, in prompt order. `InputError` unless the counts use exactly those positions."""
    found = [p for p, token in enumerate(prompt) if token == image_token_id]
    if len(found) != sum(row_counts):
        raise InputError(
            f"the prompt holds {len(found)} image tokens but its images have {sum(row_counts)} rows: expand the "
            "prompt with the model's processor, with exactly the images it was expanded for."
        )
    bounds = [0, *torch.tensor(list(row_counts), dtype=torch.long).cumsum(0).tolist()]
    return [tuple(found[a:b]) for a, b in itertools.pairwise(bounds)]


def check_images(prompt: Sequence[int], images: Sequence[ImageInput], limits: ImageLimits) -> None:
    """`InputError` unless ``images`` fit the artifact and ``prompt``: at most ``max_images``, full tiles of its tile
    size, one row position per row, increasing, distinct across images, on image tokens; and every image token of
    the prompt taken by some image."""
    if len(images) > limits.max_images:
        raise InputError(
            f"the prompt has {len(images)} images but this artifact serves at most max_images={limits.max_images} per "
            f"prompt: send fewer images, or re-export with --max_images {len(images)}."
        )
    taken = list[int]()
    for i, image in enumerate(images):
        if image.pixels is not None:  # an image without pixels: its rows are cached (`ImageInput.pixels`)
            _check_tiles(i, image, limits)
        taken.extend(image.positions)
    off_token = any(not 0 <= p < len(prompt) or prompt[p] != limits.image_token_id for p in taken)
    if taken != sorted(set(taken)) or off_token:
        raise InputError(
            "image placeholder positions must increase, not overlap, and hold the image token "
            f"{limits.image_token_id} of the prompt: expand the prompt with the model's processor."
        )
    if sum(token == limits.image_token_id for token in prompt) != len(taken):
        raise InputError("the prompt holds image tokens that no image fills: pass every image of the prompt.")


def _check_tiles(index: int, image: ImageInput, limits: ImageLimits) -> None:
    """`InputError` unless image ``index`` is whole tiles of the artifact's size, one position per row."""
    assert image.pixels is not None
    shape, size = tuple(image.pixels.shape), limits.tile_size
    if len(shape) != 4 or shape[0] < 1 or shape[1:] != (3, size, size):
        raise InputError(f"image {index} has pixels of shape {shape}; this artifact takes [tiles, 3, {size}, {size}].")
    if len(image.positions) != shape[0] * limits.rows_per_tile:
        raise InputError(
            f"image {index} has {shape[0]} tiles ({shape[0] * limits.rows_per_tile} rows) but "
            f"{len(image.positions)} placeholder positions: expand the prompt with the model's processor."
        )


@dataclass
class SequenceImages:
    """One sequence's images and the cache of their encoded rows."""

    images: list[ImageInput]
    cache: dict[int, torch.Tensor] = field(default_factory=dict)
    """Image index -> its rows ``[n, H]``, from its first chunk until the chunk holding its last position."""

    def chunk_rows(self, start: int, count: int, encode: Encode) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """The image rows of the chunk at positions ``[start, start + count)``: the indices of the images encoded for
        it, ``rows [count, H]`` and ``mask [count]`` (True where a column takes an image row); None when the chunk
        holds no image position."""
        hits = []
        for index, image in enumerate(self.images):
            low = bisect.bisect_left(image.positions, start)
            high = bisect.bisect_left(image.positions, start + count)
            if low < high:
                hits.append((index, low, high))
        if not hits:
            return None
        encoded = [index for index, _, _ in hits if index not in self.cache]
        for index in encoded:
            pixels = self.images[index].pixels
            if pixels is None:
                raise InputError(
                    f"image {index} came without pixels (its rows were cached), but the chunk at positions {start}.."
                    f"{start + count - 1} needs them: send the image's pixels."
                )
            self.cache[index] = encode(pixels)
        first = self.cache[hits[0][0]]
        rows = first.new_zeros(count, first.shape[-1])
        mask = torch.zeros(count, dtype=torch.bool)
        for index, low, high in hits:
            image = self.images[index]
            columns = torch.tensor(image.positions[low:high]) - start
            rows[columns], mask[columns] = self.cache[index][low:high], True
            if high == len(image.positions):  # the chunk holds its last position: consumed
                del self.cache[index]
        return encoded, rows, mask

    def keys(self, start: int, end: int) -> tuple[tuple[str, int], ...] | None:
        """The prefix-cache keys of the images with a position in ``[start, end)``: each image's digest and first
        position (None when there is none), so that blocks holding other images never share a hash."""
        found = tuple(
            (image.digest, image.positions[0])
            for image in self.images
            if bisect.bisect_left(image.positions, start) < bisect.bisect_left(image.positions, end)
        )
        return found or None

    def unsent_before(self, computed: int) -> bool:
        """True when every image without pixels lies before position ``computed`` (its rows are in the cache)."""
        return all(image.positions[-1] < computed for image in self.images if image.pixels is None)

    def drop(self) -> None:
        """Forget every cached row (the sequence ends, or is preempted and will be recomputed)."""
        self.cache.clear()


def real_tiles(pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
    """One prompt's tiles ``[N, 3, S, S]`` from a processor's padded batch row: tiles that are all zero are padding
    (transformers' rule), dropped; `InputError` when a kept tile is not whole (``pixel_mask`` not all set), which the
    static vision encoder does not compute."""
    real = (pixels != 0).flatten(1).any(1)
    if pixel_mask is not None and not bool(pixel_mask[real].flatten(1).all()):
        raise InputError(
            "an image tile is only partly covered by the image (pixel_attention_mask): the vision encoder takes whole "
            "tiles; keep the processor's do_image_splitting on or its square resize."
        )
    return pixels[real]
