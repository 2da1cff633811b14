"""Strict mapping of a transformers checkpoint onto the static decoder (DESIGN.md §9).

Our parameter names equal transformers', so the map is the identity; what this module adds is
strictness: every expected key present, no unknown key, shapes equal, floating dtypes cast to
the target dtype, tied embeddings handled, rotary frequencies taken from the module itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .errors import WeightLoadingError

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_checkpoint(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a transformers checkpoint folder (single or sharded safetensors, or .bin)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(folder / shard))
        return state
    if (folder / "model.safetensors").exists():
        return load_file(folder / "model.safetensors")
    if (folder / "pytorch_model.bin").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise WeightLoadingError(
        f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {folder}: "
        "point --model at a transformers checkpoint folder (save_pretrained output)."
    )


def map_state_dict(module: nn.Module, hf_state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The parameters of ``module`` taken from ``hf_state``, cast to ``dtype``; strict."""
    expected = dict(module.named_parameters())
    tied = getattr(module, "tied", False)
    unknown = [k for k in hf_state if k not in expected and not _ignorable(k, tied)]
    if unknown:
        raise WeightLoadingError(
            f"checkpoint keys not used by the static {type(module).__name__}: {unknown[:5]} "
            f"({len(unknown)} in all); the checkpoint does not match its config.json."
        )
    mapped = {}
    for name, param in expected.items():
        if name not in hf_state:
            raise WeightLoadingError(f"checkpoint is missing {name!r}; the checkpoint does not match its config.json.")
        tensor = hf_state[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightLoadingError(
                f"{name!r} has shape {tuple(tensor.shape)} in the checkpoint but {tuple(param.shape)} in the "
                "model built from config.json; the checkpoint does not match its config."
            )
        if not tensor.is_floating_point():
            raise WeightLoadingError(f"{name!r} has dtype {tensor.dtype}; quantized checkpoints are not supported.")
        mapped[name] = tensor.to(dtype).contiguous()
    return mapped


def _ignorable(key: str, tied: bool) -> bool:
    return key.endswith(_IGNORED_SUFFIXES) or (tied and key == "lm_head.weight")


def constants_of(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weight set bound to every graph: mapped parameters plus the module's buffers."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return {**params, **buffers}


def bind_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Make ``module`` use ``weights`` (no copy); raises when a name or shape does not fit."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    if missing or extra:
        raise WeightLoadingError(f"weights do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}.")
    module.load_state_dict(weights, strict=False, assign=True)
    for name in dict(module.named_buffers()):
        _set_buffer(module, name, weights[name])  # non-persistent buffers are not in state_dict


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._buffers[leaf] = value
