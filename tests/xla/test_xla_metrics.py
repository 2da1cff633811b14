"""The xla backend's static graphs, measured with torch-xla's metrics in a fresh process: a loaded
artifact compiles each graph exactly once whatever the prompt lengths, positions and slots, no op
falls back to the CPU, and every KV cache tensor is donated (aliased) to the graph's output."""

from __future__ import annotations

import pytest

from optimum.neuron.graphs import graph_kinds
from optimum.neuron.runtime.artifacts import Artifact
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sampling import SamplingParams, SequenceSampler
from tests.contract.engine_tools import fixture_name, prompt
from tests.fixtures.llm.models import export_fixture
from tests.models.exports import CHUNK
from tests.utils import subprocess_test

pytestmark = pytest.mark.xla


def drive(engine: Engine) -> None:
    """Prefill prompts of boundary lengths into both slots, then decode with every set of active slots."""
    chunked = engine.config.prefill_chunk_size > 0
    for slot, length in enumerate((1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1, 3 * CHUNK)):
        engine.prefill(prompt(length, slot), slot % 2)
    if chunked:
        engine.prefill_chunk(prompt(3, 9), [20, 21, 22], 1)
    sampling = {0: SequenceSampler(SamplingParams()), 1: SequenceSampler(SamplingParams(True, 0.7, 20, 0.9, 3))}
    for active in ({0: (5, 20)}, {1: (6, 25)}, {0: (7, 22), 1: (8, 26)}, {}):
        engine.decode(active, {s: sampling[s] for s in active})


@pytest.mark.slow
@subprocess_test
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "ce"])
def test_one_compile_per_graph_no_fallback_cache_aliased(chunked: bool) -> None:
    from optimum.neuron.backends import xla_compat

    artifact = Artifact.open(export_fixture(fixture_name("llama", "xla", chunked)))  # exporting compiles nothing
    assert xla_compat.compile_count() == 0, "export or load compiled a graph"
    engine = Engine(artifact)
    drive(engine)
    graphs = len(graph_kinds(engine.config))
    assert xla_compat.compile_count() == graphs, f"{xla_compat.compile_count()} compiles for {graphs} graphs"
    assert xla_compat.fallback_ops() == {}, "ops fell back to the CPU"
    assert xla_compat.alias_count() == graphs * len(engine.kv_cache), "a KV cache tensor was copied, not donated"
    drive(engine)
    assert xla_compat.compile_count() == graphs, "a second round recompiled"
