"""``optimum_neuron::packed_linear``: the CPU kernel of the decoder's linear layers, and its weight layout.

A weight ``W [N, K]`` is packed once at load into ``[ceil(N / 16), K, 16]`` (`pack`): 16-column panels, each one
contiguous stretch of memory over the whole K, the zero-padded last panel included. The kernel
(``csrc/packed_linear.cpp``) streams a panel once per K block for every row of the call, so a decode step with 8 rows
reads its weights once, as a step with 1 row does; it sums each output in one fixed order whatever the row count or
the threads, so equal rows give bitwise equal outputs (DESIGN.md invariant 4). It runs AVX-512 where the CPU has it,
else AVX2 + FMA (bitwise equal results), else portable C++; ``OPTIMUM_NEURON_PACKED_ISA=avx2`` (or ``portable``) picks
a lesser path, read once per process.

The operator's schema and its shape function are defined here (what ``torch.export`` and AOTInductor need: a compiled
graph calls the operator by name through the dispatcher); its CPU implementation is a small C++ library compiled on
first use into the cache (`load`: ~20 s, then a cache hit) and loaded before any graph runs.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch

from ..cache_dir import cache_lock, cache_root
from ..errors import BackendUnavailableError

PANEL = 16
"""Output columns per panel."""
OPERATOR = "optimum_neuron::packed_linear"
SOURCE = Path(__file__).with_name("csrc") / "packed_linear.cpp"
_FLAGS = ("-O3", "-fopenmp")
"""``-fopenmp``: ``at::parallel_for`` is inlined from ATen's OpenMP header into the kernel, and without the flag its
``#pragma omp parallel`` is ignored: the kernel then ran on one thread whatever torch's thread count."""
_LDFLAGS = ("-fopenmp",)
"""libgomp.so.1, the soname torch itself loads: the loader reuses torch's runtime, so there is one thread pool."""

torch.library.define(
    OPERATOR, "(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor", tags=(torch.Tag.flexible_layout,)
)
"""``flexible_layout``: the kernel takes ``x`` in any strides (it reads a contiguous view) and its weights are
contiguous constants, so inductor passes the operator's input as it is. Without a tag inductor applied its default
constraint the first time the operator appeared in a process and another one after, so a graph's code depended on
which graphs the process had compiled before (copies of the input of some projections)."""


@torch.library.register_fake(OPERATOR)
def _output_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` for ``weight = pack(W)``: ``x [..., K]`` -> ``[..., out_features]``."""
    return torch.ops.optimum_neuron.packed_linear(x, weight, bias, out_features)


def packed_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
    """The packed shape of a weight of ``shape = (N, K)``."""
    rows, columns = shape
    return (-(-rows // PANEL), columns, PANEL)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` -> ``[ceil(N / 16), K, 16]``, ``P[p, k, j] = W[16 p + j, k]`` (zero past N)."""
    panels, columns, _ = packed_shape(weight.shape)
    padded = weight.new_zeros(panels * PANEL, columns)
    padded[: weight.shape[0]] = weight
    return padded.view(panels, PANEL, columns).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``[rows, K]`` weight that `pack` made ``packed`` from."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:rows]


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``W[ids]`` of a packed weight, ``[*ids.shape, K]``: an embedding lookup in a tied embedding/LM head table
    kept only in the packed layout."""
    return packed[ids // PANEL, :, ids % PANEL]


_LOCK = threading.Lock()
_loaded: list[str] = []


def load() -> None:
    """Compile (once, into ``$OPTIMUM_NEURON_CACHE/kernels/<hash>``) and load the CPU implementation of
    ``packed_linear``; a no-op once loaded. `BackendUnavailableError` when it cannot be built (no C++ compiler)."""
    with _LOCK:
        if _loaded:
            return
        from torch.utils import cpp_extension

        key = _build_key()
        build = cache_root() / "kernels" / key
        build.mkdir(parents=True, exist_ok=True)
        with cache_lock(build.with_name(f"{key}.lock")):
            try:
                cpp_extension.load(
                    name=f"optimum_neuron_kernels_{key}",
                    sources=[str(SOURCE)],
                    build_directory=str(build),
                    extra_cflags=list(_FLAGS),
                    extra_ldflags=list(_LDFLAGS),
                    is_python_module=False,
                    verbose=False,
                )
            except (OSError, RuntimeError, ImportError) as err:
                raise BackendUnavailableError(
                    f"cannot build the packed CPU kernel {SOURCE.name} ({err}): install a C++ compiler (g++) and "
                    "ninja, or export with --linear_kernel aten."
                ) from err
        _loaded.append(key)


def _build_key() -> str:
    """What the compiled library depends on: its source, torch's version and the flags."""
    payload = SOURCE.read_bytes() + torch.__version__.encode() + " ".join(_FLAGS + _LDFLAGS).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
