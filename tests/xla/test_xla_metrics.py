"""The xla backend's static graphs, measured with torch-xla's metrics in a fresh process: a loaded
artifact compiles each graph exactly once whatever the prompt lengths, positions and slots, no op
falls back to the CPU, and every KV cache tensor is donated (aliased) to the graph's output."""

from __future__ import annotations

import pytest

from optimum.neuron.artifact import Artifact
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sampling import SamplingParams
from tests.contract.engine_tools import GREEDY, fixture_name, prompt
from tests.fixtures.llm.models import export_fixture
from tests.models.exports import CHUNK
from tests.utils import subprocess_test

pytestmark = pytest.mark.xla


def drive(engine: Engine) -> None:
    """Prefill prompts of boundary lengths, decode with every set of decoding slots, prefill a prompt in the same
    step as a decode (a chunk beside it, for a chunked artifact), and run every graph in each of its KV windows
    (a chunk starting past the small window, decodes inside and past it)."""
    sampled = SamplingParams(True, 0.7, 20, 0.9, 3)
    for index, length in enumerate((1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1, 3 * CHUNK + 1)):
        engine.admit(index, prompt(length, index), sampled if index % 2 else GREEDY, reuse=False)  # runs twice
        engine.step({index: length})
        if index < 4:
            engine.release(index)
    for work in ({4: 1}, {5: 1}, {4: 1, 5: 1}):
        engine.step(work)
    engine.release(4)
    engine.admit(6, prompt(2 * CHUNK + 3, 6), GREEDY, reuse=False)
    engine.step({5: 1, 6: CHUNK if engine.config.prefill_chunk_size else 2 * CHUNK + 3})
    engine.release(5)
    engine.release(6)
    engine.admit(7, prompt(3, 7), GREEDY, reuse=False)
    engine.step({7: 3})
    engine.step({7: 1})  # a decode in the smallest window
    engine.release(7)


@pytest.mark.slow
@subprocess_test
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "ce"])
def test_one_compile_per_graph_no_fallback_cache_aliased(chunked: bool) -> None:
    from optimum.neuron.backends import xla_compat

    artifact = Artifact.open(export_fixture(fixture_name("llama", "xla", chunked)))  # exporting compiles nothing
    assert xla_compat.compile_count() == 0, "export or load compiled a graph"
    engine = Engine(artifact)
    drive(engine)
    graphs = len(engine.graphs)
    assert xla_compat.compile_count() == graphs, f"{xla_compat.compile_count()} compiles for {graphs} graphs"
    assert xla_compat.fallback_ops() == {}, "ops fell back to the CPU"
    assert xla_compat.alias_count() == graphs * len(engine.kv_cache), "a KV cache tensor was copied, not donated"
    drive(engine)
    assert xla_compat.compile_count() == graphs, "a second round recompiled"
