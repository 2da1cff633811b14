"""The toolkit's C++ library of CPU operators (``csrc/``: `packed` linear layers, `attention`, sampling's
`candidates`), compiled together on first use into ``$OPTIMUM_NEURON_CACHE/kernels/<hash>`` with torch's
``cpp_extension`` (20-50 s on two cores, then a cache hit) and loaded before any graph that calls them runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import threading
from pathlib import Path

import torch

from ..cache_dir import cache_lock, cache_root
from ..errors import BackendUnavailableError

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    CSRC / "packed_linear.cpp",
    CSRC / "packed_rows.cpp",
    CSRC / "paged_attention.cpp",
    CSRC / "chunk_attention.cpp",
    CSRC / "top_candidates.cpp",
)
"""Every C++ source of the library: all are compiled together and all enter the build key."""
HEADERS = (CSRC / "isa.h", CSRC / "panel_tiles.h", CSRC / "vec_exp.h")
"""The headers the sources include: they enter the build key too."""
_FLAGS = ("-O3", "-fopenmp")
"""``-fopenmp``: ``at::parallel_for`` is inlined from ATen's OpenMP header into the kernels, and without the flag its
``#pragma omp parallel`` is ignored: a kernel then ran on one thread whatever torch's thread count."""
_LDFLAGS = ("-fopenmp",)
"""libgomp.so.1, the soname torch itself loads: the loader reuses torch's runtime, so there is one thread pool."""
BUILT = "built"
"""The file a finished build leaves in its folder (a build killed midway leaves none, and the next load builds)."""
_LOCK = threading.Lock()
_loaded: list[str] = []
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (malloc.h)."""
HEAP_TRIM = 1 << 30
HEAP_MMAP = 1 << 28
"""`steady_heap`'s thresholds: the heap keeps up to 1 GiB free at its top, and only blocks of 256 MiB or more are
mapped on their own."""


def load() -> None:
    """Compile (once, into ``$OPTIMUM_NEURON_CACHE/kernels/<hash>``) and load the CPU implementation of every operator
    of the library; a no-op once loaded. `BackendUnavailableError` when it cannot be built (no C++ compiler)."""
    with _LOCK:
        if _loaded:
            return
        key = _build_key()
        build = cache_root() / "kernels" / key
        build.mkdir(parents=True, exist_ok=True)
        with cache_lock(build.with_name(f"{key}.lock")):
            if not _load_built(build):
                _build(build)
        _loaded.append(key)
        steady_heap()


def library_file(build: Path) -> Path:
    """The shared library a build folder ``build`` (``kernels/<key>``) holds once built: named after its key, so that
    two builds of different sources never share a name in one process."""
    return build / f"optimum_neuron_kernels_{build.name}.so"


def _load_built(build: Path) -> bool:
    """Load the finished build in ``build`` (marked `BUILT`); False when there is none, or when its file is gone or
    cannot be loaded (the mark is then dropped, and `load` builds again)."""
    if not (build / BUILT).exists():
        return False
    try:
        torch.ops.load_library(str(library_file(build)))
    except OSError:
        (build / BUILT).unlink(missing_ok=True)
        return False
    return True


def _build(build: Path) -> None:
    """Compile and load the library into ``build`` (as `library_file`, under the build's cache lock), then mark it
    built.

    torch's builder writes the compile commands, with the paths of the running environment's torch, into the
    folder's ``build.ninja``, and ninja recompiles everything when a command changes: loading through it from an
    environment reached by another path (a linked ``.venv``, as in every docs-check block) recompiled the whole library,
    ~40 s on two cores, in every such process. Once `BUILT` is written, `load` takes the library as it is: its key
    already holds what it depends on."""
    from torch.utils import cpp_extension

    _drop_stale_baton(build)
    try:
        cpp_extension.load(
            name=library_file(build).stem,
            sources=[str(source) for source in SOURCES],
            build_directory=str(build),
            extra_cflags=list(_FLAGS),
            extra_ldflags=list(_LDFLAGS),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as err:
        raise BackendUnavailableError(
            f"cannot build the toolkit's CPU kernels ({', '.join(s.name for s in SOURCES)}: {err}): install a "
            "C++ compiler (g++) and ninja, or export with --linear_kernel aten --attention_kernel sdpa."
        ) from err
    (build / BUILT).touch()


def steady_heap() -> bool:
    """Keep the process's heap from going back to the OS between graph calls (glibc only; True when set).

    A graph call allocates its outputs and intermediate buffers and frees them before the next call: a chunk of 256
    rows, several MB. glibc's defaults (the mmap threshold adapted to the sizes freed, the heap's top trimmed beyond
    twice that) made some processes map and unmap that memory on every call: the same int8 artifact's 256-token
    prefill ran at 145-156 ms in some fresh processes and 177-186 ms in others, with page faults and munmap in its
    profile. Fixed thresholds (`HEAP_TRIM`, `HEAP_MMAP`) keep the freed memory for the next call; every process then
    ran at 146-151 ms. The process keeps what its calls freed (a few times its largest call's buffers). Set once, by
    the process that loads the kernels; left alone where the user set MALLOC_TRIM_THRESHOLD_ or
    MALLOC_MMAP_THRESHOLD_, or where the C library is not glibc."""
    if {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"} & os.environ.keys():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM)) and bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP))


def _drop_stale_baton(build: Path) -> None:
    """Remove the ``lock`` file torch's extension builder keeps in ``build`` while it builds, when a build was killed
    and left it: torch waits for that file to go, forever, and every later process with it (a compile worker killed
    with its exporter while it built the library hung the next export). Called under the build's `cache_lock`, which no
    other process holds, so no live build owns the file."""
    (build / "lock").unlink(missing_ok=True)


def _build_key() -> str:
    """What the compiled library depends on: its sources and headers, torch's version and the flags."""
    payload = (
        b"".join(source.read_bytes() for source in SOURCES + HEADERS)
        + torch.__version__.encode()
        + " ".join(_FLAGS + _LDFLAGS).encode()
    )
    return hashlib.sha256(payload).hexdigest()[:16]
