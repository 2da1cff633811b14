"""A loaded inductor graph (`backends.inductor._BoundGraph`) hands its inputs to the AOTInductor loader itself instead
of through the package's ``__call__`` (which parses its call spec and goes through pytree on every call): it must
take the runtime's arguments as the package does (tensors, a list of tensors mutated in place like the KV cache, None
for an optional input left out) and return what the package returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from optimum.neuron.backends.inductor import InductorBackend


class Graph(nn.Module):
    """A weight bound at load, a cache list written in place, an optional input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def forward(
        self, x: torch.Tensor, cache: list[torch.Tensor], slots: torch.Tensor, extra: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = x @ self.weight
        cache[0].index_copy_(0, slots, y)
        cache[1].index_copy_(0, slots, y * 2)
        return y if extra is None else y + extra


def _cache() -> list[torch.Tensor]:
    return [torch.zeros(6, 4), torch.zeros(6, 4)]


def test_a_bound_graph_runs_as_the_package_does(tmp_path: Path) -> None:
    backend, path = InductorBackend(), tmp_path / "graph.pt2"
    x, slots = torch.randn(2, 4), torch.tensor([1, 4])
    backend.compile(Graph(), (x, _cache(), slots, None), path)
    weights = {"weight": torch.randn(4, 4)}
    graph = backend.load(path, weights, Graph)

    ours, theirs = _cache(), _cache()
    got = graph(x, ours, slots, None)
    want = torch._inductor.aoti_load_package(str(path))
    want.load_constants(weights, check_full_update=True, user_managed=True)
    expected = want(x, theirs, slots, None)
    assert torch.equal(got, expected) and torch.equal(got, x @ weights["weight"])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)) and ours[1][4].abs().sum() > 0
    with pytest.raises(TypeError, match="tensors, lists of tensors or None"):
        graph(x, ours, 1, None)
    with pytest.raises(RuntimeError, match="inputs"):  # the loader counts its inputs: an error, not a crash
        graph(x, ours[:1], slots, None)
