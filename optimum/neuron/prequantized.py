"""Pre-quantized checkpoints: a checkpoint quantized with compressed-tensors (what llm-compressor writes and vLLM
reads) exports without re-quantizing.

Accepted (`checkpoint_scheme`): a ``quantization_config`` with ``quant_method: compressed-tensors`` whose config groups
all quantize weights only, symmetric, static, in column order, stored as integers (format ``pack-quantized``,
``int-quantized`` or ``naive-quantized``), as one of

* **W8A16 per channel** (``num_bits: 8``, ``strategy: channel``): exported as ``weight_format="int8"``;
* **W4A16 per group** (``num_bits: 4``, ``strategy: group``, an even ``group_size`` G): exported as
  ``weight_format="int4"`` with ``weight_group_size=G``;

with exactly the layers ``--weight_format`` quantizes (the linear layers of the decoder's layers,
`quantization.quantizable`) quantized. Each layer's integer values are read by compressed-tensors' own decompressor
(`_layer_values`) and stored with the checkpoint's scales, unchanged, in `quantization`'s stored form (int8 values or
int4 pairs, float32 scales: an fp16 / bf16 scale widens exactly). compressed-tensors' symmetric range is
``[-2^(b-1), 2^(b-1) - 1]`` (int4 [-8, 7], int8 [-128, 127]): one negative level more than the export's own
scheme uses, which every kernel decodes (two's complement).

The flags (`fit_checkpoint_format`): ``--weight_format`` and ``--weight_group_size`` left at their defaults take the
checkpoint's; an explicit value that differs is refused naming the flag (a checkpoint is never re-quantized).
Everything else is refused with `QuantizedCheckpointError` saying what and what to do instead: another
``quant_method``, activation quantization, float (fp8 / fp4) or asymmetric weights, dynamic scales, ``actorder:
group``, other bit widths or strategies, a KV-cache scheme, sparsity, transforms, an image-text checkpoint, layers
quantized that stay float here (LM head, embeddings, MoE routers and experts) or decoder-layer projections left float.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import NeuronConfig, flag
from .errors import IncompatibleConfigError, QuantizedCheckpointError, WeightLoadingError
from .models.layers.quantized import quantized_head, quantized_modules
from .models.registry import image_text_family
from .quantization import SCALE, pack_nibbles, stored_form
from .weights import constants_of, map_state_dict

METHOD = "compressed-tensors"
"""The ``quant_method`` read as it is."""
INTEGER_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
"""compressed-tensors formats that store a layer's integer values (and its scales) as they are."""
SHAPES = {(8, "channel"): "int8", (4, "group"): "int4"}
"""``(num_bits, strategy)`` of a checkpoint's weights -> the ``weight_format`` they are exported as."""
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Scale dtypes widened to float32 exactly."""
INSTEAD = (
    "export the float checkpoint it was made from with --weight_format int8 or int4 instead, or quantize with a "
    "compressed-tensors scheme this toolkit reads (W8A16 per channel, W4A16 per group: docs/export.md, "
    '"Pre-quantized checkpoints")'
)


@dataclass(frozen=True)
class CheckpointScheme:
    """What a pre-quantized checkpoint holds: the format and group size it exports as, and how compressed-tensors
    reads it back (its format and scheme)."""

    weight_format: str
    """``int8`` or ``int4``."""
    group_size: int
    """int4's columns per scale; 0 for int8 (one scale per output channel)."""
    compression: str
    """The compressed-tensors format the layers are stored in (one of `INTEGER_FORMATS`)."""
    scheme: Any
    """The compressed-tensors ``QuantizationScheme`` of the weights."""

    def describe(self) -> str:
        """E.g. ``W4A16 in groups of 32, pack-quantized``."""
        shape = f"in groups of {self.group_size}" if self.group_size else "per channel"
        return f"W{self.weight_format[3:]}A16 {shape}, {self.compression}"


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a transformers config, as a dict; None for a float checkpoint."""
    found = getattr(hf_config, "quantization_config", None)
    if found is None or isinstance(found, dict):
        return found
    return found.to_dict()


def without_quantization_config(hf_config: Any) -> Any:
    """A copy of ``hf_config`` without its ``quantization_config`` (``hf_config`` itself when it has none): what an
    artifact's ``config.json`` holds, its weights being in the stored form and its format in ``neuron_config.json``."""
    if not hasattr(hf_config, "quantization_config"):
        return hf_config
    config = copy.deepcopy(hf_config)
    del config.quantization_config
    return config


def check_served_config(hf_config: Any, served: Any) -> None:
    """Refuse a pre-quantized checkpoint whose text decoder is served alone (``served``, a sub-config of
    ``hf_config``, loses its ``quantization_config``)."""
    if served is not hf_config and quantization_config(hf_config) is not None:
        raise QuantizedCheckpointError(
            "the checkpoint is multimodal and quantized (config.json has a quantization_config); pre-quantized "
            f"checkpoints are read for text decoders only: {INSTEAD}."
        )


def checkpoint_scheme(hf_config: Any) -> CheckpointScheme | None:
    """The scheme of a pre-quantized checkpoint (its ``quantization_config``, read by compressed-tensors); None for a
    float checkpoint; `QuantizedCheckpointError` for anything this module's docstring does not accept."""
    raw = quantization_config(hf_config)
    if raw is None:
        return None
    method = raw.get("quant_method")
    if method != METHOD:
        raise QuantizedCheckpointError(
            f"the checkpoint is quantized with quant_method={method!r}; only {METHOD} checkpoints are read as they "
            f"are: {INSTEAD}."
        )
    if image_text_family(hf_config) is not None:
        raise QuantizedCheckpointError(f"pre-quantized image-text checkpoints are not read: {INSTEAD}.")
    config = _validated(raw)
    _refuse_beyond_weights(raw, config)
    schemes = [_scheme_of(name, scheme, config.format) for name, scheme in config.config_groups.items()]
    kinds = {(s.weight_format, s.group_size, s.compression) for s in schemes}
    if len(kinds) != 1:
        found = f"quantize differently ({sorted(s.describe() for s in schemes)})" if kinds else "are none"
        raise QuantizedCheckpointError(
            f"the checkpoint's config groups {found}; an artifact has one format and group size: {INSTEAD}."
        )
    return schemes[0]


def _validated(raw: dict[str, Any]) -> Any:
    """compressed-tensors' ``QuantizationConfig`` of ``raw``."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as err:
        raise QuantizedCheckpointError(
            "reading a compressed-tensors checkpoint needs the compressed-tensors package (installed with vLLM): "
            "pip install compressed-tensors==0.17.0."
        ) from err
    try:
        return QuantizationConfig.model_validate(raw)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise QuantizedCheckpointError(
            f"compressed-tensors cannot read the checkpoint's quantization_config ({str(err).splitlines()[0]}): "
            f"{INSTEAD}."
        ) from err


def _refuse_beyond_weights(raw: dict[str, Any], config: Any) -> None:
    """Refuse what quantizes more than weights, or stores them otherwise than compressed."""
    extras = {
        "kv_cache_scheme (a KV cache quantized with the checkpoint's scales: the cache here is in --auto_cast_type, "
        "or int8 with scales computed per token by --kv_cache_dtype int8)": config.kv_cache_scheme,
        "sparsity_config (sparse weights)": raw.get("sparsity_config"),
        "transform_config (rotated weights)": raw.get("transform_config"),
    }
    found = [name for name, value in extras.items() if value]
    status = getattr(config.quantization_status, "value", config.quantization_status)
    if status != "compressed":
        found.append(f"quantization_status={status} (weights not stored compressed)")
    if found:
        raise QuantizedCheckpointError(f"the checkpoint's quantization_config has {', '.join(found)}: {INSTEAD}.")


_WEIGHT_REFUSALS: tuple[tuple[Callable[[Any], object], str], ...] = (
    (lambda w: w.type != "int", "{type} weights (only integer weights are read)"),
    (lambda w: not w.symmetric, "asymmetric weights (zero points)"),
    (lambda w: w.dynamic is not False, "dynamic weight scales (dynamic={dynamic})"),
    (lambda w: w.actorder == "group", "actorder=group (weight_g_idx: columns quantized out of order)"),
    (
        lambda w: (w.num_bits, w.strategy) not in SHAPES,
        "{num_bits}-bit weights with strategy {strategy} (read: 8-bit channel, 4-bit group)",
    ),
    (lambda w: w.strategy == "group" and (w.group_size or 1) % 2 == 1, "an odd group_size {group_size}"),
)
"""A condition on a scheme's weight arguments that refuses it, and what it says."""


def _scheme_of(name: str, scheme: Any, default_format: str) -> CheckpointScheme:
    """The `CheckpointScheme` of config group ``name``, or `QuantizedCheckpointError` listing what it uses that is not
    read."""
    weights = scheme.weights
    problems = []
    if scheme.input_activations is not None or scheme.output_activations is not None:
        problems.append("activation quantization (input_activations / output_activations, as in W8A8)")
    if weights is None:
        problems.append("no weight quantization")
    else:
        fields = weights.model_dump()
        problems += [text.format(**fields) for refused, text in _WEIGHT_REFUSALS if refused(weights)]
    compression = _compression(scheme, default_format)
    if compression not in INTEGER_FORMATS:
        problems.append(f"format {compression} (read: {', '.join(INTEGER_FORMATS)})")
    if problems:
        raise QuantizedCheckpointError(
            f"config group {name!r} of the checkpoint's quantization_config uses {'; '.join(problems)}: {INSTEAD}."
        )
    weight_format = SHAPES[(weights.num_bits, weights.strategy)]
    group = weights.group_size if weight_format == "int4" else 0
    return CheckpointScheme(weight_format, group, compression, scheme)


def _compression(scheme: Any, default_format: str) -> str:
    """The compressed-tensors format a config group is stored in: its own, else the config's, else (a
    ``mixed-precision`` config) the one compressed-tensors infers for a linear layer."""
    if scheme.format is not None:
        return str(getattr(scheme.format, "value", scheme.format))
    if default_format != "mixed-precision":
        return default_format
    from compressed_tensors.compressors.format import infer_module_format

    return str(infer_module_format(nn.Linear, scheme).value)


def fit_checkpoint_format(config: NeuronConfig, scheme: CheckpointScheme) -> NeuronConfig:
    """``config`` with the checkpoint's format and group size; an explicit ``--weight_format`` or
    ``--weight_group_size`` that differs, ``--int4_range full`` or ``--quantization_method gptq``, is refused naming the
    flag."""
    source = f"the checkpoint is already quantized ({METHOD} {scheme.describe()}) and is exported as it is"
    if config.weight_format not in ("float", scheme.weight_format):
        raise IncompatibleConfigError(
            f"weight_format={config.weight_format}: {source}, as {scheme.weight_format}: drop "
            f"{flag('weight_format')} (or pass {scheme.weight_format}); to quantize otherwise, export the float "
            "checkpoint it was made from."
        )
    if config.weight_group_size not in (0, scheme.group_size):
        raise IncompatibleConfigError(
            f"weight_group_size={config.weight_group_size}: {source}, with groups of {scheme.group_size or 'one row'}"
            f": drop {flag('weight_group_size')}; to quantize otherwise, export the float checkpoint it was made from."
        )
    if config.quantization_method != "rtn":
        raise IncompatibleConfigError(
            f"quantization_method={config.quantization_method!r}: {source}, with its own values and scales: drop "
            f"{flag('quantization_method')}; to calibrate otherwise, export the float checkpoint it was made from."
        )
    if config.int4_range != "symmetric":
        raise IncompatibleConfigError(
            f"int4_range={config.int4_range!r}: {source}, with its own values and scales: drop {flag('int4_range')}; "
            "to quantize otherwise, export the float checkpoint it was made from."
        )
    return config.derive(weight_format=scheme.weight_format, weight_group_size=scheme.group_size)


def stored_weights(
    layout: nn.Module, hf_config: Any, state: dict[str, torch.Tensor], config: NeuronConfig
) -> dict[str, torch.Tensor]:
    """The weight set an artifact stores from the checkpoint tensors ``state`` of the model ``layout`` (the decoder
    in the checkpoint's layout): a float checkpoint's mapped (`weights.map_state_dict`), then quantized when
    ``config`` says so (`quantization.stored_form`); a pre-quantized checkpoint's quantized layers taken as they are
    (`take_quantized`) beside its other tensors, mapped. The LM head is quantized when ``lm_head_format`` says so,
    in either case. ``config`` is fitted (`quantization.fit_weight_format`)."""
    scheme = checkpoint_scheme(hf_config)
    head = quantized_head(layout, config)
    if scheme is None:
        params = map_state_dict(layout, state, config.torch_dtype)
        return stored_form(constants_of(layout, params), quantized_modules(layout) + head, config)
    quantized = take_quantized(layout, state, scheme)
    params = map_state_dict(layout, state, config.torch_dtype, taken=frozenset(quantized))
    return {**stored_form(constants_of(layout, params), head, config), **quantized}


def take_quantized(
    layout: nn.Module, state: dict[str, torch.Tensor], scheme: CheckpointScheme
) -> dict[str, torch.Tensor]:
    """Pop from ``state`` the tensors of every quantized layer (those with a ``weight_scale``) and return them in the
    stored form; the quantized layers must be exactly ``layout``'s `quantized_modules`."""
    layers = quantized_modules(layout)
    found = sorted({key.removesuffix(f".{SCALE}") for key in state if key.endswith(f".{SCALE}")})
    outside = [name for name in found if name not in set(layers)]
    if outside:
        raise QuantizedCheckpointError(
            f"the checkpoint quantizes {outside[:5]} ({len(outside)} in all), which stay in --auto_cast_type here "
            "(only the linear layers of the decoder's layers are taken quantized; the LM head, embeddings, MoE routers "
            "and experts are not): list them in the scheme's ignore (e.g. ignore=['lm_head']) when quantizing (an "
            f"int8 LM head: export the float one with --lm_head_format int8), or {INSTEAD}."
        )
    unquantized = [name for name in layers if name not in set(found)]
    if unquantized:
        raise QuantizedCheckpointError(
            f"the checkpoint leaves {unquantized[:5]} ({len(unquantized)} of the {len(layers)} linear layers of the "
            "decoder's layers) unquantized; an artifact quantizes all of them: quantize them too (drop them from the "
            f"scheme's ignore), or {INSTEAD}."
        )
    stored: dict[str, torch.Tensor] = {}
    for layer in layers:
        q, scale = _layer_values(state, layer, scheme, tuple(layout.get_parameter(f"{layer}.weight").shape))
        stored[f"{layer}.weight"] = pack_nibbles(q) if scheme.weight_format == "int4" else q
        stored[f"{layer}.{SCALE}"] = scale
    return stored


def _layer_values(
    state: dict[str, torch.Tensor], layer: str, scheme: CheckpointScheme, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [N, K], scale float32 [N, groups])`` of ``layer``, its tensors popped from ``state``. The values
    are compressed-tensors' decompressor's output for unit scales (``q * 1``, exact), so every integer format it
    writes is read by its own code; the scales are the checkpoint's, widened to float32."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(scheme.compression)
    names = compressor.compression_param_names(scheme.scheme)
    missing = [f"{layer}.{name}" for name in names if f"{layer}.{name}" not in state]
    if missing:
        raise WeightLoadingError(f"checkpoint is missing {missing} of its quantized layer {layer}; it is damaged.")
    tensors = {name: state.pop(f"{layer}.{name}") for name in names}
    scale = tensors[SCALE]
    unit = {**tensors, SCALE: torch.ones(scale.shape, dtype=torch.float32)}
    q = compressor.decompress(unit, scheme.scheme)["weight"].to(torch.int8)
    _check_layer(layer, q, scale, scheme, shape)
    return q, scale.float()


def _check_layer(
    layer: str, q: torch.Tensor, scale: torch.Tensor, scheme: CheckpointScheme, shape: tuple[int, ...]
) -> None:
    """`WeightLoadingError` unless ``q`` has the layer's shape and the format's range, and ``scale`` one finite,
    non-negative float per row and group."""
    rows, columns = shape
    groups = columns // scheme.group_size if scheme.group_size else 1
    low = -(1 << (scheme.scheme.weights.num_bits - 1))
    if tuple(q.shape) != shape or tuple(scale.shape) != (rows, groups):
        raise WeightLoadingError(
            f"{layer} has values {tuple(q.shape)} and scales {tuple(scale.shape)} in the checkpoint, but the model "
            f"built from config.json needs {shape} and {(rows, groups)}; the checkpoint does not match its config."
        )
    if q.numel() and (int(q.min()) < low or int(q.max()) > -low - 1):
        raise WeightLoadingError(f"{layer} has values outside [{low}, {-low - 1}]; the checkpoint is damaged.")
    if scale.dtype not in SCALE_DTYPES or not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise WeightLoadingError(
            f"{layer}.{SCALE} must be finite, non-negative float32 / float16 / bfloat16 scales, got {scale.dtype}; "
            "the checkpoint is damaged."
        )
