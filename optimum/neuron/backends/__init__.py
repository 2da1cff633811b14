"""Compile backends: turn one graph module into a file, and load that file bound to shared weights."""

from __future__ import annotations

from ..errors import BackendUnavailableError
from .base import Backend, GraphFactory, LoadedGraph


def get_backend(name: str) -> Backend:
    """The backend called ``name``; heavy or optional dependencies are imported only here."""
    if name == "eager":
        from .eager import EagerBackend

        return EagerBackend()
    if name == "inductor":
        from .inductor import InductorBackend

        return InductorBackend()
    if name == "xla":
        from .xla import XlaBackend

        return XlaBackend()
    if name == "neuron":
        from .neuron import NeuronBackend

        return NeuronBackend()
    raise BackendUnavailableError(f"unknown backend {name!r}: use --backend inductor, eager or xla.")


__all__ = ["Backend", "GraphFactory", "LoadedGraph", "get_backend"]
