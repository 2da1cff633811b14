"""GPTQ (``--quantization_method gptq``, `optimum.neuron.gptq`): the rule (a diagonal input correlation leaves
rounding to nearest; correlated inputs get smaller output errors than rounding; searched scales never do worse than
the scheme's); a GPTQ artifact computes what transformers computes on the checkpoint with its stored values times
scales (int4 symmetric and full range, int8 fused projections, a mixture of experts, sliding and global layers),
stores other values than rounding, in range, records the method and shares the rounded export's graphs; the flag is
refused where it cannot apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from optimum.neuron.artifact import WEIGHTS_FILE, Artifact
from optimum.neuron.config import NeuronConfig
from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.gptq import calibration_ids, gptq, searched_scale
from optimum.neuron.graphs import graph_fields
from optimum.neuron.quantization import base_scale, dequantize, quantize, round_to
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import check_against_transformers
from tests.fixtures.llm.models import GPTQ_FIXTURES, export_fixture, fixture_named
from tests.fixtures.llm.reference import stored_checkpoint, stored_values

NAMES = [fixture.name for fixture in GPTQ_FIXTURES]
LENGTHS = (1, 9, 17)
"""Prompt lengths: within one chunk, a chunk and a row, two chunks and a row (C = 8)."""
NEW = 6
LOGIT_TOLERANCE = 1e-4
"""Max abs difference from transformers on the stored weights (as `test_quantized`'s)."""


def correlated_inputs(rows: int, columns: int) -> torch.Tensor:
    """``[rows, columns]`` inputs whose columns correlate (mixed from a few sources), as a layer's inputs do."""
    generator = torch.Generator().manual_seed(1)
    sources = torch.randn(rows, columns // 4, generator=generator)
    return sources @ torch.randn(columns // 4, columns, generator=generator) + 0.1 * torch.randn(
        rows, columns, generator=generator
    )


@pytest.mark.parametrize(
    ("fmt", "group", "int4_range"), [("int4", 32, "symmetric"), ("int4", 32, "full"), ("int8", 64, "symmetric")]
)
def test_uncorrelated_inputs_leave_rounding_to_nearest(fmt: str, group: int, int4_range: str) -> None:
    """With a diagonal ``X^T X`` no column's error can be made up by another: GPTQ's values are the searched
    scales' rounded ones, in the scheme's range."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    hessian = torch.diag(torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5)
    q, scale = gptq(weight, hessian, fmt, group, int4_range)
    searched, low, high = searched_scale(weight, fmt, group, int4_range, torch.diag(hessian))
    assert torch.equal(scale, searched)
    want = round_to(weight.reshape(16, -1, group), searched[..., None], low, high).reshape(16, 64)
    assert torch.equal(q.float(), want)
    assert int(q.min()) >= low and int(q.max()) <= high


@pytest.mark.parametrize(("fmt", "int4_range"), [("int4", "symmetric"), ("int4", "full"), ("int8", "symmetric")])
def test_correlated_inputs_get_smaller_output_errors_than_rounding(fmt: str, int4_range: str) -> None:
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    x = correlated_inputs(512, 128)
    group = 32 if fmt == "int4" else 128
    q, scale = gptq(weight, x.T @ x, fmt, group, int4_range)
    gptq_error = (x @ (weight - dequantize(q, scale)).T).square().sum()
    rounded_error = (x @ (weight - dequantize(*quantize(weight, fmt, group, int4_range))).T).square().sum()
    assert gptq_error < 0.8 * rounded_error, (float(gptq_error), float(rounded_error))


def test_searched_scales_never_do_worse_than_the_schemes() -> None:
    """The scheme's scale is a candidate: each group's weighted error with the searched scale is at most its own."""
    weight = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    weight[0, 5] = 12.0  # an outlier: a smaller scale clips it and keeps the group's other weights finer
    importance = torch.rand(128, generator=torch.Generator().manual_seed(4))
    for fmt, group, int4_range in (("int4", 64, "symmetric"), ("int4", 64, "full"), ("int8", 128, "symmetric")):
        grouped = weight.reshape(8, -1, group)
        scheme, low, high = base_scale(grouped, fmt, int4_range)
        searched, _, _ = searched_scale(weight, fmt, group, int4_range, importance)

        weights = importance.reshape(1, -1, group)
        errors = [
            ((grouped - round_to(grouped, s[..., None], low, high) * s[..., None]).square() * weights).sum(dim=-1)
            for s in (searched, scheme)
        ]
        assert bool((errors[0] <= errors[1]).all())
        assert bool((searched.abs() <= scheme.abs()).all())
    assert (
        searched_scale(weight, "int4", 64, "symmetric", importance)[0][0, 0]
        < base_scale(weight.reshape(8, 2, 64), "int4")[0][0, 0]
    )


def test_calibration_text_is_the_standard_librarys_docstrings() -> None:
    from transformers import AutoTokenizer

    from tests.fixtures.llm.models import tiny_model

    ids = calibration_ids(AutoTokenizer.from_pretrained(tiny_model("llama")), sequences=4, tokens=64)
    assert ids.shape == (4, 64) and ids.dtype == torch.int64


@pytest.mark.parametrize("name", NAMES)
def test_a_gptq_artifact_equals_transformers_on_its_stored_weights(name: str) -> None:
    root = export_fixture(name)
    engine = Engine(Artifact.open(root))
    fixture = fixture_named(name)
    reference = stored_checkpoint(fixture.model(), root)
    check_against_transformers(engine, reference, LENGTHS, NEW, LOGIT_TOLERANCE, name)


@pytest.mark.parametrize("name", NAMES)
def test_a_gptq_artifact_stores_chosen_values_in_the_scheme(name: str) -> None:
    """Other values than rounding to nearest (GPTQ ran), each in the scheme's range; the method is recorded."""
    root = export_fixture(name)
    config = Artifact.open(root).config
    stored = load_file(str(root / WEIGHTS_FILE))
    float_weights = load_file(str(fixture_named(name).model() / "model.safetensors"))
    values = stored_values(stored)
    assert values and config.quantization_method == "gptq"
    low = -8 if config.int4_range == "full" else -7 if config.weight_format == "int4" else -127
    changed = 0
    for layer, (q, _) in values.items():
        assert int(q.min()) >= low and int(q.max()) <= -low - (low == -8)
        group = config.weight_group_size if config.weight_format == "int4" else q.shape[1]
        rounded, _ = quantize(float_weights[f"{layer}.weight"], config.weight_format, group, config.int4_range)
        changed += int(not torch.equal(q, rounded))
    assert changed == len(values), f"GPTQ left {len(values) - changed} of {len(values)} layers rounded to nearest"


def test_gptq_shares_the_rounded_exports_graphs() -> None:
    rounded = fixture_named("llama-2x4x8-int4-eager").neuron_config()
    assert graph_fields(rounded.derive(quantization_method="gptq")) == graph_fields(rounded)


def test_gptq_without_a_quantized_format_is_refused_naming_the_flag() -> None:
    with pytest.raises(IncompatibleConfigError, match=r"quantization_method='gptq'.*--weight_format int8 or int4"):
        NeuronConfig(quantization_method="gptq")
    with pytest.raises(IncompatibleConfigError, match="--quantization_method"):
        NeuronConfig(weight_format="int8", quantization_method="awq")


def test_another_export_of_the_same_quantization_takes_the_calibrated_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calibration cache: an export at another batch size runs no calibration and stores the same values."""
    from optimum.exporters.neuron import export as exporter

    name = "llama-2x4x8-int4-gptq-eager"
    first = load_file(str(export_fixture(name) / WEIGHTS_FILE))

    def refuse(*args: object) -> None:
        raise AssertionError("calibrated again")

    monkeypatch.setattr(exporter, "calibrate", refuse)
    fixture = fixture_named(name)
    out = exporter.export(fixture.model(), tmp_path / "batch1", fixture.neuron_config().derive(batch_size=1))
    second = load_file(str(out / WEIGHTS_FILE))
    assert second.keys() == first.keys() and all(torch.equal(second[k], first[k]) for k in first)


def test_an_image_text_gptq_artifact_equals_transformers_on_its_stored_weights() -> None:
    """Idefics3: the calibration runs the text decoder of a vision-language model (text only); its artifact, fed a
    prompt with an image, gives transformers' greedy tokens on the checkpoint whose text layers hold the stored
    ``q * scale``."""
    from transformers import Idefics3ForConditionalGeneration

    from optimum.neuron import NeuronModelForImageTextToText
    from tests.fixtures.llm.idefics3 import NEW_TOKENS, idefics3_export, inputs, our_tokens, tiny_idefics3

    root = idefics3_export(24, weight_format="int4", quantization_method="gptq")
    stored = load_file(str(root / WEIGHTS_FILE))
    hf = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3(), dtype=torch.float32).eval()  # a private copy
    layers = hf.get_decoder().layers
    with torch.no_grad():
        for layer, (q, scale) in stored_values(stored).items():
            index, suffix = layer.removeprefix("model.layers.").split(".", 1)
            layers[int(index)].get_submodule(suffix).weight.copy_(dequantize(q, scale))
    batch = inputs(["hello the <image> what is this"], [[0]])
    want = hf.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    got = our_tokens(NeuronModelForImageTextToText.from_pretrained(root), batch)
    assert got == want[:, batch["input_ids"].shape[1] :].tolist()
