"""Weight-only quantization (``--weight_format int8 | int4``): the scheme, the stored form and the graph form.

The scheme (exactly, so a test can run transformers on the same dequantized weights):

* int8: per output channel, symmetric: ``scale = max|w_row| / 127``, ``q = round(w / scale)``;
* int4: per group of G consecutive input columns of each output row, symmetric: ``scale = max|w_group| / 7``,
  ``q = round(w / scale)`` in [-7, 7]; with ``--int4_range full``, llama.cpp Q4_0's rule over all 16 levels: the
  group's weight of largest magnitude ``m`` (signed) gives ``scale = m / -8`` (negative when ``m`` is positive), so it
  maps to -8 exactly and ``q = round(w / scale)`` lies in [-8, 7].

``torch.round`` rounds half to even; a row (group) of zeros has scale 0 and q 0. The dequantized weight is
``q * scale`` in fp32 (`dequantize`): what every kernel multiplies by.

What is quantized: the linear layers of the decoder's layers (attention and MLP projections, Phi-3's fused ones);
embeddings, norms, an MoE router and MoE experts stay in ``auto_cast_type`` (`quantizable`). The LM head is quantized
only with ``--lm_head_format int8``, always int8 per vocabulary row (`layer_format`); a tied embedding table is the LM
head, stored once in int8 (the lookup reads ``q[id] * scale[id]``).

The **stored form** (``model.safetensors``): ``<layer>.weight`` int8 ``[N, K]`` (int8) or uint8 ``[N, K / 2]``, two
signed 4-bit values per byte, column ``2j`` in the low nibble (int4), and ``<layer>.weight_scale`` float32
``[N, K / G]`` (``G = K`` for int8). The **graph form** (`graph_form`) is one rank's slice with int4 unpacked to
one int8 per weight; the packed CPU kernel then packs it into its panels (`artifact.graph_weights`).

A pre-quantized compressed-tensors checkpoint (`prequantized`) fills the same stored form with its own values and
scales: its symmetric range reaches one level lower (int4 [-8, 7], int8 [-128, 127]), which every kernel decodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .config import NeuronConfig, flag
from .errors import IncompatibleConfigError

SCALE = "weight_scale"
"""The name of a quantized layer's scales, beside its ``weight``."""
LEVELS = {"int8": 127, "int4": 7}
"""The largest quantized magnitude of each format."""
GROUP_SIZES = (128, 64, 32)
"""int4 group sizes ``weight_group_size=0`` picks from: the largest that divides every quantized layer's input."""
HEADS = ("lm_head", "model.embed_tokens")
"""The names an LM head's weight has: its own linear layer, or the embedding table tied to it."""
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""Projections tensor parallelism splits along their input features (`layers.parallel.ROW_PARALLEL`)."""


def quantize(
    weight: torch.Tensor, fmt: str, group: int, int4_range: str = "symmetric"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [N, K], scale float32 [N, K / group])`` of ``weight [N, K]`` under format ``fmt`` (the scheme
    above; int8 takes ``group = K``; ``int4_range`` ``full``: Q4_0's 16 levels): rounded to nearest."""
    rows, columns = weight.shape
    grouped = weight.float().reshape(rows, columns // group, group)
    scale, low, high = base_scale(grouped, fmt, int4_range)
    return round_to(grouped, scale[..., None], low, high).to(torch.int8).reshape(rows, columns), scale


def base_scale(grouped: torch.Tensor, fmt: str, int4_range: str = "symmetric") -> tuple[torch.Tensor, int, int]:
    """The scheme's scale of each group of ``grouped [N, groups, G]`` (float32 ``[N, groups]``) and the range of
    ``q``: symmetric ``max|w| / levels`` in [-levels, levels], or int4 ``full``'s ``m / -8`` in [-8, 7]."""
    if fmt == "int4" and int4_range == "full":
        return largest_magnitude(grouped) / -8, -8, 7
    return grouped.abs().amax(dim=-1) / LEVELS[fmt], -LEVELS[fmt], LEVELS[fmt]


def round_to(weight: torch.Tensor, scale: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """``round(weight / scale)`` clamped to [low, high] (float; ``scale`` broadcast against ``weight``; a zero scale
    gives 0): the integer values a scale gives."""
    divisor = torch.where(scale != 0, scale, torch.ones_like(scale))
    return torch.round(weight / divisor).clamp(low, high)


def largest_magnitude(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude along the last dimension of ``x``, with its sign (the first of equal ones)."""
    return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))[..., 0]


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32, each scale over its group of columns: the weight every kernel multiplies by."""
    rows, columns = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(rows, groups, columns // groups) * scale[..., None].float()).reshape(rows, columns)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 values ``q`` int8 ``[..., K]`` (K even) -> uint8 ``[..., K / 2]``: element ``2j`` of the last dimension in
    byte j's low nibble, ``2j + 1`` in its high nibble, two's complement (a zero byte is two zero weights). The
    stored form's rule, and the packed kernel's over each panel column's pairs of steps of K
    (`kernels.packed.pack_int4`)."""
    low, high = q[..., 0::2].to(torch.uint8) & 0xF, q[..., 1::2].to(torch.uint8) & 0xF
    return low | (high << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The int8 ``[..., K]`` values `pack_nibbles` stored in ``packed``."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int8)
    return nibbles - ((nibbles & 8) << 1)


def quantizable(name: str) -> bool:
    """Whether the linear layer called ``name`` is quantized: a linear layer of the decoder's layers, but not an
    MoE router (its few outputs pick experts: kept exact)."""
    return name.startswith("model.layers.") and not name.endswith(".mlp.gate")


def layer_format(config: NeuronConfig, layer: str) -> str:
    """The format of the quantized layer ``layer``: ``lm_head_format`` for the LM head (`HEADS`), else
    ``weight_format``."""
    return config.lm_head_format if layer in HEADS else config.weight_format


def group_size(config: NeuronConfig, inputs: Iterable[int]) -> int:
    """The group size of ``config``'s format for layers with these input sizes: ``K`` for int8 (one group: the
    caller uses each layer's own), else ``weight_group_size`` or, when 0, the largest of `GROUP_SIZES` that divides
    every input size; `IncompatibleConfigError` naming the flag when none does or the given one does not."""
    sizes = sorted(set(inputs))
    if config.weight_format != "int4":
        return 0
    if config.weight_group_size:
        bad = [k for k in sizes if k % config.weight_group_size]  # an even group (config) leaves K even
        if bad:
            raise IncompatibleConfigError(
                f"weight_group_size={config.weight_group_size} does not divide the input size(s) {bad} of the "
                f"quantized layers: pass {flag('weight_group_size')} with a divisor of {sizes} (or 0 to pick one)."
            )
        return config.weight_group_size
    for size in GROUP_SIZES:
        if all(k % size == 0 for k in sizes):
            return size
    raise IncompatibleConfigError(
        f"none of {list(GROUP_SIZES)} divides every quantized layer's input size {sizes}: pass "
        f"{flag('weight_group_size')} G with G dividing each of them, or {flag('weight_format')} int8."
    )


def stored_form(weights: dict[str, torch.Tensor], layers: Iterable[str], config: NeuronConfig) -> dict[str, Any]:
    """The weight set as the artifact stores it: each of ``layers``' float ``weight`` replaced by its quantized
    values and scales in its format (`layer_format`; the module docstring's stored form), a layer whose format is
    float left as it is."""
    stored = dict(weights)
    for layer in layers:
        fmt = layer_format(config, layer)
        if fmt == "float":
            continue
        weight = stored.pop(f"{layer}.weight")
        group = config.weight_group_size if fmt == "int4" else weight.shape[1]
        store(stored, layer, fmt, *quantize(weight, fmt, group, config.int4_range))
    return stored


def store(stored: dict[str, Any], layer: str, fmt: str, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Put layer ``layer``'s values ``q`` (int8, one a weight) and ``scale`` into the weight set ``stored``, in the
    stored form of format ``fmt`` (int4 packed two a byte)."""
    stored[f"{layer}.weight"] = pack_nibbles(q) if fmt == "int4" else q
    stored[f"{layer}.{SCALE}"] = scale


def quantized_layers(weights: dict[str, torch.Tensor]) -> list[str]:
    """The layers of a stored or graph-form weight set that are quantized: those with scales."""
    return [name.removesuffix(f".{SCALE}") for name in weights if name.endswith(f".{SCALE}")]


Shard = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""One rank's slice of a weight set (`artifact.rank_weights` bound to its rank)."""


def graph_form(weights: dict[str, torch.Tensor], config: NeuronConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """A rank's quantized weights as the graphs bind them (before the packed kernel's packing): int4 unpacked to one
    int8 per weight, each tensor sliced by ``shard``. At ``tp_degree > 1`` the scales of the row-parallel projections,
    which split their input columns, are spread over the columns first, sliced with the weight, then gathered back
    into groups (a padded head's columns have zero scales: the group's scale of largest magnitude is its real one,
    negative under ``--int4_range full``)."""
    layers = quantized_layers(weights)
    if not layers:
        return shard(weights)
    full = dict(weights)
    split = [layer for layer in layers if config.tp_degree > 1 and layer.endswith(ROW_PARALLEL)]
    for layer in layers:
        if layer_format(config, layer) == "int4":
            full[f"{layer}.weight"] = unpack_nibbles(full[f"{layer}.weight"])
        if layer in split:
            scale, columns = full[f"{layer}.{SCALE}"], full[f"{layer}.weight"].shape[1]
            full[f"{layer}.{SCALE}"] = scale.repeat_interleave(columns // scale.shape[1], dim=1)
    ranked = shard(full)
    for layer in split:
        spread = ranked[f"{layer}.{SCALE}"]
        group = config.weight_group_size if config.weight_format == "int4" else spread.shape[1]
        grouped = spread.reshape(spread.shape[0], -1, group)  # a real group's one scale, or zeros (a padded head's)
        ranked[f"{layer}.{SCALE}"] = largest_magnitude(grouped).contiguous()
    return ranked


def fit_weight_format(config: NeuronConfig, hf_config: Any) -> NeuronConfig:
    """``config`` with the format of a pre-quantized checkpoint taken (`prequantized.fit_checkpoint_format`) and its
    int4 group size resolved for the model ``hf_config`` (`fit_group_size`); unchanged for other formats. A
    checkpoint's own groups that do not fit tensor parallelism are refused naming ``--tensor_parallel_size``."""
    from .prequantized import checkpoint_scheme, fit_checkpoint_format

    scheme = checkpoint_scheme(hf_config)
    if scheme is None:
        return fit_group_size(config, hf_config)
    config = fit_checkpoint_format(config, scheme)
    try:
        return fit_group_size(config, hf_config)
    except IncompatibleConfigError as err:
        raise IncompatibleConfigError(
            f"the checkpoint's int4 groups of {scheme.group_size} are taken as they are, and do not fit "
            f"{flag('tp_degree')} {config.tp_degree} ({err}): export with another {flag('tp_degree')}."
        ) from err


def fit_group_size(config: NeuronConfig, hf_config: Any) -> NeuronConfig:
    """``config`` with its int4 group size resolved for the model ``hf_config`` (0 -> `group_size`'s pick over the
    whole model's layers), checked against one tensor-parallel rank's layers: a rank's slice of a row-parallel
    projection must hold whole groups, and where tensor parallelism pads the heads a group must not straddle two
    heads (a padded head is inserted whole). Unchanged for other formats."""
    if config.weight_format != "int4":
        return config
    from .artifact import empty_decoder
    from .models.layers.parallel import head_layout
    from .models.layers.quantized import quantized_inputs
    from .models.registry import language_config

    def inputs(tp_degree: int) -> list[int]:
        float_config = config.derive(
            tp_degree=tp_degree,
            weight_format="float",
            weight_group_size=0,
            int4_range="symmetric",
            quantization_method="rtn",
        )
        decoder = empty_decoder(hf_config, float_config)
        return quantized_inputs(decoder)

    fitted = config.derive(weight_group_size=group_size(config, inputs(1)))
    if config.tp_degree > 1:
        group_size(fitted, inputs(config.tp_degree))
        layout = head_layout(language_config(hf_config), config.tp_degree)
        if layout.padded_heads != layout.heads and layout.head_dim % fitted.weight_group_size:
            raise IncompatibleConfigError(
                f"weight_group_size={fitted.weight_group_size} does not divide head_dim={layout.head_dim}: at "
                f"{flag('tp_degree')} {config.tp_degree} the heads are padded with zero heads, and a group would "
                f"straddle a real and a padded head; pass {flag('weight_group_size')} with a divisor of "
                f"{layout.head_dim}."
            )
    return fitted
