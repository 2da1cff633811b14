"""The vision encoder's patch positions: the bucketing of transformers' Idefics3 vision embeddings (``torch.bucketize``
of a tile's fractional patch coordinates, ``right=True``), computed without ``bucketize`` (which torch-xla 2.9 cannot
lower), on tiles of the tiny model and of SmolVLM-like checkpoints, in every dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from optimum.neuron.models.vision import VisionEmbeddings


def transformers_positions(side: int, patches_h: int, patches_w: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' ``Idefics3VisionEmbeddings`` positions of a tile whose patch mask is all True."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step_h, step_w = 1.0 / torch.tensor([patches_h]), 1.0 / torch.tensor([patches_w])  # its per-tile patch counts
    h = torch.arange(patches_h, dtype=torch.float32)[None, :] * step_h[:, None]
    w = torch.arange(patches_w, dtype=torch.float32)[None, :] * step_w[:, None]
    h, w = torch.clamp(h, max=1.0 - 1e-6).to(dtype), torch.clamp(w, max=1.0 - 1e-6).to(dtype)
    rows = torch.bucketize(h, boundaries, right=True)[0]
    cols = torch.bucketize(w, boundaries, right=True)[0]
    return (rows[:, None] * side + cols[None, :]).flatten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("image_size", "patch_size"), [(64, 16), (384, 14), (512, 16), (364, 14)])
def test_patch_positions_equal_transformers_bucketize(image_size: int, patch_size: int, dtype: torch.dtype) -> None:
    config = SimpleNamespace(image_size=image_size, patch_size=patch_size, num_channels=3, hidden_size=8)
    embeddings = VisionEmbeddings(config)
    side = image_size // patch_size
    for height, width in ((image_size, image_size), (image_size // 2, image_size), (patch_size, 3 * patch_size)):
        ours = embeddings.position_ids(height, width, dtype, torch.device("cpu"))
        expected = transformers_positions(side, height // patch_size, width // patch_size, dtype)
        assert ours.dtype == expected.dtype and torch.equal(ours, expected), (height, width, dtype)
