"""Engine-level invariants on the named export fixtures, eager and inductor (DESIGN.md §3).

* 1 — static shapes: every call of a graph has the one signature of its `GraphSpec`, whatever the
  prompt length or the set of decoding slots.
* 2 — one KV cache: every graph receives the engine's own tensors and updates them in place, at
  ``(slot, position)`` rows only; no graph holds a cache of its own.
* 3 — one weight set: every graph computes with the engine's weight tensors themselves (an in-place
  change of a weight shows in every graph's output).
* 9 — interleaving: slot 0 decodes while slot 1 is half-way through its chunked prefill; the token-
  generation steps never touch slot 1's prefilled rows, and both slots generate what they generate alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optimum.neuron.graphs import GraphKind, example_inputs, graph_args
from optimum.neuron.runtime.artifacts import Artifact
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sampling import SamplingParams, SequenceSampler
from tests.fixtures.llm.models import export_fixture
from tests.models.exports import CHUNK, SEQUENCE_LENGTH

BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.slow)]
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def engine_for(backend: str) -> Engine:
    """A fresh engine on ``llama-2x4x8-<backend>`` (batch 2, chunk 8, sequence length 32)."""
    return Engine(Artifact.open(export_fixture(f"llama-2x4x8-{backend}")))


def prompt(length: int, seed: int) -> list[int]:
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
        return {tuple((tuple(t.shape), t.dtype) for t in flat_tensors(a)) for k, a in self.calls if k is kind}

    def caches(self) -> list[list[torch.Tensor]]:
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
    """Copies of rows ``[0, last)`` of ``slot`` in every K and V tensor."""
    return [t[slot, :, :last].clone() for t in engine.kv_cache]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_are_called_with_their_static_shapes_only(backend: str) -> None:
    engine = engine_for(backend)
    recorder = Recorder(engine)
    for slot, length in enumerate((1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1)):
        engine.prefill(prompt(length, slot), slot % 2)
    for active in ({0: (5, 20)}, {1: (6, 21)}, {0: (7, 22), 1: (8, 23)}):
        engine.decode(active, {s: SequenceSampler(SamplingParams()) for s in active})
    for kind in (GraphKind.CHUNKED_PREFILL, GraphKind.TOKEN_GENERATION):
        example = graph_args(kind, example_inputs(engine.config, kind, engine.hf_config.vocab_size), engine.kv_cache)
        expected = {tuple((tuple(t.shape), t.dtype) for t in flat_tensors(example))}
        assert recorder.signatures(kind) == expected, f"{kind.value} was called with other shapes than its spec"
    assert len(recorder.calls) == 8 + 3, "unexpected number of graph calls"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_kv_cache_updated_in_place(backend: str) -> None:
    engine = engine_for(backend)
    recorder = Recorder(engine)
    cache = engine.kv_cache
    pointers = [t.data_ptr() for t in cache]
    assert all(torch.count_nonzero(t) == 0 for t in cache)
    length, steps = 2 * CHUNK + 3, 3
    tokens = {1: [greedy(engine.prefill(prompt(length, 0), 1))]}
    decode_steps(engine, tokens, {1: length}, steps)
    assert engine.kv_cache is cache and [t.data_ptr() for t in cache] == pointers
    for received in recorder.caches():
        assert all(a is b for a, b in zip(received, cache, strict=True)), "a graph got other cache tensors"
    written = length + steps  # the prompt and the fed tokens, slot 1
    for tensor in cache:
        nonzero_rows = tensor.abs().sum(dim=(1, 3)) != 0  # [batch, sequence]
        assert nonzero_rows[1, :written].all(), "a prompt or decode row of slot 1 was not written in place"
        assert not nonzero_rows[1, written:].any(), "slot 1 was written past its last token"
        assert not nonzero_rows[0, 1:].any(), "slot 0 (free) was written beyond its next free position 0"
    shapes = private_tensor_shapes(engine)
    kv_shape = tuple(cache[0].shape)
    assert shapes and kv_shape not in shapes, f"a graph holds a tensor shaped like the KV cache {kv_shape}"


def private_tensor_shapes(engine: Engine) -> set[tuple[int, ...]]:
    """Shapes of the tensors the graphs hold themselves (eager module state or AOTI constants)."""
    if engine.config.backend == "eager":
        engine._module(GraphKind.TOKEN_GENERATION)  # builds the shared decoder if no call did yet
        assert engine._decoder is not None
        return {tuple(t.shape) for t in engine._decoder.state_dict().values()}
    shapes = set()
    for kind in engine.graphs:
        package = torch._inductor.aoti_load_package(str(engine.artifact.graph_path(kind)))
        names = set(package.get_constant_fqns())
        assert names <= set(engine.weights), f"{kind.value} holds constants that are not weights"
        shapes |= {tuple(engine.weights[n].shape) for n in names}
    return shapes


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_weight_set_bound_to_every_graph(backend: str) -> None:
    engine = engine_for(backend)
    ids = prompt(CHUNK + 2, 3)
    assert torch.count_nonzero(engine.prefill(ids, 0)) > 0
    assert engine.hf_config.tie_word_embeddings, "the check below needs the embedding to be the LM head too"
    engine.weights["model.embed_tokens.weight"].zero_()  # in place: every hidden state and logit becomes 0
    assert torch.count_nonzero(engine.prefill(ids, 0)) == 0, "the prefill graph holds its own weights"
    samplers = {s: SequenceSampler(SamplingParams()) for s in (0, 1)}
    tokens = engine.decode({0: (ids[-1], len(ids)), 1: (ids[0], 0)}, samplers)
    assert tokens == {0: 0, 1: 0}, "the token-generation graph holds its own weights (all-zero logits pick id 0)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_while_another_slot_is_half_prefilled(backend: str) -> None:
    engine = engine_for(backend)
    short, long = prompt(5, 1), prompt(2 * CHUNK + 5, 2)
    new, early = 7, 4  # slot 0 decodes `early` steps while slot 1 is half-way through its prefill
    expected = {0: alone(engine, 0, short, new + early), 1: alone(engine, 1, long, new)}
    assert len(long) + new <= SEQUENCE_LENGTH
    for tensor in engine.kv_cache:  # stale rows of the runs above must not matter
        tensor.normal_()
    engine.reset_slot(0)
    engine.reset_slot(1)
    tokens = {0: [greedy(engine.prefill(short, 0))]}
    for start in (0, CHUNK):  # slot 1's first two chunks, each followed by decode steps of slot 0
        live0 = slot_rows(engine, 0, len(short) + len(tokens[0]) - 1)
        engine.prefill_chunk(long[start : start + CHUNK], list(range(start, start + CHUNK)), 1)
        assert same(slot_rows(engine, 0, live0[0].shape[1]), live0), "slot 1's prefill overwrote slot 0's rows"
        prefilled = slot_rows(engine, 1, start + CHUNK)
        decode_steps(engine, tokens, {0: len(short)}, early // 2)
        assert same(slot_rows(engine, 1, start + CHUNK), prefilled), "a decode step overwrote slot 1's prefill"
    rest = long[2 * CHUNK :]
    tokens[1] = [greedy(engine.prefill_chunk(rest, list(range(2 * CHUNK, len(long))), 1))]
    decode_steps(engine, tokens, {0: len(short), 1: len(long)}, new - 1)
    assert tokens[0] == expected[0], "slot 0 generated other tokens than alone"
    assert tokens[1] == expected[1], "slot 1 generated other tokens than alone"
