"""Helpers of the backend contract suite: fixture names, prompts, a graph-call recorder, decode loops."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optimum.neuron.graphs import GraphKind
from optimum.neuron.runtime.artifacts import Artifact
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sampling import SamplingParams, SequenceSampler
from tests.fixtures.llm.models import export_fixture

BACKENDS = [
    pytest.param("eager"),
    pytest.param("inductor", marks=pytest.mark.slow),
    pytest.param("xla", marks=pytest.mark.xla),
]
"""Every backend the contract covers; ``xla`` runs only where torch-xla is installed (.venv-xla)."""
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def fixture_name(family: str, backend: str, chunked: bool = True) -> str:
    """``<family>-2x4x8-<backend>`` (chunk 8, sequence length 32) or ``<family>-2x1x32-ce-<backend>``."""
    return f"{family}-2x4x8-{backend}" if chunked else f"{family}-2x1x32-ce-{backend}"


def engine_for(backend: str, family: str = "llama", chunked: bool = True) -> Engine:
    """A fresh engine on the named fixture (batch 2, sequence length 32)."""
    return Engine(Artifact.open(export_fixture(fixture_name(family, backend, chunked))))


def prompt(length: int, seed: int) -> list[int]:
    """``length`` random token ids of the tiny vocabulary (3..255), reproducible from ``seed``."""
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def flat_tensors(args: tuple) -> list[torch.Tensor]:
    """The tensors of a graph call, the KV cache list flattened in place."""
    out: list[torch.Tensor] = []
    for arg in args:
        out.extend(arg if isinstance(arg, list) else [arg])
    return out


class Recorder:
    """Wraps an engine's graphs to record what each call receives."""

    def __init__(self, engine: Engine) -> None:
        self.calls: list[tuple[GraphKind, tuple]] = []
        for kind, graph in list(engine.graphs.items()):
            engine.graphs[kind] = self._wrap(kind, graph)

    def _wrap(self, kind: GraphKind, graph: Any) -> Any:
        def call(*args: Any) -> torch.Tensor:
            self.calls.append((kind, args))
            return graph(*args)

        return call

    def signatures(self, kind: GraphKind) -> set[Signature]:
        """The distinct (shape, dtype) signatures graph ``kind`` was called with."""
        return {tuple((tuple(t.shape), t.dtype) for t in flat_tensors(a)) for k, a in self.calls if k is kind}

    def caches(self) -> list[list[torch.Tensor]]:
        """The KV cache list each call received."""
        return [next(a for a in args if isinstance(a, list)) for _, args in self.calls]


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def decode_steps(engine: Engine, tokens: dict[int, list[int]], positions: dict[int, int], steps: int) -> None:
    """``steps`` greedy decode steps of the slots in ``tokens`` (each list ends with the token to feed)."""
    samplers = {slot: SequenceSampler(SamplingParams()) for slot in tokens}
    for _ in range(steps):
        active = {slot: (seq[-1], positions[slot] + len(seq) - 1) for slot, seq in tokens.items()}
        for slot, token in engine.decode(active, samplers).items():
            tokens[slot].append(token)


def alone(engine: Engine, slot: int, ids: list[int], new: int) -> list[int]:
    """``new`` greedy tokens of ``ids`` prefilled and decoded in ``slot`` with no other live slot."""
    engine.reset_slot(slot)
    tokens = {slot: [greedy(engine.prefill(ids, slot))]}
    decode_steps(engine, tokens, {slot: len(ids)}, new - 1)
    return tokens[slot]


def slot_rows(engine: Engine, slot: int, last: int) -> list[torch.Tensor]:
    """Host copies of rows ``[0, last)`` of ``slot`` in every K and V tensor."""
    return [t[slot, :, :last].cpu().clone() for t in engine.kv_cache]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def private_tensor_shapes(engine: Engine) -> set[tuple[int, ...]]:
    """Shapes of the tensors the graphs hold themselves: eager module state, AOTInductor constants, or the
    weights and constants an xla graph binds."""
    backend = engine.config.backend
    if backend == "eager":
        engine._module(GraphKind.TOKEN_GENERATION)  # builds the shared decoder if no call did yet
        assert engine._decoder is not None
        return {tuple(t.shape) for t in engine._decoder.state_dict().values()}
    shapes: set[tuple[int, ...]] = set()
    for kind in engine.graphs:
        if backend == "xla":
            from optimum.neuron.backends.xla_graph import ParameterMap

            spec = ParameterMap.read(engine.artifact.graph_path(kind))
            shapes |= {tuple(p.shape) for p in spec.parameters if p.source in ("weight", "constant")}
            continue
        package = torch._inductor.aoti_load_package(str(engine.artifact.graph_path(kind)))
        names = set(package.get_constant_fqns())
        assert names <= set(engine.weights), f"{kind.value} holds constants that are not weights"
        shapes |= {tuple(engine.weights[n].shape) for n in names}
    return shapes
