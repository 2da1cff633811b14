"""The backend interface. Models and runtime depend only on this, never on a concrete backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BackendUnavailableError

LoadedGraph = Callable[..., torch.Tensor]
"""A loaded graph: called with the graph's positional inputs (see `optimum.neuron.graphs.graph_args`)."""

GraphFactory = Callable[[], nn.Module]
"""Builds the graph's module bound to the shared weights (used by backends that run model code)."""


class Backend(ABC):
    """Compiles one graph module to one file, and loads such a file as a callable."""

    name: str
    suffix: str
    """File name suffix of a compiled graph, e.g. ``.pt2``."""
    compiles_in_workers: bool = False
    """True when the exporter may compile several graphs of one export in parallel processes (a backend whose
    compile is long and CPU-bound); the others compile in the exporting process, one graph after another."""

    def compiler_fingerprint(self, device: str) -> str:
        """What a graph compiled for ``device`` depends on beyond the model, its config and the toolkit's code (the
        host's vector instructions for generated CPU code...): part of each graph's cache key."""
        return ""

    def prepare_compiler(self, device: str) -> None:
        """Start finding out, in the background, what `compiler_fingerprint` needs and takes seconds to learn, so
        that an export's imports and fingerprints overlap it. Nothing by default."""
        return None

    def placement(self, device: str) -> str | torch.device:
        """Where the runtime puts weights, KV cache and inputs for graphs of this backend that run on
        ``device`` (a `NeuronConfig.device`). Most backends use the device as named."""
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"--device cuda was requested for the {self.name} backend but torch sees no CUDA device "
                f"(torch {torch.__version__}): use --device cpu, or run on a machine with an NVIDIA GPU and a CUDA "
                "build of torch (the CUDA path is written but not yet verified on a GPU: docs/cuda.md, make test-cuda)."
            )
        return device

    @abstractmethod
    def compile(self, module: nn.Module, args: tuple, path: Path, dynamic: dict[str, Any] | None = None) -> None:
        """Trace/compile ``module`` for the example ``args`` and write the graph to ``path``. ``dynamic`` names the
        forward arguments with a symbolic dimension (`graphs.symbolic_dims`: the KV window, the chunk length); only
        backends in `config.SYMBOLIC_SHAPE_BACKENDS` receive one."""

    @abstractmethod
    def load(self, path: Path, weights: dict[str, torch.Tensor], factory: GraphFactory) -> LoadedGraph:
        """Load the graph at ``path`` bound to ``weights`` (shared, not copied). Never returns a
        graph that could crash when called: every check happens here, raising `ArtifactError`."""
