"""What the compile cache holds and removing it (``optimum-cli neuron cache list | clear | prune``): its entries, the
disk they take (hard-linked files counted once), least-recently-used order, and removal under each entry's lock.
Imports no torch, so that the CLI answers at once.

The exporter writes two kinds of entries under the cache root (`cache_dir.cache_root`)::

    exports/<key>/          an artifact (`optimum.exporters.neuron.export`): neuron_config.json, config.json, the
                            weights, graphs/<name><suffix> and graphs/manifest.json (each graph's cache_key)
    graphs/<key>/           one compiled graph (`optimum.exporters.neuron.graph_cache`) and its entry.json
    <kind>/<key>.lock       the entry's lock, held while a process builds it
    <kind>/<key>.tmp<pid>   an entry being built by process <pid>, or left by a killed one

An artifact's graph files are hard links of its graph entries' files where the file system allows. An entry folder's
modification time is its last use. ``inductor/``, ``kernels/`` and ``calibrated/`` are scratch caches (removed by
``clear --all``);
everything else under the root (``models/``, ``fixtures/``, ``peers/``) is never touched here.

An entry is removed only while this process holds its lock (never one another process is building), by renaming it
to ``<key>.tmp<pid>`` first: readers see it whole or not at all, and a removal killed halfway leaves only a stale
``.tmp`` folder, which the next ``clear`` or ``prune`` removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache_dir import cache_lock, cache_root
from .errors import CacheError

EXPORTS = "exports"
"""The artifacts' folder under the cache root (`optimum.exporters.neuron.export.cached_export` builds there)."""
GRAPHS = "graphs"
"""The graph entries' folder under the cache root (`optimum.exporters.neuron.graph_cache` builds there)."""
CALIBRATED = "calibrated"
"""GPTQ's chosen weights, one ``<key>.safetensors`` per checkpoint and quantization (`optimum.neuron.gptq`): exports
of one checkpoint at other shapes take them instead of calibrating again."""
SCRATCH = ("inductor", "kernels", CALIBRATED)
"""Scratch caches rebuilt on demand: inductor's own cache, the packed CPU kernel's build and GPTQ's chosen weights
(``clear --all``)."""
ENTRY_FILE = "entry.json"
"""A graph entry's record, written last by the exporter (`graph_cache.GraphCache.commit`): a folder without it is no
entry."""
CONFIG_FILE = "neuron_config.json"
"""An artifact's `NeuronConfig` (`config.CONFIG_FILE`)."""
MANIFEST = "graphs/manifest.json"
"""An artifact's manifest (`artifact.GRAPHS_DIR` / `artifact.MANIFEST_FILE`)."""
ARTIFACT_FIELDS = ("batch_size", "sequence_length", "prefill_chunk_size", "auto_cast_type", "backend", "device")
"""The `NeuronConfig` fields ``list`` shows for each artifact."""
_STAGING = re.compile(r"^(?P<key>.+)\.tmp(?P<pid>\d+)$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Entry:
    """One cache entry: an artifact (``kind`` "artifact") or a compiled graph ("graph")."""

    kind: str
    key: str
    path: Path
    last_use: float
    """The folder's modification time (seconds since the epoch)."""
    files: dict[tuple[int, int], int]
    """Bytes of each of its files, by (device, inode): a file hard-linked elsewhere has the same one."""
    info: dict[str, Any]
    """What ``list`` shows: an artifact's config fields and graphs, a graph's entry.json."""

    @property
    def size(self) -> int:
        """Bytes of the entry's files."""
        return sum(self.files.values())

    @property
    def lock(self) -> Path:
        """The entry's lock file."""
        return self.path.with_name(f"{self.key}.lock")


@dataclass(frozen=True)
class Staging:
    """A ``<key>.tmp<pid>`` folder: an entry being built by process ``pid``, or left by one that was killed."""

    path: Path
    key: str
    pid: int
    size: int

    @property
    def lock(self) -> Path:
        """The lock its builder holds while building."""
        return self.path.with_name(f"{self.key}.lock")


@dataclass(frozen=True)
class CacheState:
    """The cache under ``root`` as scanned: its entries and the folders being built."""

    root: Path
    artifacts: list[Entry]
    graphs: list[Entry]
    staging: list[Staging]

    @property
    def entries(self) -> list[Entry]:
        """Artifacts and graph entries together."""
        return self.artifacts + self.graphs

    def references(self, graph_key: str) -> list[str]:
        """The keys of the artifacts whose manifest names the graph entry ``graph_key``."""
        return [a.key for a in self.artifacts if graph_key in a.info["graphs"].values()]


@dataclass
class Report:
    """What a ``clear`` or ``prune`` removed (or, dry, would remove), and what it had to keep."""

    removed: list[tuple[Path, int]] = field(default_factory=list)
    """Each removed folder and the bytes its removal freed."""
    kept: list[tuple[Path, str]] = field(default_factory=list)
    """Each folder kept and why (in use by another process)."""
    total_after: int = 0
    """Bytes the artifacts and graph entries take afterwards, counted once."""

    @property
    def freed(self) -> int:
        """Bytes freed in all."""
        return sum(size for _, size in self.removed)


def scan(root: Path | None = None) -> CacheState:
    """The entries of the cache under ``root`` (default `cache_dir.cache_root`)."""
    root = cache_root() if root is None else root
    artifacts = [_artifact(path) for path in _folders(root / EXPORTS)]
    graphs = [_graph(path) for path in _folders(root / GRAPHS)]
    staging = [_staging(path) for kind in (EXPORTS, GRAPHS) for path in _folders(root / kind, staging=True)]
    return CacheState(root, artifacts, graphs, staging)


def total_bytes(entries: Iterable[Entry]) -> int:
    """Bytes the ``entries`` take on disk, a file hard-linked by several of them counted once."""
    files: dict[tuple[int, int], int] = {}
    for entry in entries:
        files.update(entry.files)
    return sum(files.values())


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist), each hard-linked file counted once."""
    return sum(_files(path).values())


def _folders(parent: Path, staging: bool = False) -> list[Path]:
    """The entry folders (or, with ``staging``, the ``.tmp<pid>`` folders) directly under ``parent``."""
    if not parent.is_dir():
        return []
    found = [p for p in parent.iterdir() if p.is_dir() and not p.is_symlink()]
    return sorted(p for p in found if bool(_STAGING.match(p.name)) == staging)


def _files(path: Path) -> dict[tuple[int, int], int]:
    """Bytes of every regular file under ``path`` by (device, inode); files vanishing meanwhile are skipped."""
    files: dict[tuple[int, int], int] = {}
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                stat = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            files[(stat.st_dev, stat.st_ino)] = stat.st_size
    return files


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when missing or unreadable (an unfinished entry is still listed)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _artifact(path: Path) -> Entry:
    config, model = _read_json(path / CONFIG_FILE), _read_json(path / "config.json")
    keys = _graph_keys(_read_json(path / MANIFEST).get("graphs"))
    architectures = model.get("architectures") or []
    info = {
        "model_type": model.get("model_type"),
        "architecture": architectures[0] if architectures else None,
        **{name: config.get(name) for name in ARTIFACT_FIELDS},
        "graphs": keys or dict.fromkeys(config.get("graphs") or []),
    }
    return Entry("artifact", path.name, path, _mtime(path), _files(path), info)


def _graph_keys(graphs: Any) -> dict[str, str | None]:
    """Each graph's cache key in an artifact manifest's ``graphs`` (none for a manifest older than the graph cache)."""
    if not isinstance(graphs, dict):
        return {}
    return {name: graph.get("cache_key") for name, graph in graphs.items() if isinstance(graph, dict)}


def _graph(path: Path) -> Entry:
    record = _read_json(path / ENTRY_FILE)
    fields = ("graph", "model", "model_type", "backend", "device", "compile_seconds", "created")
    return Entry("graph", path.name, path, _mtime(path), _files(path), {name: record.get(name) for name in fields})


def _staging(path: Path) -> Staging:
    match = _STAGING.match(path.name)
    assert match is not None, path
    return Staging(path, match["key"], int(match["pid"]), folder_bytes(path))


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` runs on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- removal --------------------------------------------------------------------------------


def _lock_is_free(lock: Path) -> bool:
    """True when no process holds ``lock`` (a missing lock file is free); takes it for an instant."""
    if not lock.exists():
        return True
    with cache_lock(lock, wait=False) as held:
        return held


def remove_under_lock(path: Path, lock: Path, dry_run: bool = False) -> bool:
    """Remove ``path`` (a folder or file), then its ``lock`` file, while holding ``lock``; False, removing nothing,
    when another process holds it. With ``dry_run``, only whether it could be removed."""
    if dry_run:
        return _lock_is_free(lock)
    with cache_lock(lock, wait=False) as held:
        if not held:
            return False
        _discard(path)
        lock.unlink(missing_ok=True)  # safe under the lock: a waiter on it locks a fresh file (`cache_lock`)
    return True


def _discard(path: Path) -> None:
    """Delete ``path``; a folder is first renamed to a ``.tmp<pid>`` folder of this process, so that no reader sees
    half of it and a removal killed halfway leaves only a stale ``.tmp`` folder."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    if not path.exists():
        return
    doomed = path if _STAGING.match(path.name) else path.with_name(f"{path.name}.tmp{os.getpid()}")
    if doomed != path:
        shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(max_size: int, root: Path | None = None, dry_run: bool = False) -> Report:
    """Remove stale ``.tmp`` folders, then artifacts and graph entries, least recently used first (one order over
    both kinds), until they take at most ``max_size`` bytes; entries another process holds are kept. With
    ``dry_run``, only say what would go."""
    state = scan(root)
    report = Report()
    _remove_staging(state.staging, report, dry_run)
    _remove_entries(sorted(state.entries, key=_lru_order), max_size, report, dry_run)
    if not dry_run:
        _remove_orphan_locks(state.root)
    return report


def clear(root: Path | None = None, everything: bool = False) -> Report:
    """Remove every artifact and graph entry, their lock files and the stale ``.tmp`` folders; with
    ``everything``, the scratch caches too (`SCRATCH`). Entries another process holds are kept."""
    state = scan(root)
    report = Report()
    _remove_staging(state.staging, report, dry_run=False)
    _remove_entries(state.entries, -1, report, dry_run=False)
    _remove_orphan_locks(state.root)
    if everything:
        for name in SCRATCH:
            _clear_scratch(state.root / name, report)
    return report


def _lru_order(entry: Entry) -> tuple[float, str, str]:
    return entry.last_use, entry.kind, entry.key


def _remove_entries(entries: list[Entry], limit: int, report: Report, dry_run: bool) -> None:
    """Remove ``entries`` in their order while they take more than ``limit`` bytes (counted once); each removal
    frees the bytes of the files no remaining entry shares."""
    links = Counter(inode for entry in entries for inode in entry.files)
    total = total_bytes(entries)
    for entry in entries:
        if total <= limit:
            break
        if not remove_under_lock(entry.path, entry.lock, dry_run):
            report.kept.append((entry.path, "in use by another process"))
            continue
        links.subtract(entry.files.keys())
        freed = sum(size for inode, size in entry.files.items() if links[inode] == 0)
        total -= freed
        report.removed.append((entry.path, freed))
    report.total_after = total


def _remove_staging(staging: list[Staging], report: Report, dry_run: bool) -> None:
    """Remove the ``.tmp<pid>`` folders left by processes that are gone (their pid dead, their key's lock free)."""
    for folder in staging:
        if not pid_alive(folder.pid) and remove_under_lock(folder.path, folder.lock, dry_run):
            report.removed.append((folder.path, folder.size))
        else:
            report.kept.append((folder.path, f"being built by process {folder.pid}"))


def _remove_orphan_locks(root: Path) -> None:
    """Remove the lock files whose entry does not exist (a build that failed, an entry removed by hand); a lock held
    by a process building its entry is kept."""
    for kind in (EXPORTS, GRAPHS):
        folder = root / kind
        for lock in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
            if not lock.with_name(lock.name.removesuffix(".lock")).exists():
                remove_under_lock(lock, lock)


def _clear_scratch(folder: Path, report: Report) -> None:
    """Remove what a scratch cache holds, each item under its ``<name>.lock`` (a kernel being built is kept)."""
    if not folder.is_dir():
        return
    for child in sorted(folder.iterdir()):
        if child.suffix == ".lock":
            continue
        size = folder_bytes(child) if child.is_dir() else child.lstat().st_size
        if remove_under_lock(child, child.with_name(f"{child.name}.lock")):
            report.removed.append((child, size))
        else:
            report.kept.append((child, "in use by another process"))


# --- sizes ----------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes of a size written as bytes or a number with a unit K, M, G or T (powers of 1024), optionally followed by
    B or iB: ``2G``, ``500M``, ``1.5GB``, ``10GiB``, ``1048576``. `CacheError` otherwise."""
    match = _SIZE.match(text)
    if match is None:
        raise CacheError(
            f"{text!r} is not a size: write bytes or a number with K, M, G or T (powers of 1024), e.g. 2G, 500M, "
            "1.5GB or 1048576."
        )
    return int(float(match["number"]) * _UNITS[match["unit"].upper()])


def format_size(size: int) -> str:
    """``size`` bytes for people: ``46 B``, ``1.5 KiB``, ``812.0 MiB``, ``2.3 GiB``."""
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
