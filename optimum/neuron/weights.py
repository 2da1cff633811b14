"""Strict mapping of a transformers checkpoint onto the static decoder (DESIGN.md §9).

Our parameter names equal transformers', so the map is the identity; what this module adds is
strictness: every expected key present, no unknown key, shapes equal, floating dtypes cast to
the target dtype, tied embeddings handled, rotary frequencies taken from the module itself.

A family may name renaming rules (`Family.checkpoint_rules`), applied before the strict map, each as
strict as the map itself: `stack_experts` (per-expert MoE tensors -> transformers' stacked layout) and
`text_tower` (a multimodal Gemma 3 checkpoint -> its text decoder). Rules consume the dict they are given,
so no tensor is held twice.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Collection
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


def map_state_dict(
    module: nn.Module, hf_state: dict[str, torch.Tensor], dtype: torch.dtype, taken: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """The parameters of ``module`` taken from ``hf_state`` (after its family's renaming rules), cast to
    ``dtype``; strict. The parameters named in ``taken`` are left out (the caller took them from the checkpoint
    itself: a pre-quantized checkpoint's quantized weights, `prequantized.take_quantized`)."""
    for rule in getattr(getattr(module, "family", None), "checkpoint_rules", ()):
        hf_state = rule(hf_state)
    expected = {name: param for name, param in module.named_parameters() if name not in taken}
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
            raise WeightLoadingError(
                f"{name!r} has dtype {tensor.dtype}, and config.json has no compressed-tensors quantization_config: "
                "only compressed-tensors checkpoints are read pre-quantized (docs/export.md); export the float "
                "checkpoint with --weight_format int8 or int4 (the export quantizes it)."
            )
        mapped[name] = tensor.to(dtype).contiguous()
    return mapped


_EXPERT_KEY = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors ``<p>.experts.<e>.{gate,up,down}_proj.weight`` (the layout of Qwen3-MoE checkpoints
    on the Hub and of ``save_pretrained``) -> ``<p>.experts.gate_up_proj [E, 2I, H]`` (gate rows, then up)
    and ``<p>.experts.down_proj [E, H, I]``, the layout transformers computes with. Experts must be numbered
    ``0..E-1`` with all three projections of equal shapes; keys already stacked pass through."""
    groups: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for key in list(state):
        match = _EXPERT_KEY.match(key)
        if match:
            groups[match["experts"]][int(match["index"])][match["proj"]] = key
    for experts, by_index in groups.items():
        for index in range(max(by_index) + 1):
            for proj in _PROJECTIONS:
                if proj not in by_index.get(index, {}):
                    raise WeightLoadingError(
                        f"checkpoint is missing {experts}.{index}.{proj}.weight; the checkpoint does not match its "
                        "config.json."
                    )
        if f"{experts}.gate_up_proj" in state:
            raise WeightLoadingError(
                f"checkpoint has both {experts}.gate_up_proj and per-expert tensors under {experts}."
            )
        gate_up, down = [], []
        for index in range(len(by_index)):
            gate, up, out = (state.pop(by_index[index][proj]) for proj in _PROJECTIONS)
            if gate.shape != up.shape:
                raise WeightLoadingError(
                    f"{experts}.{index}.up_proj.weight has shape {tuple(up.shape)} but its gate_proj "
                    f"{tuple(gate.shape)}; the checkpoint is damaged."
                )
            gate_up.append(torch.cat((gate, up)))
            down.append(out)
        state[f"{experts}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{experts}.down_proj"] = torch.stack(down)
    return state


_TEXT_TOWER = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""))
_VISION = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def text_tower(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal Gemma 3 checkpoint (``Gemma3ForConditionalGeneration``: ``model.language_model.*``, or
    the older ``language_model.model.*``) -> its text decoder's keys (``model.*``, ``lm_head.weight``). The
    vision tower and projector (``vision_tower.*``, ``multi_modal_projector.*``) are left out: this toolkit
    serves the text decoder only. A text-only checkpoint passes through unchanged."""
    for key in [k for k in state if k.startswith(_VISION)]:
        del state[key]
    return rename_prefixes(state, _TEXT_TOWER)


def rename_prefixes(state: dict[str, torch.Tensor], rules: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    """Rename in place every key starting with a rule's old prefix to its new prefix (the first matching rule);
    `WeightLoadingError` when a renamed key already exists (two models in one checkpoint)."""
    for key in list(state):
        for old, new in rules:
            if key.startswith(old):
                renamed = new + key[len(old) :]
                if renamed in state:
                    raise WeightLoadingError(f"checkpoint has both {key!r} and {renamed!r}; it is not one model.")
                state[renamed] = state.pop(key)
                break
    return state


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
