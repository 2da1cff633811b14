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
    is given False when another process holds the lock (then nothing is held), True when this one took it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
