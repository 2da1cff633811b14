"""The eager backend: the static modules run as plain PyTorch. The numerical reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ArtifactError
from .base import Backend, GraphFactory, LoadedGraph


class EagerBackend(Backend):
    """No compilation: the graph file only records that the graph exists."""

    name = "eager"
    suffix = ".json"

    def compile(self, module: nn.Module, args: tuple, path: Path, dynamic: dict[str, Any] | None = None) -> None:
        with torch.inference_mode():
            module(*args)  # one run proves the module runs with these shapes (any window: plain PyTorch)
        path.write_text(json.dumps({"backend": self.name, "module": type(module).__name__}))

    def load(self, path: Path, weights: dict[str, torch.Tensor], factory: GraphFactory) -> LoadedGraph:
        try:
            meta = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ArtifactError(f"cannot read eager graph {path} ({err}); re-export the model.") from err
        if meta.get("backend") != self.name:
            raise ArtifactError(f"{path} is not an eager graph ({meta}); re-export the model.")
        module = factory()
        return torch.inference_mode()(module)
