"""Multi-LoRA on the decoder's linear projections, Punica/S-LoRA style: stacked adapter tensors, one adapter slot per
row, one gathered low-rank product per projection.

`add_lora` turns each targeted projection (``--lora_target_modules``) into its LoRA twin: the same module (name,
weight, packed or quantized kernel), its class a subclass that adds ``scaling * B[i] (A[i] x)`` to the base
output for the adapter slot ``i`` of each row, with two buffers beside its weight: ``lora_a`` ``[N + 1, R, in]`` and
``lora_b`` ``[N + 1, R, out]`` (B transposed: ``--max_loras N``, ``--max_lora_rank R``; an adapter of rank r < R
fills the first r rows of both, the rest stay zero). Each slot's B holds the adapter's B already multiplied by its
``scaling`` (``lora_alpha / r`` for this projection): no scaling tensor, whose handful of values AOTInductor would fold
into the compiled code as constants (measured: a ``[N + 1]`` buffer was, and adapters had no effect).

Slot 0 is the base model: all zeros, so a row on slot 0 adds exactly nothing. The buffers are part of the weight set
every graph binds (`artifact.graph_weights`), never compiled in: loading an adapter copies its tensors into a slot in
place (`runtime.adapters`), and every graph sees them. Which slot each row uses is the graphs' ``adapter_ids`` input
``[rows]``, handed to the twins through the decoder's `AdapterRows` for the duration of one forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from .parallel import RowParallelLinear

LORA_BUFFERS = ("lora_a", "lora_b")


class AdapterRows:
    """The adapter slot of each row of the call being run (``[rows]``, long), shared by a decoder's LoRA twins; None
    outside a call."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None


@contextmanager
def selected_adapters(rows: AdapterRows | None, ids: torch.Tensor | None) -> Iterator[None]:
    """The rows of one call on their adapter slots ``ids`` while the block runs (nothing for a decoder without
    adapter slots, ``rows`` None)."""
    if rows is None:
        yield
        return
    rows.ids = ids
    try:
        yield
    finally:
        rows.ids = None


class LoraProjection:
    """Mixin of a LoRA twin: the base projection's output plus its rows' adapter deltas."""

    rows: AdapterRows
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # type: ignore[misc]
        return self.with_delta(x, out)

    def with_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the rows' adapter deltas of input ``x`` (``out`` alone outside a call)."""
        ids = self.rows.ids
        return out if ids is None else out + lora_delta(x, self.lora_a, self.lora_b, ids)


class LoraRowParallel(LoraProjection):
    """Mixin of a row-parallel projection's LoRA twin (tensor parallelism: o and down projections): the delta joins the
    rank's partial product before the all-reduce. The rank holds its columns of A and all of B, so the partial deltas
    ``(x_r A_r^T) B^T`` sum to the whole one, as the partial products do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super(LoraProjection, self).forward(x)  # type: ignore[misc]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_delta(x, super().local(x))  # type: ignore[misc]


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``(x A[i]^T) B[i]`` (B scaled, stored transposed) for each row's slot ``i = ids[row]``: ``x [rows, T, in]`` ->
    ``[rows, T, out]``, each row's A and B gathered, two batched products of rank R. (Two products over all N slots
    stacked, each row's other columns masked, read every slot once instead of each row's: measured slower, 0.68x of
    the plain artifact against 0.87x for this form, SmolLM2 batch 8 through vLLM: benchmark/results/*/lora.md.)"""
    low = torch.bmm(x, a.index_select(0, ids).transpose(1, 2))
    return torch.bmm(low, b.index_select(0, ids))


_TWINS: dict[type, type] = {}


def lora_twin(kind: type) -> type:
    """The LoRA twin class of a projection class (nn.Linear, its packed or quantized twins), made once."""
    if kind not in _TWINS:
        mixin = LoraRowParallel if issubclass(kind, RowParallelLinear) else LoraProjection
        _TWINS[kind] = type(f"Lora{kind.__name__}", (mixin, kind), {})
    return _TWINS[kind]


def lora_targets(decoder: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The linear projections of ``decoder``'s layers whose leaf name is in ``targets``, in module order."""
    return [
        name
        for name, module in decoder.named_modules()
        if name.startswith("model.layers.") and name.rpartition(".")[2] in targets and isinstance(module, nn.Linear)
    ]


def add_lora(decoder: nn.Module, config: Any) -> None:
    """Give ``decoder`` (built on any device, meta included) `config.max_loras` + 1 adapter slots of rank
    `config.max_lora_rank` on its `config.lora_targets` projections (nothing without ``max_loras``)."""
    if not config.max_loras:
        return
    rows = AdapterRows()
    cast(Any, decoder).adapter_rows = rows
    slots, rank, dtype = config.max_loras + 1, config.max_lora_rank, config.torch_dtype
    for name in lora_targets(decoder, config.lora_targets):
        module = decoder.get_submodule(name)
        assert isinstance(module, nn.Linear)
        device = module.weight.device
        module.__class__ = lora_twin(type(module))
        cast(Any, module).rows = rows
        module.register_buffer("lora_a", torch.zeros(slots, rank, module.in_features, dtype=dtype, device=device))
        module.register_buffer("lora_b", torch.zeros(slots, rank, module.out_features, dtype=dtype, device=device))


def lora_weights(decoder: nn.Module) -> dict[str, torch.Tensor]:
    """Zero adapter tensors (on the CPU) for every LoRA buffer of ``decoder``: the slots a weight set adds to the
    stored weights, filled when adapters load."""
    return {
        f"{name}.{buffer}": torch.zeros(tensor.shape, dtype=tensor.dtype)
        for name, module in decoder.named_modules()
        if isinstance(module, LoraProjection)
        for buffer, tensor in ((b, getattr(module, b)) for b in LORA_BUFFERS)
    }
