"""The files of one xla graph and its parameter map.

A graph ``<kind>`` is three files under ``graphs/``::

    <kind>.xla.json               the parameter map (this module), hashed by the artifact manifest
    <kind>.hlo.pb                 the serialized HloModuleProto (the form neuronx-cc compiles)
    <kind>.constants.safetensors  device data the trace captured that is none of the below (scalars)

The map says, for each HLO parameter in order, where its value comes from at run time: a weight of
the shared weight set (by name), a tensor of the shared KV cache (by index), a per-call input (by
position among the graph's non-cache arguments, see `optimum.neuron.graphs.graph_args`) or a
constant; and for each output, whether it is the graph's result or the new value of a cache tensor.
The map records the sha256 of the two other files, so the manifest's hash covers all three.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ArtifactError

FORMAT = "optimum-neuronx-xla-graph/1"
SOURCES = ("weight", "cache", "input", "constant")


@dataclass(frozen=True)
class Binding:
    """One HLO parameter or output: where it comes from (or goes), its shape and dtype."""

    source: str
    """``weight``, ``cache``, ``input`` or ``constant`` (parameters); ``result`` or ``cache`` (outputs)."""
    key: str
    """Weight name, or the decimal index of the cache tensor / input / constant."""
    shape: list[int]
    dtype: str
    """``str(torch.dtype)``, e.g. ``torch.float32``."""

    @classmethod
    def of(cls, source: str, key: str | int, tensor: torch.Tensor) -> Binding:
        """The binding of ``tensor`` coming from ``source``."""
        return cls(source, str(key), list(tensor.shape), str(tensor.dtype))

    def matches(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` has this binding's shape and dtype."""
        return list(tensor.shape) == self.shape and str(tensor.dtype) == self.dtype


@dataclass(frozen=True)
class ParameterMap:
    """Where each parameter of a traced graph comes from and where each output goes."""

    parameters: list[Binding]
    outputs: list[Binding]
    files: dict[str, dict[str, str]]
    """``hlo`` and ``constants`` -> ``{"file": name, "sha256": digest}`` (names relative to the map)."""
    versions: dict[str, str]

    def to_json(self) -> str:
        """The map as written to ``<kind>.xla.json``."""
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def read(cls, path: Path) -> ParameterMap:
        """Parse ``path``; `ArtifactError` when it is unreadable or not a parameter map of this format."""
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ArtifactError(f"cannot read xla graph {path} ({err}); re-export the model.") from err
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ArtifactError(f"{path} is not an xla graph parameter map ({FORMAT}); re-export the model.")
        try:
            return cls(
                parameters=[_binding(p, SOURCES) for p in body["parameters"]],
                outputs=[_binding(o, ("result", "cache")) for o in body["outputs"]],
                files={k: {"file": str(v["file"]), "sha256": str(v["sha256"])} for k, v in body["files"].items()},
                versions=dict(body["versions"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ArtifactError(f"{path} is a malformed xla parameter map ({err!r}); re-export the model.") from err

    def check(self, path: Path) -> None:
        """`ArtifactError` unless the map has one result, the hlo and constants files, and well-formed keys."""
        if [o.source for o in self.outputs].count("result") != 1 or set(self.files) != {"hlo", "constants"}:
            raise ArtifactError(f"{path} is a malformed xla parameter map (outputs or files); re-export the model.")
        numbered = [s for s in self.parameters + self.outputs if s.source != "weight"]
        names = [entry["file"] for entry in self.files.values()]
        if not all(s.key.isdigit() for s in numbered) or not all(n and "/" not in n and n != ".." for n in names):
            raise ArtifactError(
                f"{path} is a malformed xla parameter map (indices or file names); re-export the model."
            )


def _binding(entry: Any, sources: tuple[str, ...]) -> Binding:
    binding = Binding(str(entry["source"]), str(entry["key"]), [int(d) for d in entry["shape"]], str(entry["dtype"]))
    if binding.source not in sources:
        raise ValueError(f"unknown source {binding.source!r}")
    return binding
