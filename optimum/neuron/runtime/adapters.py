"""The engine's multi-LoRA adapter slots (``--max_loras N``): which PEFT adapter each slot holds, loaded in place.

The graphs bind, per targeted projection, ``lora_a [N + 1, R, in]`` and ``lora_b [N + 1, R, out]``
(`models.layers.lora`) like weights. Loading an adapter reads its PEFT folder with peft's own readers
(``PeftConfig.from_pretrained``, ``load_peft_weights``), checks it fits what was compiled, and copies its A and its B
times the projection's scaling (``lora_alpha / r``, ``/ sqrt(r)`` with rsLoRA; the rank zero-padded to R) into a free
slot of those same tensors: every graph sees it at once, nothing is recompiled. Slot 0 is the base model and is never
written.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import NeuronConfig, flag
from ..errors import InputError
from ..models.layers.lora import LORA_BUFFERS

AdapterParts = dict[str, tuple[torch.Tensor, torch.Tensor, float]]
"""An adapter as read (`AdapterSlots.read`): per projection, its ``(A [r, in], B [out, r], scaling)`` (this rank's
part)."""
RankPart = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""A tensor-parallel rank's part of a projection's adapter ``(A, B)``."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the model's own module names in an adapter's weights."""


class AdapterSlots:
    """The adapter slots of one engine's weight set."""

    def __init__(
        self, config: NeuronConfig, weights: dict[str, torch.Tensor], rank_part: RankPart | None = None
    ) -> None:
        """The slots in ``weights`` (a graph weight set); ``rank_part`` slices an adapter's A and B of a projection to
        this tensor-parallel rank's part (`layers.parallel.lora_rank_part`; None: one rank)."""
        self.capacity, self.rank, self.dtype = config.max_loras, config.max_lora_rank, config.torch_dtype
        self.rank_part = rank_part
        self.modules = sorted({name.rpartition(".")[0] for name in weights if name.endswith(".lora_a")})
        """The projections that take adapters (their names in the model)."""
        self._tensors = {m: tuple(weights[f"{m}.{b}"] for b in LORA_BUFFERS) for m in self.modules}
        self.loaded: dict[str, tuple[int, str]] = {}
        """Adapter name -> (its slot, a key unique to this load: prefix caching keeps loads apart)."""
        self._loads = itertools.count(1)

    def slot(self, name: str | None) -> tuple[int, str]:
        """The slot and load key of adapter ``name`` (``(0, "")``: the base model, for None)."""
        if name is None:
            return 0, ""
        if not self.capacity:
            raise InputError(
                f"adapter {name!r} asked, but this artifact has no adapter slots: re-export with "
                f"{flag('max_loras')} N {flag('max_lora_rank')} R."
            )
        if name not in self.loaded:
            known = ", ".join(sorted(self.loaded)) or "none"
            raise InputError(f"no adapter {name!r} is loaded (loaded: {known}): load_adapter() it first.")
        return self.loaded[name]

    def load(self, name: str, source: str | Path | AdapterParts) -> int:
        """Copy the PEFT adapter at ``source`` (a folder, or what `read` made of one) into a free slot under ``name``;
        its slot. `InputError` when it does not fit (nothing is written then)."""
        if name in self.loaded:
            raise InputError(f"an adapter named {name!r} is already loaded: unload_adapter() it first, or pick a name.")
        free = sorted(set(range(1, self.capacity + 1)) - {s for s, _ in self.loaded.values()})
        if not free:
            raise InputError(
                f"all {self.capacity} adapter slots are taken ({', '.join(sorted(self.loaded))}): unload one, or "
                f"re-export with a larger {flag('max_loras')}."
            )
        parts = source if isinstance(source, dict) else self.read(name, Path(source))
        slot = free[0]
        for module, (a, b) in self._tensors.items():
            slot_a, slot_b = torch.zeros(a.shape[1:], dtype=a.dtype), torch.zeros(b.shape[1:], dtype=b.dtype)
            if module in parts:
                lora_a, lora_b, scale = parts[module]
                slot_a[: lora_a.shape[0]] = lora_a.to(a.dtype)
                slot_b[: lora_b.shape[1]] = (lora_b.double() * scale).t().to(b.dtype)
            write_slot(a, slot, slot_a)
            write_slot(b, slot, slot_b)
        self.loaded[name] = (slot, f"{name}#{next(self._loads)}")
        return slot

    def unload(self, name: str) -> None:
        """Free ``name``'s slot (zeroed: a row left on it would add nothing)."""
        slot, _ = self.slot(name)
        for a, b in self._tensors.values():
            write_slot(a, slot, torch.zeros(a.shape[1:], dtype=a.dtype))
            write_slot(b, slot, torch.zeros(b.shape[1:], dtype=b.dtype))
        del self.loaded[name]

    def read(self, name: str, path: Path) -> AdapterParts:
        """Each projection's ``(A [r, in], B [out, r], scaling)`` of the adapter at ``path``, checked against what the
        slots hold (`InputError` naming the limit otherwise); ``name`` is for the messages."""
        from peft import PeftConfig
        from peft.utils import load_peft_weights

        try:
            config = PeftConfig.from_pretrained(str(path))
            state = load_peft_weights(str(path), device="cpu")
        except Exception as err:  # peft raises ValueError, OSError, ... on a folder that is not an adapter
            raise InputError(f"cannot read a PEFT adapter at {path}: {err}") from err
        _check_config(name, config)
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            parts.setdefault(module, {})[kind.removesuffix(".weight")] = tensor
        unknown = sorted(set(parts) - set(self.modules))
        if unknown:
            raise InputError(
                f"adapter {name!r} adapts {unknown[:3]}, which this artifact compiled without adapter slots: "
                f"re-export with {flag('lora_target_modules')} naming them (or all)."
            )
        return {module: self._part(name, module, tensors, config) for module, tensors in parts.items()}

    def _part(
        self, name: str, module: str, tensors: dict[str, torch.Tensor], config: Any
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        a, b = tensors.get("A"), tensors.get("B")
        if a is not None and b is not None and self.rank_part is not None:
            a, b = self.rank_part(module, a, b)
        slot_a, slot_b = self._tensors[module]
        if a is None or b is None or a.shape[1:] != slot_a.shape[2:] or b.shape[0] != slot_b.shape[2]:
            raise InputError(f"adapter {name!r}: {module}'s lora_A / lora_B do not fit the model's projection.")
        rank = a.shape[0]
        if rank > self.rank or b.shape[1] != rank:
            raise InputError(
                f"adapter {name!r} has rank {rank} on {module}, above the artifact's {self.rank}: re-export with "
                f"{flag('max_lora_rank')} {rank}."
            )
        scale = config.lora_alpha / (math.sqrt(rank) if config.use_rslora else rank)
        return a, b, scale


def write_slot(stacked: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    """Write ``value`` (on the host) into slot ``slot`` of ``stacked`` in place: the graphs keep reading the same
    tensor. On an XLA device the whole tensor is replaced from a host copy, a transfer; writing one slot there would
    compile (and run) a graph of its own for every slot index."""
    with torch.no_grad():
        if stacked.device.type == "xla":
            host = stacked.cpu()
            host[slot] = value
            stacked.copy_(host)
        else:
            stacked[slot] = value.to(stacked.device)


def _check_config(name: str, config: Any) -> None:
    """`InputError` for a PEFT adapter the slots cannot reproduce exactly."""
    if getattr(config, "peft_type", None) != "LORA":  # peft's PeftType is a str enum
        raise InputError(f"adapter {name!r} is a {config.peft_type} adapter; only LoRA adapters are served.")
    unsupported = {
        "use_dora": bool(getattr(config, "use_dora", False)),
        "bias": getattr(config, "bias", "none") != "none",
        "modules_to_save": bool(getattr(config, "modules_to_save", None)),
        "alpha_pattern": bool(getattr(config, "alpha_pattern", None)),
    }
    found = [key for key, bad in unsupported.items() if bad]
    if found:
        raise InputError(f"adapter {name!r} uses {', '.join(found)}, which the adapter slots do not reproduce.")
