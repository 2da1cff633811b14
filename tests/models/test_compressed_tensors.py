"""Pre-quantized checkpoints (`optimum.neuron.prequantized`): a tiny checkpoint quantized by compressed-tensors itself
(`tests.fixtures.llm.compressed`) exports without re-quantizing: the artifact stores the checkpoint's integer values
and scales bit for bit, records its format and group size as ``--weight_format`` does, and computes what transformers
computes loading the same checkpoint (its compressed-tensors integration decompresses it); every scheme, layout or flag
it cannot take as it is, is refused naming what and how."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from optimum.neuron.artifact import WEIGHTS_FILE, Artifact
from optimum.neuron.config import NeuronConfig
from optimum.neuron.errors import IncompatibleConfigError, QuantizedCheckpointError
from optimum.neuron.quantization import SCALE, dequantize, fit_weight_format, quantize, unpack_nibbles
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import check_against_transformers
from tests.fixtures.llm.compressed import compressed_model
from tests.fixtures.llm.models import ExportFixture

pytest.importorskip("compressed_tensors")  # installed with vLLM

LENGTHS = (1, 7, 9, 17)
"""Prompt lengths: within one chunk, a chunk and a row, two chunks and a row (C = 8)."""
NEW = 6
LOGIT_TOLERANCE = 1e-4
"""Max abs difference from transformers on the same checkpoint: both multiply by ``q * scale`` in fp32, only the order
of the sums differs (as in tests/models/test_quantized.py)."""
EXPORTS = {
    "w4a16-g32": (ExportFixture("llama", 2, 4, 8, True, "eager"), "int4", 32),
    "w8a16": (ExportFixture("llama", 2, 4, 8, True, "eager"), "int8", 0),
    "w4a16-g64": (ExportFixture("llama", 2, 1, 32, False, "inductor"), "int4", 64),
}
"""A compressed-tensors scheme, the float fixture whose config exports it (chunked on eager; context encoding on
inductor, whose graphs are those of the ``llama-2x1x32-ce-int4-inductor`` fixture: same format and group size), and
the format and group size the artifact must record. G = 32 is not the group size an int4 export would pick (64)."""


def exported(scheme: str) -> Path:
    """The artifact of ``scheme``'s checkpoint under its `EXPORTS` config (flags at their defaults)."""
    from optimum.exporters.neuron.export import cached_export

    return cached_export(compressed_model(scheme), EXPORTS[scheme][0].neuron_config())


@pytest.mark.parametrize("scheme", list(EXPORTS))
def test_a_compressed_tensors_checkpoint_exports_as_transformers_runs_it(scheme: str) -> None:
    root, (_fixture, weight_format, group) = exported(scheme), EXPORTS[scheme]
    engine = Engine(Artifact.open(root))
    assert (engine.config.weight_format, engine.config.weight_group_size) == (weight_format, group)
    assert "quantization_config" not in json.loads((root / "config.json").read_text())
    checkpoint = compressed_model(scheme)
    check_against_transformers(engine, checkpoint, LENGTHS, NEW, LOGIT_TOLERANCE, scheme)


@pytest.mark.parametrize(("scheme", "lowest"), [("w4a16-g32", -8), ("w8a16", -128)])
def test_the_artifact_stores_the_checkpoints_values_and_scales(scheme: str, lowest: int) -> None:
    """Bit for bit: the stored scales are the checkpoint's, the stored values compressed-tensors' own unpacking of
    it, and ``q * scale`` is its decompressor's weight; its symmetric range reaches one level below ours."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    stored = load_file(str(exported(scheme) / WEIGHTS_FILE))
    checkpoint = load_file(str(compressed_model(scheme) / "model.safetensors"))
    layers = [name.removesuffix(".weight_packed") for name in checkpoint if name.endswith(".weight_packed")]
    assert len(layers) == 14, "2 layers of 7 projections"
    bits = 4 if lowest == -8 else 8
    lows = []
    for layer in layers:
        q, scale = stored[f"{layer}.weight"], stored[f"{layer}.{SCALE}"]
        values = unpack_from_int32(checkpoint[f"{layer}.weight_packed"], bits, checkpoint[f"{layer}.weight_shape"])
        assert torch.equal(unpack_nibbles(q) if bits == 4 else q, values), layer
        assert torch.equal(scale, checkpoint[f"{layer}.{SCALE}"]), layer
        assert torch.equal(dequantize(values, scale), ct_dequantize(values, checkpoint[f"{layer}.{SCALE}"])), layer
        lows.append(int(values.min()))
    assert min(lows) == lowest, "compressed-tensors' symmetric range reaches -2^(b-1): the values keep it"


def stored_of(checkpoint: Path, **fields: Any) -> dict[str, torch.Tensor]:
    """The weight set an export of ``checkpoint`` stores under config ``fields`` (no graph compiled)."""
    from optimum.exporters.neuron.compile import hf_config_of
    from optimum.neuron.artifact import empty_decoder
    from optimum.neuron.prequantized import stored_weights
    from optimum.neuron.weights import read_checkpoint

    config = hf_config_of(checkpoint)
    fitted = fit_weight_format(NeuronConfig(**fields), config)
    return stored_weights(empty_decoder(config, fitted), config, read_checkpoint(checkpoint), fitted)


def test_an_int8_lm_head_is_quantized_from_the_checkpoints_float_table() -> None:
    """``--lm_head_format int8`` on a pre-quantized checkpoint: its layers are taken as they are, and its float tied
    table is quantized by our int8 scheme (one scale per vocabulary row)."""
    checkpoint = compressed_model("w8a16")
    plain, headed = stored_of(checkpoint), stored_of(checkpoint, lm_head_format="int8")
    table = load_file(str(checkpoint / "model.safetensors"))["model.embed_tokens.weight"].float()
    q, scale = quantize(table, "int8", table.shape[1])
    assert torch.equal(headed["model.embed_tokens.weight"], q) and torch.equal(
        headed[f"model.embed_tokens.{SCALE}"], scale
    )
    assert set(headed) == set(plain) | {f"model.embed_tokens.{SCALE}"}
    assert all(torch.equal(headed[name], plain[name]) for name in plain if not name.startswith("model.embed_tokens"))


@pytest.mark.parametrize(
    ("scheme", "fmt"), [("w8a16", "int-quantized"), ("w8a16", "naive-quantized"), ("w4a16-g32", "int-quantized")]
)
def test_every_integer_format_reads_to_the_same_stored_weights(scheme: str, fmt: str) -> None:
    """compressed-tensors stores the values one int8 per weight when asked to: read as its packed int32 words are."""
    other = compressed_model(scheme, fmt=fmt)
    assert load_file(str(other / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    packed, unpacked = stored_of(compressed_model(scheme)), stored_of(other)
    assert set(packed) == set(unpacked)
    assert all(torch.equal(packed[name], unpacked[name]) for name in packed)


def hf_config(scheme: str = "w4a16-g32", **changes: Any) -> Any:
    """The transformers config of ``scheme``'s checkpoint, its quantization_config updated with ``changes`` (a key
    ``weights`` updates the config group's weight arguments)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(compressed_model(scheme))
    raw = copy.deepcopy(config.quantization_config)
    group = raw["config_groups"]["group_0"]
    group["weights"].update(changes.pop("weights", {}))
    group.update(changes.pop("group", {}))
    raw.update(changes)
    config.quantization_config = raw
    return config


INT8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
REFUSED_SCHEMES = [
    ({"quant_method": "gptq"}, "quant_method='gptq'"),
    ({"weights": {"symmetric": False}}, "asymmetric weights"),
    ({"weights": {"type": "float", "num_bits": 8, "strategy": "channel", "group_size": None}}, "float weights"),
    ({"weights": {"dynamic": True}}, "dynamic weight scales"),
    ({"weights": {"actorder": "group"}}, "actorder=group"),
    ({"weights": {"num_bits": 8}}, "8-bit weights with strategy group"),
    ({"weights": {"strategy": "channel", "group_size": None}}, "4-bit weights with strategy channel"),
    ({"group": {"input_activations": INT8_ACTIVATIONS}}, "activation quantization"),
    ({"group": {"format": "dense"}}, "format dense"),
    (
        {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
        "kv_cache_scheme .*--kv_cache_dtype int8",
    ),
    ({"transform_config": {"config_groups": {"r": {}}}}, "transform_config"),
    ({"config_groups": {}}, "config groups are none"),
]


@pytest.mark.parametrize(("changes", "message"), REFUSED_SCHEMES)
def test_schemes_that_cannot_be_taken_as_they_are_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(QuantizedCheckpointError, match=f"{message}.*--weight_format int8 or int4"):
        fit_weight_format(NeuronConfig(), hf_config(**copy.deepcopy(changes)))


def test_the_flags_take_the_checkpoints_format_and_refuse_another() -> None:
    config = hf_config()
    fitted = fit_weight_format(NeuronConfig(), config)
    assert (fitted.weight_format, fitted.weight_group_size) == ("int4", 32)
    assert fit_weight_format(NeuronConfig(weight_format="int4", weight_group_size=32), config) == fitted
    with pytest.raises(IncompatibleConfigError, match=r"already quantized .*W4A16 in groups of 32.*--weight_format"):
        fit_weight_format(NeuronConfig(weight_format="int8"), config)
    with pytest.raises(IncompatibleConfigError, match=r"weight_group_size=64: .*--weight_group_size"):
        fit_weight_format(NeuronConfig(weight_format="int4", weight_group_size=64), config)
    with pytest.raises(IncompatibleConfigError, match=r"int4_range='full': .*own values and scales.*--int4_range"):
        fit_weight_format(NeuronConfig(weight_format="int4", int4_range="full"), config)
    with pytest.raises(IncompatibleConfigError, match=r"quantization_method='gptq': .*--quantization_method"):
        fit_weight_format(NeuronConfig(weight_format="int4", quantization_method="gptq"), config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ignore": ("lm_head", "re:.*down_proj$")}, r"leaves \['model.layers.0.mlp.down_proj', .*\(2 of the 14"),
        ({"ignore": (), "tie_word_embeddings": False}, r"quantizes \['lm_head'\] \(1 in all\)"),
    ],
)
def test_layers_quantized_otherwise_than_an_artifact_are_refused(kwargs: dict, message: str, tmp_path: Path) -> None:
    """Projections of the decoder's layers left float, and the LM head quantized, are refused before compiling."""
    from optimum.exporters.neuron.export import export

    config = EXPORTS["w4a16-g32"][0].neuron_config()
    with pytest.raises(QuantizedCheckpointError, match=message):
        export(compressed_model("w4a16-g32", **kwargs), tmp_path / "out", config, use_cache=False)
    assert not (tmp_path / "out" / WEIGHTS_FILE).exists()


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [("gemma3-multimodal", "multimodal and quantized"), ("idefics3", "pre-quantized image-text checkpoints")],
)
def test_pre_quantized_multimodal_checkpoints_are_refused(checkpoint: str, message: str, tmp_path: Path) -> None:
    from optimum.exporters.neuron.compile import hf_config_of
    from tests.fixtures.llm.idefics3 import tiny_idefics3
    from tests.fixtures.llm.models import tiny_gemma3_multimodal

    folder = tiny_gemma3_multimodal() if checkpoint == "gemma3-multimodal" else tiny_idefics3()
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = hf_config().quantization_config
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantizedCheckpointError, match=f"{message}.*--weight_format int8 or int4"):
        fit_weight_format(NeuronConfig(), hf_config_of(tmp_path))


def test_groups_that_do_not_fit_the_ranks_are_refused_naming_the_flag() -> None:
    """At 2 ranks the 6 / 3 heads of 16 are padded to 8 / 4: a group of 32 would straddle a real and a padded head."""
    from transformers import AutoConfig

    from tests.fixtures.llm.models import tiny_model

    padded = tiny_model("llama", num_attention_heads=6, head_dim=16, hidden_size=96, num_key_value_heads=3)
    config = AutoConfig.from_pretrained(padded)
    config.quantization_config = hf_config().quantization_config
    assert fit_weight_format(NeuronConfig(), config).weight_group_size == 32
    with pytest.raises(IncompatibleConfigError, match=r"groups of 32 .*straddle.*another --tensor_parallel_size"):
        fit_weight_format(NeuronConfig(tp_degree=2), config)
