"""The per-graph compile cache: each compiled graph is stored once, under a key of exactly what determines it, and
taken by every export that needs the same graph (another chunk size, another model with the same architecture,
another set of optional graphs).

Layout, under ``$OPTIMUM_NEURON_CACHE`` (`optimum.neuron.cache_dir`)::

    graphs/<key>/             the graph's files: <name><suffix> (an xla graph's HLO and constants beside it)
    graphs/<key>/entry.json   what the graph is: name, model, config slice, backend, compile time
    graphs/<key>.lock         held by the process compiling the graph (`cache_dir.cache_lock`)

An entry appears by renaming a finished ``<key>.tmp<pid>`` folder: a killed export leaves only that folder, which
no lookup reads and ``optimum-cli neuron cache prune`` / ``clear`` remove. An entry folder's modification time is
its last use: every export that takes the graph touches it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...neuron.backends.base import Backend
from ...neuron.cache_admin import ENTRY_FILE, GRAPHS
from ...neuron.cache_dir import cache_lock, cache_root
from ...neuron.config import NeuronConfig, runtime_versions
from ...neuron.errors import ExportError
from ...neuron.graphs import GraphSpec, compiled_form, graph_fields
from .cache import code_fingerprint

GRAPHS_FOLDER = GRAPHS
"""The per-graph cache's folder under the cache root (named once, in the torch-free `cache_admin`)."""
GRAPH_CACHE_SWITCH = "OPTIMUM_NEURON_GRAPH_CACHE"
"""Environment variable: ``off`` turns the per-graph cache off (`GraphCache.default`)."""
_MODEL_VOLATILE = (
    "_name_or_path",
    "transformers_version",
    "_commit_hash",
    "torch_dtype",
    "dtype",
    "quantization_config",
)
"""Keys of a transformers config that never reach a graph (where the checkpoint came from, the dtype it was saved
in: weights are cast to ``auto_cast_type``; how a pre-quantized checkpoint stores its weights: the graphs follow
``weight_format`` and ``weight_group_size``, which the export takes from it)."""


def spec_record(spec: GraphSpec) -> dict[str, Any]:
    """``spec`` as JSON-ready fields."""
    return {**dataclasses.asdict(spec), "kind": spec.kind.value, "windows": list(spec.windows)}


def model_record(hf_config: Any) -> dict[str, Any]:
    """The architecture of the transformers config ``hf_config``: what the graphs compute, not where it came from.
    Weight values never reach a graph (every backend binds the weights at load), so models of one architecture
    share their graphs."""
    return {k: v for k, v in hf_config.to_dict().items() if k not in _MODEL_VOLATILE}


def graph_key(spec: GraphSpec, config: NeuronConfig, hf_config: Any, backend: Backend) -> str:
    """The cache key of graph ``spec`` of ``config``'s export of the model ``hf_config``: the spec as compiled
    (`graphs.compiled_form`: not the artifact's chunk lengths or KV windows where they are symbolic), the config slice
    every graph depends on (`graphs.graph_fields`), the architecture (`model_record`), the code that shapes graphs
    (`cache.code_fingerprint`), the torch / backend versions and the compiler's target
    (`Backend.compiler_fingerprint`)."""
    payload = {
        "spec": spec_record(compiled_form(spec)),
        "config": graph_fields(config),
        "model": model_record(hf_config),
        "code": code_fingerprint(),
        "versions": runtime_versions(config.backend),
        "compiler": backend.compiler_fingerprint(config.device),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class GraphCache:
    """The per-graph cache in the folder ``root``."""

    root: Path

    @classmethod
    def default(cls) -> GraphCache | None:
        """The cache under ``$OPTIMUM_NEURON_CACHE``; None with ``OPTIMUM_NEURON_GRAPH_CACHE=off``: every export then
        compiles all of its graphs (the artifact cache still serves a whole artifact), as the exporter did before the
        per-graph cache, for measuring what the cache saves."""
        switch = os.environ.get(GRAPH_CACHE_SWITCH, "on")
        if switch not in ("on", "off"):
            raise ExportError(f"{GRAPH_CACHE_SWITCH}={switch!r}: use on (the default) or off.")
        return cls(cache_root() / GRAPHS_FOLDER) if switch == "on" else None

    def folder(self, key: str) -> Path:
        """The entry folder of ``key`` (it may not exist)."""
        return self.root / key

    def has(self, key: str) -> bool:
        """True when a finished graph is stored under ``key``."""
        return (self.folder(key) / ENTRY_FILE).is_file()

    def lock(self, key: str, wait: bool = True) -> Any:
        """The lock of ``key``'s entry (`cache_dir.cache_lock`): held while a process compiles the graph."""
        return cache_lock(self.root / f"{key}.lock", wait)

    @contextmanager
    def staging(self, key: str) -> Iterator[Path]:
        """A fresh private folder to compile ``key``'s graph into, removed on leaving unless `commit` moved it."""
        folder = self.root / f"{key}.tmp{os.getpid()}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def commit(self, key: str, staging: Path, record: dict[str, Any]) -> None:
        """Make the compiled ``staging`` folder ``key``'s entry, ``record`` written last (the caller holds the lock)."""
        (staging / ENTRY_FILE).write_text(json.dumps({**record, "key": key, "created": time.time()}, indent=1))
        shutil.rmtree(self.folder(key), ignore_errors=True)  # an unfinished folder left by hand: never an entry
        staging.rename(self.folder(key))

    def take(self, key: str, into: Path) -> bool:
        """Put the graph files of ``key``'s entry into the folder ``into`` (hard links where the file system allows,
        else copies: the artifact stays whole when the entry is pruned) and mark the entry used now; False when there
        is no such entry, or it was removed while being taken (``optimum-cli neuron cache prune`` in another
        process): the caller compiles the graph instead."""
        if not self.has(key):
            return False
        folder = self.folder(key)
        try:
            for source in sorted(folder.iterdir()):
                if source.name != ENTRY_FILE:
                    _link_or_copy(source, into / source.name)
            os.utime(folder)
        except FileNotFoundError:
            return False
        return True


def _link_or_copy(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
