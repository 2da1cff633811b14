"""Helpers of the engine-level tests: fixture names, loaded models, prompts, a graph-call recorder,
prefill logits and greedy runs through the engine's sequence API."""

from __future__ import annotations

import functools
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import torch

from optimum.neuron import NeuronModelForCausalLM
from optimum.neuron.artifact import Artifact
from optimum.neuron.models.layers.kv_cache import slot_rows
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.generate import generate_tokens
from optimum.neuron.runtime.padding import slots_of
from optimum.neuron.runtime.sampling import SamplingParams
from tests.fixtures.llm.models import export_fixture

BACKENDS = [
    pytest.param("eager"),
    pytest.param("inductor", marks=pytest.mark.slow),
    pytest.param("xla", marks=pytest.mark.xla),
]
"""Every backend the contract covers; ``xla`` runs only where torch-xla is installed (.venv-xla)."""
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]
GREEDY = SamplingParams()


def fixture_name(family: str, backend: str, chunked: bool = True) -> str:
    """``<family>-2x4x8-<backend>`` (chunk 8, sequence length 32) or ``<family>-2x1x32-ce-<backend>``."""
    return f"{family}-2x4x8-{backend}" if chunked else f"{family}-2x1x32-ce-{backend}"


def engine_for(backend: str, family: str = "llama", chunked: bool = True, caller_blocks: bool = False) -> Engine:
    """A fresh engine on the named fixture (batch 2, sequence length 32, blocks of 4 positions); with
    ``caller_blocks`` the test places every sequence's blocks itself."""
    return Engine(Artifact.open(export_fixture(fixture_name(family, backend, chunked))), caller_blocks=caller_blocks)


@functools.cache
def loaded(artifact: Path) -> NeuronModelForCausalLM:
    """The artifact at ``artifact`` as `NeuronModelForCausalLM`, loaded once per test process: the one
    loaded-model cache of the suite (tests that change an engine's state load their own)."""
    return NeuronModelForCausalLM.from_pretrained(artifact)


def neuron_model(name: str) -> NeuronModelForCausalLM:
    """The named export fixture, loaded once per test process."""
    return loaded(export_fixture(name))


def prompt(length: int, seed: int) -> list[int]:
    """``length`` random token ids of the tiny vocabulary (3..255), reproducible from ``seed``."""
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def flat_tensors(args: tuple) -> list[torch.Tensor]:
    """The tensors of a graph call, the KV cache list flattened in place, the None of an optional argument left out
    dropped (as the compiled graphs drop it)."""
    out: list[torch.Tensor] = []
    for arg in args:
        out.extend(arg if isinstance(arg, list) else [] if arg is None else [arg])
    return out


def call_window(args: tuple, block_size: int) -> int:
    """The KV window of a graph call: the columns of its ``block_table``, the argument after the KV cache list
    (`graphs.graph_args`), times the block size; 0 when the graph takes none."""
    index = next(i for i, arg in enumerate(args) if isinstance(arg, list))
    table = args[index + 1] if index + 1 < len(args) else None
    return 0 if table is None else int(table.shape[1]) * block_size


class Recorder:
    """Wraps an engine's graphs to record what each call receives."""

    def __init__(self, engine: Engine) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.block_size = engine.block_size
        for name, graph in list(engine.graphs.items()):
            engine.graphs[name] = self._wrap(name, graph)

    def _wrap(self, name: str, graph: Any) -> Any:
        def call(*args: Any) -> torch.Tensor:
            self.calls.append((name, args))
            return graph(*args)

        return call

    @staticmethod
    def signature(args: tuple) -> Signature:
        """The (shape, dtype) signature of one call's arguments."""
        return tuple((tuple(t.shape), t.dtype) for t in flat_tensors(args))

    def signatures(self, name: str) -> set[Signature]:
        """The distinct (shape, dtype) signatures the graph called ``name`` was called with."""
        return {self.signature(a) for n, a in self.calls if n == name}

    def windows(self) -> list[tuple[str, int]]:
        """``(graph name, KV window)`` of each call, in order (window 0: the graph reads no earlier cache)."""
        return [(name, call_window(args, self.block_size)) for name, args in self.calls]

    def caches(self) -> list[list[torch.Tensor]]:
        """The KV cache list each call received."""
        return [next(a for a in args if isinstance(a, list)) for _, args in self.calls]


def prefill_logits(engine: Engine, ids: list[int], seq_id: Hashable = "probe") -> torch.Tensor:
    """The last-token logits ``[V]`` of ``ids`` prefilled whole in one step, no cached block reused (the slot and
    blocks are given back)."""
    engine.admit(seq_id, ids, GREEDY, reuse=False)
    try:
        return engine.step({seq_id: len(ids)}).logits[seq_id]
    finally:
        engine.release(seq_id)


def alone(engine: Engine, ids: list[int], new: int) -> list[int]:
    """``new`` greedy tokens of ``ids`` generated with no other live sequence."""
    return generate_tokens(engine, [ids], new, GREEDY, set())[0]


def decode(engine: Engine, seq_ids: list[Hashable], steps: int) -> None:
    """``steps`` decode steps of the sequences ``seq_ids`` together."""
    for _ in range(steps):
        engine.step(dict.fromkeys(seq_ids, 1))


def by_slot(cache: torch.Tensor) -> torch.Tensor:
    """A host copy of one K or V tensor of the paged cache as ``[slots, H, D]``, row ``s`` being slot ``s``."""
    slots = torch.arange(cache.shape[0] * cache.shape[2])
    return slot_rows(cache.cpu(), slots)  # advanced indexing: a copy


def sequence_slots(engine: Engine, seq_id: Hashable, first: int, last: int) -> torch.Tensor:
    """The cache rows of positions ``[first, last)`` of sequence ``seq_id`` (through its blocks)."""
    blocks = engine.sequence(seq_id).blocks
    return torch.tensor(slots_of(blocks, range(first, last), engine.block_size), dtype=torch.long)


def sequence_rows(engine: Engine, seq_id: Hashable, last: int) -> list[torch.Tensor]:
    """Host copies of positions ``[0, last)`` of sequence ``seq_id`` in every K and V tensor, ``[last, H, D]``."""
    slots = sequence_slots(engine, seq_id, 0, last)
    return [slot_rows(t.cpu(), slots).clone() for t in engine.kv_cache]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def private_tensor_shapes(engine: Engine) -> set[tuple[int, ...]]:
    """Shapes of the tensors the graphs hold themselves: eager module state, AOTInductor constants, or the
    weights and constants an xla graph binds."""
    backend = engine.config.backend
    if backend == "eager":
        engine._module(next(iter(engine.specs.values())))  # builds the shared decoder if no call did yet
        assert engine._decoder is not None
        return {tuple(t.shape) for t in engine._decoder.state_dict().values()}
    shapes: set[tuple[int, ...]] = set()
    for name in engine.graphs:
        if backend == "xla":
            from optimum.neuron.backends.xla_graph import ParameterMap

            spec = ParameterMap.read(engine.artifact.graph_path(name))
            shapes |= {tuple(p.shape) for p in spec.parameters if p.source in ("weight", "constant")}
            continue
        package = torch._inductor.aoti_load_package(str(engine.artifact.graph_path(name)))
        names = set(package.get_constant_fqns())
        assert names <= set(engine.weights), f"{name} holds constants that are not weights"
        shapes |= {tuple(engine.weights[n].shape) for n in names}
    return shapes


def check_against_transformers(
    engine: Engine, checkpoint: Path, lengths: tuple[int, ...], new: int, tolerance: float, label: str
) -> None:
    """For a prompt of each of ``lengths``: the engine's last-token prefill logits within ``tolerance`` of
    transformers' on ``checkpoint``, and its ``new`` greedy tokens equal transformers' (a failure names ``label`` and
    the length)."""
    from tests.fixtures.llm.reference import hf_greedy, reference_model

    for length in lengths:
        ids = prompt(length, length)
        with torch.no_grad():
            want = reference_model(checkpoint)(torch.tensor([ids])).logits[0, -1]
        got = prefill_logits(engine, ids)
        assert (got - want).abs().max().item() < tolerance, (label, length)
        assert alone(engine, ids, new) == hf_greedy(checkpoint, ids, new), (label, length)
