"""Weight-only quantization (``--weight_format int8 | int4``, `optimum.neuron.quantization`): a quantized artifact
computes what transformers computes with the same weights dequantized (``q * scale``): last-token logits and greedy
tokens of mixed-length prompts, chunked and context encoding, on the packed kernel and dequantized in the graph, eager
and inductor, a fused-projection family and a mixture of experts, and two tensor-parallel ranks; an int8 LM head
(``--lm_head_format int8``), tied (a plain and a scaled table) and untied, likewise; the artifact stores
the quantized bytes and records the format; the padded-chunk rule stays bitwise; bad flags are refused naming them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from optimum.neuron.artifact import WEIGHTS_FILE, Artifact
from optimum.neuron.config import NeuronConfig
from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.quantization import dequantize, pack_nibbles, quantize, unpack_nibbles
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import check_against_transformers, prompt
from tests.fixtures.llm.models import QUANTIZED_FIXTURES, export_fixture, fixture_named
from tests.fixtures.llm.reference import dequantized_checkpoint, hf_greedy
from tests.models.ranks import greedy_on_rank, run_on_ranks

SINGLE = [f.name for f in QUANTIZED_FIXTURES if f.tp == 1]
RANKED = [f.name for f in QUANTIZED_FIXTURES if f.tp > 1]
LENGTHS = (1, 7, 9, 17)
"""Prompt lengths: within one chunk, a chunk and a row, two chunks and a row (C = 8)."""
NEW = 6
LOGIT_TOLERANCE = 1e-4
"""Max abs difference from transformers on the dequantized weights. Measured: at most 1.0e-5 (the kernels multiply by
exactly ``q * scale``; only the order of the sums differs); the same model in float is 0.1 to 4 away."""


def reference_for(engine: Engine, name: str) -> Path:
    """The transformers checkpoint of fixture ``name`` with the artifact's quantized weights dequantized."""
    config = engine.config
    model = fixture_named(name).model()
    fmt, group = config.weight_format, config.weight_group_size
    return dequantized_checkpoint(model, fmt, group, config.lm_head_format, config.int4_range)


@pytest.mark.parametrize("name", SINGLE)
def test_quantized_artifact_equals_transformers_on_the_dequantized_weights(name: str) -> None:
    engine = Engine(Artifact.open(export_fixture(name)))
    reference = reference_for(engine, name)
    check_against_transformers(engine, reference, LENGTHS, NEW, LOGIT_TOLERANCE, name)


@pytest.mark.slow
def test_two_ranks_slice_scales_with_their_rows_and_columns(tmp_path: Path) -> None:
    """int8 with padded heads (zero columns inside o_proj's spread scales) and int4 with groups split over the ranks:
    both ranks return transformers' greedy tokens on the dequantized weights."""
    for name in RANKED:
        export_fixture(name)
    ranks = run_on_ranks(2, greedy_on_rank, RANKED, LENGTHS, NEW, tmp=tmp_path)
    assert ranks[0] == ranks[1], "the ranks returned different tokens"
    for name in RANKED:
        config = Artifact.open(export_fixture(name)).config
        model, fmt, group = fixture_named(name).model(), config.weight_format, config.weight_group_size
        reference = dequantized_checkpoint(model, fmt, group, config.lm_head_format, config.int4_range)
        for length, tokens in ranks[0][name].items():
            assert tokens == hf_greedy(reference, prompt(length, length), NEW), (name, length)


def test_padded_chunk_writes_stay_bitwise_on_a_quantized_artifact() -> None:
    from tests.contract import kv_inspection

    engine = Engine(Artifact.open(export_fixture("llama-2x4x8-int4-eager")))
    kv_inspection.check_padded_chunk_writes_on(engine)


STORED = [("llama-2x4x8-int8-eager", torch.int8, 64), ("llama-2x4x8-int4-eager", torch.uint8, 32)]
"""A quantized fixture, the stored dtype of its quantized weights and the stored columns of a ``[*, 64]`` layer."""


@pytest.mark.parametrize(("name", "dtype", "columns"), STORED)
def test_artifact_stores_quantized_bytes_and_records_the_format(name: str, dtype: torch.dtype, columns: int) -> None:
    root = export_fixture(name)
    stored = load_file(str(root / WEIGHTS_FILE))
    config = Artifact.open(root).config
    q, scale = stored["model.layers.0.self_attn.q_proj.weight"], stored["model.layers.0.self_attn.q_proj.weight_scale"]
    assert (q.dtype, q.shape[1], scale.dtype) == (dtype, columns, torch.float32)
    assert scale.shape == (q.shape[0], 1 if config.weight_format == "int8" else 64 // config.weight_group_size)
    float_names = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight")
    assert all(stored[n].dtype == torch.float32 for n in float_names), "only the layers' linear weights are quantized"
    assert config.weight_format == fixture_named(name).weights
    assert (config.weight_group_size > 0) == (dtype == torch.uint8), "int4 records the group size it used"


HEADS = [("llama-2x4x8-int8-headint8-eager", "model.embed_tokens"), ("phi3-2x4x8-aten-int4-headint8-eager", "lm_head")]
"""A fixture with an int8 LM head and the weight that holds it: a tied embedding table, an untied head."""


@pytest.mark.parametrize(("name", "head"), HEADS)
def test_an_int8_lm_head_is_stored_once_per_vocabulary_row(name: str, head: str) -> None:
    """``--lm_head_format int8``: the head's weight is stored int8 with one scale per vocabulary row (the scheme's
    int8), a tied table only once; an untied model's embedding table stays float; the artifact records the format."""
    root = export_fixture(name)
    stored = load_file(str(root / WEIGHTS_FILE))
    q, scale = stored[f"{head}.weight"], stored[f"{head}.weight_scale"]
    assert (q.dtype, q.shape, scale.shape) == (torch.int8, (256, 64), (256, 1))
    float_weight = load_file(str(fixture_named(name).model() / "model.safetensors"))
    head_weight = float_weight.get("lm_head.weight", float_weight["model.embed_tokens.weight"])
    want_q, want_scale = quantize(head_weight, "int8", 64)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert "lm_head.weight" not in stored or head == "lm_head", "a tied table is stored once"
    if head == "lm_head":
        assert stored["model.embed_tokens.weight"].dtype == torch.float32, "an untied table stays float"
    assert Artifact.open(root).config.lm_head_format == "int8"


def test_the_full_int4_range_is_q4_0s_rule() -> None:
    """``--int4_range full``: the group's weight of largest magnitude gives ``scale = m / -8`` and lands on -8 exactly;
    every value in [-8, 7]; a zero group has scale 0; the error is at most half a step, as the symmetric scheme's."""
    torch.manual_seed(0)
    w = torch.randn(6, 64)
    w[2, :32] = 0
    w[3, 5] = 9.0  # a positive largest value: negative scale
    q, scale = quantize(w, "int4", 32, "full")
    assert scale[3, 0].item() == -9.0 / 8 and q[3, 5].item() == -8
    assert int(q.min()) == -8 and int(q.max()) <= 7 and scale[2, 0].item() == 0 and not q[2, :32].any()
    assert (dequantize(q, scale) - w).abs().max() <= scale.abs().max() / 2 + 1e-6
    levels = {int(v) for v in torch.unique(quantize(torch.randn(64, 256), "int4", 64, "full")[0])}
    assert levels == set(range(-8, 8)), "all 16 levels are used"


def test_the_scheme_is_the_documented_one() -> None:
    """int8: ``scale = max|row| / 127``; int4: ``scale = max|group| / 7``; ``q = round(w / scale)`` (half to even);
    a zero row gives zero scale and zero values; int4 values survive the two-per-byte storage."""
    torch.manual_seed(0)
    w = torch.randn(5, 64)
    w[3] = 0
    q, scale = quantize(w, "int8", 64)
    assert torch.equal(scale[:, 0], w.abs().amax(dim=1) / 127)
    assert torch.equal(q[[0, 1, 2, 4]].float(), torch.round(w[[0, 1, 2, 4]] / scale[[0, 1, 2, 4]]))
    assert not q[3].any() and scale[3].item() == 0
    q4, scale4 = quantize(w, "int4", 32)
    assert scale4.shape == (5, 2) and int(q4.abs().max()) == 7
    assert torch.equal(scale4[0, 1], w[0, 32:].abs().max() / 7)
    assert torch.equal(unpack_nibbles(pack_nibbles(q4)), q4)
    assert (dequantize(q4, scale4) - w).abs().max() <= scale4.max() / 2 + 1e-6


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"weight_format": "int3"}, "--weight_format"),
        ({"weight_format": "int8", "weight_group_size": 64}, "--weight_group_size"),
        ({"weight_format": "int4", "weight_group_size": 33}, "--weight_group_size"),
        ({"lm_head_format": "int4"}, "--lm_head_format"),
        ({"int4_range": "full"}, "--int4_range"),
        ({"weight_format": "int4", "int4_range": "asymmetric"}, "--int4_range"),
    ],
)
def test_bad_weight_flags_are_refused_naming_the_flag(fields: dict, message: str) -> None:
    with pytest.raises(IncompatibleConfigError, match=message):
        NeuronConfig(**fields)


def test_a_group_size_that_does_not_divide_is_refused_at_export(tmp_path: Path) -> None:
    from optimum.exporters.neuron.export import export

    config = fixture_named("llama-2x4x8-int4-eager").neuron_config().derive(weight_group_size=48)
    with pytest.raises(IncompatibleConfigError, match=r"weight_group_size=48 does not divide.*--weight_group_size"):
        export(fixture_named("llama-2x4x8-int4-eager").model(), tmp_path / "out", config)
