"""The inductor backend: ``torch.export`` -> AOTInductor package (``.pt2``) per graph, CPU (verified) or CUDA
(partly run on a lent GPU: docs/cuda.md).

Weights stay out of the package and are bound at load with ``load_constants(user_managed=True)``:
every graph points at the same tensors. The KV cache is a graph input mutated in place. A runner
called before its constants are loaded segfaults, so `load` checks everything first and only then
returns a callable.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..cache_dir import cache_lock
from ..errors import ArtifactError
from .base import Backend, GraphFactory, LoadedGraph

_INDUCTOR_OPTIONS = {
    "aot_inductor.package_constants_in_so": False,
    # bf16/fp16: round every intermediate to the low-precision dtype as eager PyTorch does. By default
    # inductor keeps fused chains in fp32 (rope's x*cos + rot*sin, silu(gate)*up), which drifts from
    # eager and transformers by 1-2 ulps per op and flipped SmolLM2's near-tie first token (tests/models/
    # test_bf16.py). No effect on fp32 graphs.
    "emulate_precision_casts": True,
}


@functools.cache
def _vector_isa_check() -> threading.Thread:
    """Inductor's check of which vector ISAs the CPU and the compiler support, started once in a thread. On a fresh
    inductor cache it compiles and loads a test program per ISA the CPU has (~5 s on a 2-core VM, in compiler
    processes, so the thread holds the interpreter's lock little); afterwards ``pick_vec_isa`` answers at once.
    The modules it imports are imported here first: two threads importing one package's modules at once may see
    them half initialised."""
    import torch._inductor.codecache
    import torch._inductor.cpp_builder  # noqa: F401
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    thread = threading.Thread(target=pick_vec_isa, name="vector-isa-check", daemon=True)
    thread.start()
    return thread


class InductorBackend(Backend):
    """AOTInductor packages with external, shared weights."""

    name = "inductor"
    suffix = ".pt2"
    compiles_in_workers = True

    def compiler_fingerprint(self, device: str) -> str:
        """The CUDA device's compute capability, or what inductor generates CPU code for: the vector ISA (a graph
        compiled with AVX-512 faults on an AVX2 host) and the compiling process's thread count (code generated with
        one thread has no parallel loops: it would run on one core)."""
        if device == "cuda":
            return "sm_{}{}".format(*torch.cuda.get_device_capability())
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        _vector_isa_check().join()
        return f"cpu:{pick_vec_isa()}:threads={torch.get_num_threads()}"

    def prepare_compiler(self, device: str) -> None:
        """On CPU, start inductor's check of the vector ISAs (`_vector_isa_check`)."""
        if device == "cpu":
            _vector_isa_check()

    def compile(self, module: nn.Module, args: tuple, path: Path, dynamic: dict[str, Any] | None = None) -> None:
        _declare_toolkit_fallbacks()
        with torch.no_grad():
            shapes = _dynamic_shapes(module, args, dynamic) if dynamic else None
            program = torch.export.export(module, args, dynamic_shapes=shapes, strict=False)
            with cache_lock(_same_program_lock(program)), _angles_computed_once():
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(path), inductor_configs=dict(_INDUCTOR_OPTIONS)
                )

    def load(self, path: Path, weights: dict[str, torch.Tensor], factory: GraphFactory) -> LoadedGraph:
        _check_archive(path)
        try:
            package = torch._inductor.aoti_load_package(str(path))
        except Exception as err:  # the loader raises RuntimeError or others on a bad package
            raise ArtifactError(f"cannot load compiled graph {path}: {err}; re-export the model.") from err
        names = list(package.get_constant_fqns())
        missing = [n for n in names if n not in weights]
        if missing:
            raise ArtifactError(
                f"{path.name} needs weights {missing[:5]} that the artifact's weights lack: the graph and "
                "model.safetensors come from different exports; re-export the model."
            )
        package.load_constants({n: weights[n] for n in names}, check_full_update=True, user_managed=True)
        return _BoundGraph(package)


class _BoundGraph:
    """An AOTInductor model whose constants are loaded; the only way the runtime reaches it.

    A call hands the flat list of input tensors to the package's loader (``boxed_run``) itself: the package's own
    ``__call__`` reads and parses its call spec and flattens and unflattens through pytree on every call (~70 us of a
    3.5 ms batch-1 int4 decode step on the 2-core VM). The runtime's arguments are tensors, lists of tensors (the KV
    cache) and None (an optional input left out), in the graph's order: flattened here as pytree flattens them, the
    Nones dropped as the package drops them."""

    def __init__(self, package: Any) -> None:
        self._package = package
        self._out_spec = pytree.treespec_loads(package.loader.get_call_spec()[1])

    def __call__(self, *args: object) -> torch.Tensor:
        flat: list[torch.Tensor] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                flat.append(arg)
            elif isinstance(arg, (list, tuple)):
                flat.extend(arg)
            elif arg is not None:
                raise TypeError(f"a compiled graph takes tensors, lists of tensors or None; got {type(arg).__name__}")
        with torch.inference_mode():
            return pytree.tree_unflatten(self._package.loader.boxed_run(flat), self._out_spec)


def _declare_toolkit_fallbacks() -> None:
    """Register inductor's fallback of every toolkit operator (`kernels`) before any graph is lowered, as inductor
    itself does the first time it meets one (the flexible layout their tag asks for). A fallback's inputs are realized
    where they are produced, but only once the fallback exists: without this, the first graph a process compiled fused
    the producers of an operator's inputs otherwise than every later graph, so the generated code depended on what
    the process had compiled before (tests/export/test_graph_cache.py compares a parallel export's code with one
    process's). One of two touches of inductor's lowering internals: `_angles_computed_once` is the other."""
    from torch._inductor.lowering import lowerings, make_fallback

    from ..kernels import attention, candidates, packed

    for name in (
        packed.OPERATOR,
        packed.QOPERATOR,
        attention.OPERATOR,
        attention.INT8_OPERATOR,
        attention.CHUNK_OPERATOR,
        candidates.OPERATOR,
    ):
        namespace, operator = name.split("::")
        overload = getattr(getattr(torch.ops, namespace), operator).default
        if overload not in lowerings:
            make_fallback(overload, layout_constraint=None)


@contextlib.contextmanager
def _angles_computed_once() -> Iterator[None]:
    """While a graph is lowered for the CPU, a cos or sin that several kernels read is computed once into a buffer,
    as inductor already does for its "heavy" operators (exp, log, sigmoid, tanh): otherwise every kernel reading it
    computes it again. Rope's angles are read by every layer's query and key rotation: SmolLM2's generated code
    evaluated cos and sin once per head of each of its 30 layers, 23.6 M of each for a 1,024-token prefill instead of
    65 K, ~0.5 % of the prefill's samples in the cos and sin calls alone (benchmark/README.md, the Zen 3 VM,
    2026-12-07). The buffer holds the same values, computed by the same vectorized code: the graphs' outputs are
    bitwise unchanged (the 1,024-, 300- and 37-token prefills' logits, checked). A 1,024-token prefill took 0.985x
    the time, paired in one process in a slow spell of that VM (quartiles 0.94-1.04x). The toolkit's second touch of
    inductor's lowering internals, beside `_declare_toolkit_fallbacks`; undone when the compile ends."""
    from torch._inductor import ir

    reuse = ir.StorageBox.should_realize_on_reuse

    def computed_once(box: ir.StorageBox, users: int, *, graph_reuse: bool = True) -> bool:
        if users > 1 and isinstance(box.data, ir.Pointwise) and ir.is_cpu(box.data) and _reads_cos_or_sin(box.data):
            return True
        return reuse(box, users, graph_reuse=graph_reuse)

    ir.StorageBox.should_realize_on_reuse = computed_once  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        ir.StorageBox.should_realize_on_reuse = reuse  # type: ignore[method-assign]


def _reads_cos_or_sin(node: Any) -> bool:
    """Whether the inductor pointwise ``node`` computes a cos or a sin."""
    return bool({"cos", "sin"} & set(node.inner_fn_opcount().used_ops))


def _same_program_lock(program: torch.export.ExportedProgram) -> Path:
    """The lock file that serialises compiles of one program by every process sharing this inductor cache.

    AOTInductor writes a graph's generated files (code, ``*_metadata.json``) into the inductor cache under names
    hashed from the code, then packages them after its own lock is released: a second process compiling the same
    program meanwhile truncates and rewrites those files, and the first one's package gets an empty JSON file
    (seen with two exports of one graph at once, each into its own `OPTIMUM_NEURON_CACHE`: the package did not
    load). The key is the program's code and its inputs' shapes and dtypes, and the compile options."""
    from torch._inductor.codecache import get_lock_dir

    inputs = [str(node.meta.get("val")) for node in program.graph.nodes if node.op == "placeholder"]
    text = "\n".join([program.graph_module.code, *inputs, repr(sorted(_INDUCTOR_OPTIONS.items()))])
    return Path(get_lock_dir()) / f"optimum-neuron-{hashlib.sha256(text.encode()).hexdigest()[:24]}.lock"


def _dynamic_shapes(module: nn.Module, args: tuple, dynamic: dict[str, Any]) -> dict[str, Any]:
    """`torch.export`'s ``dynamic_shapes`` for the forward arguments ``args`` of ``module``: ``dynamic``'s
    entries, every other argument static (a list, the KV cache, as one static entry per tensor)."""
    names = inspect.signature(module.forward).parameters
    return {
        name: dynamic.get(name, [None] * len(arg) if isinstance(arg, list) else None)
        for name, arg in zip(names, args, strict=False)
    }


def _check_archive(path: Path) -> None:
    if not path.is_file():
        raise ArtifactError(f"compiled graph {path} is missing; re-export the model.")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            foreign = [n for n in archive.namelist() if not n.startswith(f"{path.stem}/")]
    except (zipfile.BadZipFile, OSError) as err:
        raise ArtifactError(f"compiled graph {path} is not a valid package ({err}); re-export the model.") from err
    if bad is not None:
        raise ArtifactError(f"compiled graph {path} is corrupt (member {bad}); re-export the model.")
    if foreign:  # the package was compiled under another graph's name: its inputs would not match
        raise ArtifactError(
            f"compiled graph {path} holds {foreign[0]!r}, not a {path.stem} graph (files swapped or renamed); "
            "re-export the model."
        )
