"""The decoder's quantized linear layers (``--weight_format int8 | int4``, `quantization`): twins of ``nn.Linear``
and `RowParallelLinear` holding int8 values and float32 scales, and `quantize_decoder`, which swaps them in (and the
LM head's int8 twins under ``--lm_head_format int8``: a linear layer's, or a tied embedding table's,
`layers.embedding`).

Two forms of each twin, chosen with the packed kernel (`NeuronConfig.packed_linears`):

* **packed** (fp32 on the CPU): the weight in the packed kernel's quantized panels (``[P, K, 16]`` int8, or
  ``[P, K, 8]`` uint8 two int4 values per byte) and its scales ``[groups, P * 16]``; ``optimum_neuron::packed_qlinear``
  reads the quantized bytes in registers (int8 dequantized per panel row, int4 scaled once per run of its group:
  `kernels.packed`), so a decode step streams a quarter (int8) or an eighth (int4) of the fp32 bytes;
* **dequantizing** (every other backend, dtype and device; the form NxD's quantized layers compile): int8 values
  ``[N, K]`` and scales ``[N, groups]``, dequantized in the graph (``q * scale``) before torch's linear.

A twin keeps its module's name and parameter names (``weight``, ``bias``) and adds ``weight_scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import NeuronConfig
from ...kernels.packed import packed_qlinear, qpacked_shape
from ...quantization import SCALE, dequantize, group_size, quantizable
from .embedding import (
    PackedQuantizedEmbedding,
    PackedQuantizedScaledEmbedding,
    QuantizedEmbedding,
    QuantizedScaledEmbedding,
    ScaledEmbedding,
)
from .parallel import RowParallelLinear


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` whose weight is int8 ``[N, K]`` with scales ``[N, groups]``, dequantized in the graph."""

    weight_scale: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.weight_scale).to(x.dtype), self.bias)


class QuantizedRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` with `QuantizedLinear`'s weight: its rank's slice of the input features."""

    weight_scale: nn.Parameter

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.weight_scale).to(x.dtype))


class PackedQuantizedLinear(nn.Linear):
    """``nn.Linear`` on the packed kernel's quantized panels (`kernels.packed.packed_qlinear`)."""

    weight_scale: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_qlinear(x, self.weight, self.weight_scale, self.bias, self.out_features)


class PackedQuantizedRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` on the packed kernel's quantized panels: its rank's slice of the input features."""

    weight_scale: nn.Parameter

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return packed_qlinear(x, self.weight, self.weight_scale, None, self.out_features)


TWINS: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {
    (nn.Linear, False): QuantizedLinear,
    (RowParallelLinear, False): QuantizedRowParallelLinear,
    (nn.Linear, True): PackedQuantizedLinear,
    (RowParallelLinear, True): PackedQuantizedRowParallelLinear,
}
"""``(module type, packed)`` -> its quantized twin."""
HEAD_TWINS: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {
    (nn.Linear, False): QuantizedLinear,
    (nn.Linear, True): PackedQuantizedLinear,
    (nn.Embedding, False): QuantizedEmbedding,
    (nn.Embedding, True): PackedQuantizedEmbedding,
    (ScaledEmbedding, False): QuantizedScaledEmbedding,
    (ScaledEmbedding, True): PackedQuantizedScaledEmbedding,
}
"""``(LM head module type, packed)`` -> its int8 twin: an untied head's linear layer, or the tied embedding table."""


def quantized_inputs(decoder: nn.Module) -> list[int]:
    """The input sizes of ``decoder``'s quantized linear layers (what the int4 group size must divide)."""
    return [_linear(decoder, name).in_features for name in quantized_modules(decoder)]


def quantized_modules(decoder: nn.Module) -> list[str]:
    """The linear layers of ``decoder`` that ``--weight_format`` quantizes (`quantization.quantizable`)."""
    kinds = (nn.Linear, RowParallelLinear)
    return [name for name, module in decoder.named_modules() if type(module) in kinds and quantizable(name)]


def quantized_head(decoder: nn.Module, config: NeuronConfig) -> list[str]:
    """The LM head ``--lm_head_format int8`` quantizes (``lm_head``, or the tied ``model.embed_tokens``), or none."""
    if config.lm_head_format == "float":
        return []
    return ["model.embed_tokens" if getattr(decoder, "lm_head", None) is None else "lm_head"]


def quantize_decoder(decoder: nn.Module, config: NeuronConfig) -> None:
    """Turn, in place, every quantizable linear layer of ``decoder`` and its LM head (`quantized_head`) into their
    quantized twins (packed when ``config.packed_linears``): the same module (name, bias, buffers, device), its weight
    an empty int8 (uint8) tensor of the twin's shape and its ``weight_scale`` an empty float32 one. A no-op when
    neither ``weight_format`` nor ``lm_head_format`` quantizes."""
    if config.weight_format != "float":
        modules = [_linear(decoder, name) for name in quantized_modules(decoder)]
        group = group_size(config, [module.in_features for module in modules])
        for module in modules:
            groups = 1 if config.weight_format == "int8" else module.in_features // group
            _quantize(module, TWINS[(type(module), config.packed_linears)], config.weight_format, groups, config)
    for name in quantized_head(decoder, config):
        head = decoder.get_submodule(name)
        float_dtype = head.get_parameter("weight").dtype
        _quantize(head, HEAD_TWINS[(type(head), config.packed_linears)], "int8", 1, config)
        if isinstance(head, QuantizedEmbedding):
            head.float_dtype = float_dtype


def _quantize(module: nn.Module, twin: type[nn.Module], fmt: str, groups: int, config: NeuronConfig) -> None:
    """Make ``module`` (weight ``[rows, columns]``) a ``twin`` holding ``fmt`` values in ``groups`` groups per row."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    device, (rows, columns) = weight.device, weight.shape
    module.__class__ = twin
    shape: tuple[int, ...]
    if config.packed_linears:
        bits = 8 if fmt == "int8" else 4
        shape, dtype = qpacked_shape((rows, columns), bits), torch.int8 if bits == 8 else torch.uint8
        scale_shape: tuple[int, ...] = (groups, shape[0] * 16)
    else:
        shape, dtype, scale_shape = (rows, columns), torch.int8, (rows, groups)
    module.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)
    scale = torch.empty(scale_shape, device=device, dtype=torch.float32)
    module.register_parameter(SCALE, nn.Parameter(scale, requires_grad=False))


def _linear(decoder: nn.Module, name: str) -> nn.Linear:
    module = decoder.get_submodule(name)
    assert isinstance(module, nn.Linear), f"{name} is not a linear layer"
    return module
