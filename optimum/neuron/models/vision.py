"""The static vision encoder of image-text artifacts: a SigLIP tower on full tiles and a pixel-shuffle connector
(Idefics3 / SmolVLM), and the graph module that runs them.

Parameter names equal transformers' ``Idefics3VisionTransformer`` and ``Idefics3Connector`` under ``vision_model.``
and ``connector.`` (the checkpoint's ``model.`` prefix is dropped by `idefics3.checkpoint_layout`), so the weight
map is strict as for the decoder. Every tile is a full ``image_size`` square (the Idefics3 processor splits an image
into such tiles plus a global one), so the patch attention mask of transformers is all True: the patch positions
are those of a full tile and no attention mask is needed. The graph's batch of tiles is static; the runtime pads a
short batch with zero tiles whose rows it drops (`runtime.images`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class VisionEmbeddings(nn.Module):
    """Patch embedding (a strided convolution) plus the position embedding of each patch of a full tile."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.num_patches_per_side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(self.num_patches_per_side**2, config.hidden_size)

    def position_ids(self, height: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """transformers' bucketed patch positions of a full ``height x width`` tile (its fractional coordinates,
        computed as it does in ``dtype``), ``[patches]``; a static function of the tile shape."""
        side = self.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)

        def buckets(count: int) -> torch.Tensor:
            fractions = torch.arange(count, device=device, dtype=torch.float32) * (1.0 / count)
            fractions = torch.clamp(fractions, max=1.0 - 1e-6).to(dtype)
            # torch.bucketize(fractions, boundaries, right=True), the boundaries being sorted: how many are <= each
            # fraction. Same integers (the same comparisons, same dtype promotion); bucketize has no XLA lowering
            # (torch-xla 2.9 runs it on the CPU), a comparison and a sum do.
            return (boundaries <= fractions[:, None]).sum(-1)

        rows, cols = buckets(height // self.patch_size), buckets(width // self.patch_size)
        return (rows[:, None] * side + cols[None, :]).reshape(-1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        positions = self.position_ids(pixel_values.shape[2], pixel_values.shape[3], pixel_values.dtype, patches.device)
        return patches + self.position_embedding(positions)[None]


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one tile's patches."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tiles, patches, hidden = h.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(tiles, patches, self.heads, hidden // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h)))
        return self.out_proj(out.transpose(1, 2).reshape(tiles, patches, hidden))


class VisionMLP(nn.Module):
    """fc1, activation, fc2."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _activation(config.hidden_act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class VisionLayer(nn.Module):
    """Pre-norm encoder block (LayerNorm, attention, LayerNorm, MLP, each with a residual)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class VisionEncoder(nn.Module):
    """The encoder's layers (transformers' ``encoder.layers``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))


class VisionTower(nn.Module):
    """SigLIP vision transformer of full tiles: ``[T, 3, S, S]`` -> ``[T, patches, vision_hidden]``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class ModalityProjection(nn.Module):
    """The bias-free projection into the language model's hidden size."""

    def __init__(self, hf_config: Any, language_hidden: int) -> None:
        super().__init__()
        width = hf_config.vision_config.hidden_size * hf_config.scale_factor**2
        self.proj = nn.Linear(width, language_hidden, bias=False)


class PixelShuffleConnector(nn.Module):
    """Idefics3's connector: pixel shuffle by ``scale_factor`` (``scale_factor ** 2`` neighbouring patches become
    one row), then the modality projection: ``[T, patches, vision_hidden]`` -> ``[T, rows_per_tile, hidden]``."""

    def __init__(self, hf_config: Any, language_hidden: int) -> None:
        super().__init__()
        self.scale_factor = hf_config.scale_factor
        self.modality_projection = ModalityProjection(hf_config, language_hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tiles, patches, width = h.shape
        side, scale = int(patches**0.5), self.scale_factor
        h = h.view(tiles, side, side // scale, width * scale).permute(0, 2, 1, 3)
        h = h.reshape(tiles, side // scale, side // scale, width * scale**2).permute(0, 2, 1, 3)
        h = h.reshape(tiles, patches // scale**2, width * scale**2)
        return self.modality_projection.proj(h)


class VisionEncoderGraph(nn.Module):
    """The vision-encoder graph: pixels ``[image_tiles, 3, S, S]`` -> image rows ``[image_tiles * rows, hidden]``
    in tile order (the order their placeholder tokens come in the prompt). Shares the decoder's modules."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.vision_model: VisionTower = decoder.vision_model  # type: ignore[assignment]
        self.connector: PixelShuffleConnector = decoder.connector  # type: ignore[assignment]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.connector.modality_projection.proj.weight.dtype
        rows = self.connector(self.vision_model(pixel_values.to(dtype)))
        return rows.reshape(-1, rows.shape[-1])
