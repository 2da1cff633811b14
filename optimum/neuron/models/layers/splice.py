"""The splice rule of image-text prefill graphs: which embedding row each chunk column computes with.

A column whose ``image_mask`` is True takes its row of ``image_embeds`` (an image's row, sliced for this chunk by
`runtime.images`); every other column keeps its token's embedding. A padded column repeats the last real column's
token id, mask value and image row (`runtime.padding`), so its embedding row is the last real one, as invariant 4
requires of a padded column.
"""

from __future__ import annotations

import torch


def splice_image_rows(token_embeds: torch.Tensor, image_embeds: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
    """``[1, T, H]`` token embeddings with the image rows spliced in where ``image_mask [1, T]`` is True."""
    return torch.where(image_mask[..., None], image_embeds.to(token_embeds.dtype), token_embeds)
