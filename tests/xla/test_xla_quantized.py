"""Quantized weights on the xla backend (``--weight_format int8 | int4``, an int8 LM head): the graph dequantizes
(``q * scale`` before the linear, the form NxD's quantized layers compile), each graph compiles once with no op falling
back to the CPU, and greedy tokens equal transformers' on the dequantized weights."""

from __future__ import annotations

import pytest

from optimum.neuron.artifact import Artifact
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import alone, prompt
from tests.fixtures.llm.models import export_fixture, fixture_named
from tests.fixtures.llm.reference import dequantized_checkpoint, hf_greedy
from tests.utils import subprocess_test
from tests.xla.test_xla_metrics import drive

pytestmark = pytest.mark.xla


@pytest.mark.slow
@subprocess_test
@pytest.mark.parametrize("name", ["llama-2x4x8-int8-xla", "llama-2x4x8-int4-xla", "llama-2x4x8-int8-headint8-xla"])
def test_quantized_xla_artifact_equals_transformers_one_compile_per_graph(name: str) -> None:
    from optimum.neuron.backends import xla_compat

    engine = Engine(Artifact.open(export_fixture(name)))
    config = engine.config
    assert not config.packed_linears, "xla dequantizes in the graph"
    model = fixture_named(name).model()
    reference = dequantized_checkpoint(model, config.weight_format, config.weight_group_size, config.lm_head_format)
    for length in (1, 9, 17):
        ids = prompt(length, length)
        assert alone(engine, ids, 6) == hf_greedy(reference, ids, 6), (name, length)
    drive(engine)
    graphs = len(engine.graphs)
    assert xla_compat.compile_count() == graphs, f"{xla_compat.compile_count()} compiles for {graphs} graphs"
    assert xla_compat.fallback_ops() == {}, "ops fell back to the CPU"
