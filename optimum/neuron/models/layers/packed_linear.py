"""`PackedLinear`, the packed twin of ``nn.Linear`` (`kernels.packed`), and `project`, which runs several of a layer's
projections of one input in one call. Apart from `packed` so that the attention and MLP modules can import it (`packed`
imports `parallel`, which imports the attention)."""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...kernels.packed import PANEL, packed_linear, packed_linear_cat, packed_linear_swiglu, packed_qlinear_cat


class PackedLinear(nn.Linear):
    """``nn.Linear`` with a packed weight ``[ceil(out / 16), in, 16]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias, self.out_features)


QUANTIZED_CAT_ROWS = 16
"""Quantized layers run as one call up to this many rows, known when the graph is traced (token generation,
verification; never a prefill chunk of a symbolic size). SmolLM2 int8, the artifacts before and after fusing
alternating in fresh processes: the batch-1 decode step 6.0-6.6 -> 5.8-6.5 ms, but a 256-token prefill 145-150 ->
149-153 ms (its products alone were not slower: 0.99x); so prefill chunks keep one call per projection. fp32 fuses at
every row count (prefill 256 tokens 136.4 -> 134.9 ms, 1,024 within noise)."""


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each of ``linears`` applied to ``x`` (a layer's q, k and v, or its gate and up): in one call when all are plain
    `PackedLinear` layers (`packed_linear_cat`), or all plain `PackedQuantizedLinear` layers of one kind and group
    size in a call of up to `QUANTIZED_CAT_ROWS` rows (`packed_qlinear_cat`): one parallel region for all, each bias
    added after, which is bitwise the separate products (the kernels also add the bias to the finished sum). Else one
    call each (torch's layout, LoRA, mixed kinds)."""
    from .quantized import PackedQuantizedLinear  # here: quantized imports parallel, which imports the attention

    kind = type(linears[0])
    fusable = kind in (PackedLinear, PackedQuantizedLinear)
    layers = [m for m in linears if isinstance(m, nn.Linear) and type(m) is kind] if fusable else []
    if len(linears) < 2 or len(layers) < len(linears):
        return tuple(m(x) for m in linears)
    sizes = [m.out_features for m in layers]
    weights = [_tensor(m.weight) for m in layers]
    scales = [_tensor(m.weight_scale) for m in layers] if kind is PackedQuantizedLinear else []
    if not scales:
        y = packed_linear_cat(x, weights, sizes)
    elif statically_known_true(x.numel() <= QUANTIZED_CAT_ROWS * x.shape[-1]) and _one_scheme(weights, scales):
        y = packed_qlinear_cat(x, weights, scales, sizes)
    else:
        return tuple(m(x) for m in linears)
    return tuple(o if m.bias is None else o + m.bias for o, m in zip(y.split(sizes, dim=-1), layers, strict=True))


def _tensor(value: object) -> torch.Tensor:
    assert isinstance(value, torch.Tensor)
    return value


def _one_scheme(weights: list[torch.Tensor], scales: list[torch.Tensor]) -> bool:
    """Quantized weights `packed_qlinear_cat` takes together: one dtype (int8, or int4 pairs) and one group size."""
    groups = {w.shape[1] // s.shape[0] for w, s in zip(weights, scales, strict=True)}
    return len({w.dtype for w in weights}) == 1 and len(groups) == 1


SILU = ("silu", "swish")
"""The names transformers gives SiLU (``ACT2FN``): the activation `swiglu` fuses."""


def swiglu(x: torch.Tensor, gate: nn.Module, up: nn.Module) -> torch.Tensor | None:
    """``silu(gate(x)) * up(x)`` in one `packed_linear_swiglu` call when ``gate`` and ``up`` are plain fp32
    `PackedLinear` layers of one shape without biases; None otherwise (torch's layout, quantized weights, LoRA,
    biases): the caller then runs them apart."""
    if not all(type(m) is PackedLinear and m.bias is None for m in (gate, up)):
        return None
    weights = (_tensor(gate.weight), _tensor(up.weight))
    if weights[0].shape != weights[1].shape or weights[0].dtype != torch.float32:
        return None
    return packed_linear_swiglu(x, *weights, _out_features(gate))


def fused_swiglu(x: torch.Tensor, gate_up: nn.Module) -> torch.Tensor | None:
    """The same for a gate and up stored as one layer (Phi-3's ``gate_up_proj``: the gate's outputs first): its packed
    weight's two halves of whole panels (the intermediate size a multiple of 16), or None."""
    if type(gate_up) is not PackedLinear or gate_up.bias is not None:
        return None
    weight, half = _tensor(gate_up.weight), _out_features(gate_up) // 2
    if half % PANEL or weight.dtype != torch.float32:
        return None
    panels = half // PANEL
    return packed_linear_swiglu(x, weight[:panels], weight[panels:], half)


def _out_features(layer: nn.Module) -> int:
    assert isinstance(layer, nn.Linear)
    return layer.out_features
