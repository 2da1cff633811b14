"""The AWS Neuron backend (torch-neuronx / neuronx-distributed on trn1, inf2, trn2).

Neither the Neuron SDK nor a Neuron device is available where this toolkit is developed and
tested: its packages are not on the reachable registries. This backend therefore cannot compile
or load anything here; it fails with a clear error instead of pretending.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BackendUnavailableError
from .base import Backend, GraphFactory, LoadedGraph

_MESSAGE = (
    "the neuron backend needs torch-neuronx and neuronx-distributed on a trn1/inf2/trn2 instance; "
    "{what}. It is not implemented or verified in this release: use --backend inductor (CPU)."
)


class NeuronBackend(Backend):
    """Placeholder for the Neuron SDK path: raises `BackendUnavailableError` on every use."""

    name = "neuron"
    suffix = ".neff"

    def _unavailable(self) -> BackendUnavailableError:
        present = importlib.util.find_spec("torch_neuronx") is not None
        what = (
            "torch_neuronx is installed but this backend is not implemented"
            if present
            else ("torch_neuronx is not installed")
        )
        return BackendUnavailableError(_MESSAGE.format(what=what))

    def placement(self, device: str) -> str | torch.device:
        raise self._unavailable()

    def compile(self, module: nn.Module, args: tuple, path: Path, dynamic: dict[str, Any] | None = None) -> None:
        raise self._unavailable()

    def load(self, path: Path, weights: dict[str, torch.Tensor], factory: GraphFactory) -> LoadedGraph:
        raise self._unavailable()
