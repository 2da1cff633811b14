"""The xla backend: each graph is traced once on an XLA device and saved as an HLO module + parameter map.

Export traces the graph's module lazily on the XLA device (nothing is compiled), captures the HLO of
``(result, *new KV cache)`` and records, per HLO parameter, which weight, cache tensor or per-call
input feeds it (`xla_graph.ParameterMap`). Loading needs no model code: the HLO is called as one XLA
computation on the shared weights and the runtime's KV cache; the returned cache tensors are copied
into the cache tensors, which XLA donates to the outputs, so the update happens in place. Every call
of a graph is the same lazy graph, so each graph compiles once per process.

``--device cpu`` runs on XLA:CPU (verified here); ``--device neuron`` selects the Neuron PJRT device
of torch-neuronx (written for, not verified on, trn1/inf2/trn2). All torch-xla calls are in `xla_compat`.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import runtime_versions
from ..errors import ArtifactError, InputError, UnsupportedModelError
from . import xla_compat
from .base import Backend, GraphFactory, LoadedGraph
from .xla_graph import Binding, ParameterMap

Sources = dict[int, tuple[str, str]]
"""Device-data id -> (source, key) of every tensor a graph may read."""


class XlaBackend(Backend):
    """HLO modules traced with torch-xla, run on XLA:CPU or the Neuron PJRT device."""

    name = "xla"
    suffix = ".xla.json"

    def placement(self, device: str) -> str | torch.device:
        return xla_compat.device(device)

    def compile(self, module: nn.Module, args: tuple, path: Path, dynamic: dict[str, Any] | None = None) -> None:
        assert dynamic is None, "xla graphs have static shapes: one graph per KV window (graphs.graph_specs)"
        inputs, cache = split_args(args)
        private = [torch.zeros(t.shape, dtype=t.dtype).to(t.device) for t in cache]  # built on host: device data
        xla_compat.sync()
        known = _sources(module, inputs, private)
        compiles, fallbacks = xla_compat.compile_count(), xla_compat.fallback_ops()
        with torch.no_grad():
            result = module(*(private if isinstance(a, list) else a for a in args))
        roots = [result, *private]
        ids, values = xla_compat.device_data(roots)
        proto = xla_compat.hlo_proto(roots)
        _check_trace(path, compiles, fallbacks)
        parameters, constants = _parameters(ids, values, known)
        outputs = [Binding.of("result", 0, result)] + [Binding.of("cache", i, t) for i, t in enumerate(private)]
        _write(path, self.suffix, proto, constants, parameters, outputs)

    def load(self, path: Path, weights: dict[str, torch.Tensor], factory: GraphFactory) -> LoadedGraph:
        spec = ParameterMap.read(path)
        spec.check(path)
        proto = _checked_file(path, spec.files["hlo"]).read_bytes()
        constants_path = _checked_file(path, spec.files["constants"])
        try:
            constants = load_file(str(constants_path))
        except Exception as err:  # safetensors raises its own error types on a bad file
            raise ArtifactError(f"cannot read {constants_path} ({err}); re-export the model.") from err
        device = next(iter(weights.values())).device
        bound = [_bound(path, binding, weights, constants, device) for binding in spec.parameters]
        kind = path.name.removesuffix(self.suffix)
        try:
            built = xla_compat.computation(f"optimum_neuron_{kind}", proto)
        except Exception as err:  # torch-xla raises RuntimeError (or others) on a bad HLO module
            raise ArtifactError(f"cannot load the HLO module of {path.name}: {err}; re-export the model.") from err
        return XlaGraph(f"xla::optimum_neuron_{kind}", built, spec, bound)


class XlaGraph:
    """A loaded HLO computation bound to the shared weights; called with the graph's positional inputs."""

    def __init__(self, name: str, built: object, spec: ParameterMap, bound: list[torch.Tensor | None]) -> None:
        self.name, self._built, self.spec, self._bound = name, built, spec, bound
        self._result = next(i for i, o in enumerate(spec.outputs) if o.source == "result")

    def __call__(self, *args: object) -> torch.Tensor:
        inputs, cache = split_args(args)
        values = [
            self._value(binding, fixed, inputs, cache)
            for binding, fixed in zip(self.spec.parameters, self._bound, strict=True)
        ]
        with torch.no_grad():
            outputs = xla_compat.call(self.name, values, self._built)
            result = outputs[self._result]
            for binding, new in zip(self.spec.outputs, outputs, strict=True):
                if binding.source == "cache":
                    cache[int(binding.key)].copy_(new)  # the old cache buffer is donated: no copy is made
            del outputs, new  # only the cache and the result stay live: no extra outputs in the synced graph
            xla_compat.sync()
        return result.cpu()  # the runtime reads results on the host; slicing on the device would compile more

    def _value(
        self, binding: Binding, fixed: torch.Tensor | None, inputs: list[torch.Tensor], cache: list[torch.Tensor]
    ) -> torch.Tensor:
        if fixed is not None:
            return fixed
        pool = cache if binding.source == "cache" else inputs
        index = int(binding.key)
        if index >= len(pool) or not binding.matches(pool[index]):
            got = tuple(pool[index].shape) if index < len(pool) else "nothing"
            raise InputError(
                f"{self.name} expects {binding.source} {index} of shape {binding.shape} ({binding.dtype}), got {got}: "
                "call graphs through the Engine, which pads every input to the graph's static shape."
            )
        return pool[index]


def split_args(args: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A graph call's per-call inputs (in order) and its KV cache list (see `graphs.graph_args`): empty for the
    vision encoder, the one graph that never touches the cache. The None placeholders of optional arguments (before
    a multi-LoRA graph's adapter slots) are no inputs: they feed no HLO parameter."""
    caches = [a for a in args if isinstance(a, list)]
    assert len(caches) <= 1, "a graph call passes at most one KV cache list"
    return [a for a in args if a is not None and not isinstance(a, list)], (caches[0] if caches else [])


def _sources(module: nn.Module, inputs: list[torch.Tensor], cache: list[torch.Tensor]) -> Sources:
    named = [("weight", n, t) for n, t in itertools.chain(module.named_parameters(), module.named_buffers())]
    named += [("cache", str(i), t) for i, t in enumerate(cache)] + [("input", str(i), t) for i, t in enumerate(inputs)]
    known: Sources = {}
    for source, key, tensor in named:
        ids, _ = xla_compat.device_data([tensor])
        assert len(ids) == 1, f"{source} {key} is not plain device data after a sync"
        known.setdefault(ids[0], (source, key))
    return known


def _check_trace(path: Path, compiles: int, fallbacks: dict[str, int]) -> None:
    """`UnsupportedModelError` when tracing ran an op on the CPU (which also compiles a partial graph)."""
    new = sorted(n for n, count in xla_compat.fallback_ops().items() if count > fallbacks.get(n, 0))
    if new or xla_compat.compile_count() != compiles:
        raise UnsupportedModelError(
            f"tracing {path.name} on XLA fell back to the CPU ({', '.join(new) or 'a graph was compiled mid-trace'}): "
            "the xla backend needs every op of the model lowered to XLA; use --backend inductor for this model."
        )


def _parameters(
    ids: list[int], values: list[torch.Tensor], known: Sources
) -> tuple[list[Binding], dict[str, torch.Tensor]]:
    """One binding per HLO parameter; device data that is no weight, cache or input becomes a saved constant."""
    bindings: list[Binding] = []
    constants: dict[str, torch.Tensor] = {}
    for tensor_id, value in zip(ids, values, strict=True):
        if tensor_id in known:
            bindings.append(Binding.of(*known[tensor_id], value))
        else:
            key = str(len(constants))
            constants[key] = value.cpu().contiguous()
            bindings.append(Binding.of("constant", key, value))
    return bindings, constants


def _write(path: Path, suffix: str, proto: bytes, constants: dict, parameters: list, outputs: list) -> None:
    stem = path.name.removesuffix(suffix)
    hlo, consts = path.with_name(f"{stem}.hlo.pb"), path.with_name(f"{stem}.constants.safetensors")
    hlo.write_bytes(proto)
    save_file(constants, str(consts))
    files = {
        "hlo": {"file": hlo.name, "sha256": _sha256(hlo)},
        "constants": {"file": consts.name, "sha256": _sha256(consts)},
    }
    path.write_text(ParameterMap(parameters, outputs, files, runtime_versions("xla")).to_json())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checked_file(path: Path, entry: dict[str, str]) -> Path:
    target = path.with_name(entry["file"])
    if not target.is_file():
        raise ArtifactError(f"{target} (referenced by {path.name}) is missing; re-export the model.")
    if _sha256(target) != entry["sha256"]:
        raise ArtifactError(f"{target} does not match the hash in {path.name} (corrupt); re-export the model.")
    return target


def _bound(
    path: Path,
    binding: Binding,
    weights: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
    device: torch.device,
) -> torch.Tensor | None:
    """The tensor bound to parameter ``binding`` for every call (weights, constants); None for per-call ones."""
    if binding.source in ("cache", "input"):
        return None
    pool, what = (weights, "weights") if binding.source == "weight" else (constants, "constants")
    tensor = pool.get(binding.key)
    if tensor is None or not binding.matches(tensor):
        raise ArtifactError(
            f"{path.name} needs {binding.source} {binding.key!r} {binding.shape} {binding.dtype}, which the "
            f"artifact's {what} lack or hold with another shape or dtype: the files come from different exports; "
            "re-export the model."
        )
    return tensor if binding.source == "weight" else tensor.to(device)
