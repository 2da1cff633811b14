"""Where compiled artifacts are cached, and the code fingerprint that keys them."""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

_DEFAULT = Path.home() / ".cache" / "optimum-neuron"


def cache_root() -> Path:
    """``$OPTIMUM_NEURON_CACHE`` or ``~/.cache/optimum-neuron``; also hosts inductor's own cache."""
    root = Path(os.environ.get("OPTIMUM_NEURON_CACHE", _DEFAULT))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return root


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Hash of the toolkit's Python sources that shape a compiled graph."""
    package = Path(__file__).resolve().parents[2] / "neuron"
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        if "vllm" not in path.parts:
            digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:16]
