"""Where this toolkit keeps what it builds: the one cache-location rule, shared by the exporter (export cache,
inductor's cache) and the runtime-side tools (the SmolLM2 conversion, the demo), which must not import the
exporter to find it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_DEFAULT = Path.home() / ".cache" / "optimum-neuron"


def cache_root() -> Path:
    """``$OPTIMUM_NEURON_CACHE`` or ``~/.cache/optimum-neuron`` (created); also hosts inductor's own cache
    (``TORCHINDUCTOR_CACHE_DIR``, unless already set)."""
    root = Path(os.environ.get("OPTIMUM_NEURON_CACHE", _DEFAULT))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return root


@contextmanager
def cache_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on the lock file ``path`` (created if needed) across processes: one process
    builds a cache entry while the others wait, then find it built. With ``wait=False`` the block runs at once and
    is given False when another process holds the lock (then nothing is held), True when this one took it.

    The holder may delete ``path`` (`optimum.neuron.cache_admin` does, removing an entry): a process that was
    waiting on the deleted file sees it is no longer the one at ``path`` once it gets it, and locks ``path`` anew."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        with path.open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            if not _is_file_at(handle.fileno(), path):
                continue  # closing the handle releases the lock on the deleted file
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
            return


def _is_file_at(descriptor: int, path: Path) -> bool:
    """True when the open file ``descriptor`` is the file now at ``path`` (not one deleted or replaced since)."""
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (opened.st_dev, opened.st_ino) == (current.st_dev, current.st_ino)
