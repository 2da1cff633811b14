"""The export cache key covers exactly what changes a compiled graph (or the files written beside it).

Both directions are pinned on a copy of the toolkit's sources: an edit to the exporter, a model, a
layer, a backend, the graph signatures, the weight map, the config or the artifact format misses the
cache; an edit to the runtime, the vLLM plugin, the demo, or a docstring or comment anywhere hits it.
The end-to-end test runs real (eager) exports against such a copy, and checks the per-graph cache the same way.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from optimum.exporters.neuron import cache as export_cache
from optimum.exporters.neuron import export as export_module
from optimum.exporters.neuron import graph_cache
from optimum.exporters.neuron.cache import GRAPH_SOURCES, PACKAGE_ROOT, code_fingerprint, sources_fingerprint
from optimum.neuron import cache_dir
from optimum.neuron.config import NeuronConfig
from tests.fixtures.llm.models import tiny_model

MISSES = [
    "exporters/neuron/export.py",
    "neuron/models/base.py",
    "neuron/models/layers/attention.py",
    "neuron/backends/inductor.py",
    "neuron/graphs.py",
    "neuron/weights.py",
    "neuron/config.py",
    "neuron/artifact.py",
    "neuron/quantization.py",
    "neuron/models/layers/quantized.py",
]
HITS = [
    "neuron/runtime/engine.py",
    "neuron/runtime/padding.py",
    "neuron/vllm/runner.py",
    "neuron/demo.py",
    "neuron/modeling.py",
    "neuron/smollm2.py",
    "neuron/cache_dir.py",
]


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A private copy of the ``optimum`` source folder."""
    copy = tmp_path / "optimum"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def edit_code(path: Path) -> None:
    path.write_text(path.read_text() + "\n_EDITED = 1\n")


def test_installed_sources_are_the_ones_hashed() -> None:
    assert code_fingerprint() == sources_fingerprint(PACKAGE_ROOT)
    assert all((PACKAGE_ROOT / name).exists() for name in GRAPH_SOURCES), "a hashed source was moved"


@pytest.mark.parametrize("name", MISSES)
def test_code_that_shapes_a_graph_changes_the_key(sources: Path, name: str) -> None:
    before = sources_fingerprint(sources)
    edit_code(sources / name)
    assert sources_fingerprint(sources) != before, name


@pytest.mark.parametrize("name", HITS)
def test_code_that_runs_or_serves_leaves_the_key(sources: Path, name: str) -> None:
    before = sources_fingerprint(sources)
    edit_code(sources / name)
    assert sources_fingerprint(sources) == before, name


def test_docstrings_and_comments_leave_the_key(sources: Path) -> None:
    before = sources_fingerprint(sources)
    config = sources / "neuron/config.py"
    text = config.read_text()
    edited = text.replace('"""Number of KV-cache slots', '"""The number of KV-cache slots', 1)
    assert edited != text
    config.write_text(edited.replace("from __future__ import annotations", "from __future__ import annotations  # x"))
    layer = sources / "neuron/models/layers/masks.py"
    layer.write_text(layer.read_text().replace('"""Attention masks', '"""The attention masks', 1))
    assert sources_fingerprint(sources) == before


def test_export_cache_hits_and_misses(sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real exports against the copied sources: a runtime edit is a hit for the artifact and each of its graphs, a
    model-code edit a miss for both, an exporter edit a miss."""
    monkeypatch.setenv("OPTIMUM_NEURON_CACHE", str(tmp_path / "cache"))
    fingerprint = lambda: sources_fingerprint(sources)  # noqa: E731
    monkeypatch.setattr(export_module, "code_fingerprint", fingerprint)
    monkeypatch.setattr(graph_cache, "code_fingerprint", fingerprint)
    config = NeuronConfig(batch_size=2, sequence_length=32, prefill_chunk_size=8, backend="eager", decode_logits=False)

    def exports() -> tuple[int, int]:
        export_module.export(tiny_model("llama"), tmp_path / "out", config)
        cache = tmp_path / "cache"
        artifacts = [p for p in (cache / "exports").iterdir() if p.is_dir()]
        graphs = [p for p in (cache / "graphs").iterdir() if (p / graph_cache.ENTRY_FILE).is_file()]
        return len(artifacts), len(graphs)

    assert exports() == (1, 2)
    edit_code(sources / "neuron/runtime/engine.py")
    assert exports() == (1, 2), "a runtime edit recompiled"
    edit_code(sources / "neuron/models/layers/attention.py")
    assert exports() == (2, 4), "a model-code edit reused stale graphs"
    edit_code(sources / "exporters/neuron/export.py")
    assert exports() == (3, 6), "an exporter edit reused a stale export"


def test_the_cache_location_rule_lives_outside_the_exporter() -> None:
    """One cache-location rule (`optimum.neuron.cache_dir`): the exporter uses it, and the runtime-side tools find the
    cache without importing the exporter's cache module."""
    assert export_cache.cache_root is cache_dir.cache_root and export_cache.cache_lock is cache_dir.cache_lock
    for name in ("smollm2.py", "demo.py"):
        assert "exporters.neuron.cache" not in (PACKAGE_ROOT / "neuron" / name).read_text(), name
