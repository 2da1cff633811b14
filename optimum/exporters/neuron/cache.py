"""The code fingerprint that keys the export cache (where the cache lives: `optimum.neuron.cache_dir`).

The export cache key (`NeuronConfig.cache_key`) hashes the config, the checkpoint's files, the backend's
versions and `code_fingerprint`: the sources that shape a compiled graph or the files written beside it,
and nothing else. Editing the runtime, the vLLM plugin, the demo or a docstring reuses the cached
exports; editing a model, a layer, a backend, the graph signatures, the weight map, the config, the
artifact format or the exporter recompiles.
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

from ...neuron.cache_dir import cache_lock, cache_root

__all__ = ["GRAPH_SOURCES", "PACKAGE_ROOT", "cache_lock", "cache_root", "code_fingerprint", "sources_fingerprint"]
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The ``optimum`` folder this toolkit is imported from."""
GRAPH_SOURCES = (
    "neuron/models",
    "neuron/kernels",
    "neuron/backends",
    "neuron/graphs.py",
    "neuron/weights.py",
    "neuron/config.py",
    "neuron/artifact.py",
    "neuron/quantization.py",
    "neuron/prequantized.py",
    "neuron/gptq.py",
    "exporters/neuron",
)
"""What `code_fingerprint` hashes, relative to `PACKAGE_ROOT`: folders (their ``*.py``) and files."""


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """`sources_fingerprint` of the installed toolkit (computed once per process)."""
    return sources_fingerprint(PACKAGE_ROOT)


def sources_fingerprint(root: Path) -> str:
    """Hash of the `GRAPH_SOURCES` under ``root`` (an ``optimum`` folder), by their code: comments,
    docstrings and formatting do not count."""
    digest = hashlib.sha256()
    for path in _graph_sources(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + _code_of(path).encode() + b"\0")
    return digest.hexdigest()[:16]


def _graph_sources(root: Path) -> list[Path]:
    paths: list[Path] = []
    for name in GRAPH_SOURCES:
        source = root / name
        paths.extend(sorted(source.rglob("*.py")) if source.is_dir() else [source])
    return paths


def _code_of(path: Path) -> str:
    """The syntax tree of ``path`` without its docstrings (module, class, function and attribute ones:
    every statement that is a bare string), as text."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [s for s in body if not _is_docstring(s)] or [ast.Pass()]  # type: ignore[attr-defined]
    return ast.dump(tree)


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
