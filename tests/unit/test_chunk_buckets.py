"""Chunk-length buckets (`--chunk_buckets`): the lengths a chunked-prefill call runs at, how they compile on each
backend, and which one a call of n real tokens takes."""

from __future__ import annotations

import pytest

from optimum.neuron import NeuronConfig
from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.graphs import GraphKind, graph_fields, graph_specs, select_graph, symbolic_dims


@pytest.mark.parametrize(("backend", "chunk", "spec", "sizes"), [
    ("inductor", 256, "auto", (4, 8, *range(16, 257, 16))),  # every multiple of 16, 4 and 8 below it
    ("eager", 8, "auto", (4, 8)),
    ("inductor", 12, "auto", (4, 8, 12)),
    ("inductor", 100, "auto", (4, 8, 16, 32, 48, 64, 80, 96, 100)),  # the chunk itself after the last multiple
    ("inductor", 4, "auto", (4,)),
    ("xla", 256, "auto", (256,)),  # static shapes: a bucket is one more graph per window, so only on request
    ("inductor", 256, "none", (256,)),
    ("inductor", 256, "64,128", (64, 128, 256)),
    ("xla", 256, "64,256", (64, 256)),
    ("inductor", 0, "auto", ()),  # context encoding: one [1, S] call
])  # fmt: skip
def test_chunk_sizes_resolve_auto_none_and_lists(backend: str, chunk: int, spec: str, sizes: tuple[int, ...]) -> None:
    config = NeuronConfig(sequence_length=512, prefill_chunk_size=chunk, chunk_buckets=spec, backend=backend)
    assert config.chunk_sizes == sizes


@pytest.mark.parametrize(("spec", "chunk", "fragment"), [
    ("64,abc", 256, "list of integers"),
    ("128,64", 256, "strictly increasing"),
    ("2,128", 256, "between 4 and prefill_chunk_size=256"),
    ("512", 256, "between 4 and prefill_chunk_size=256"),
    ("64", 0, "--prefill_chunk_size"),
])  # fmt: skip
def test_bad_chunk_buckets_are_refused_naming_the_flag(spec: str, chunk: int, fragment: str) -> None:
    with pytest.raises(IncompatibleConfigError, match="--chunk_buckets") as raised:
        NeuronConfig(sequence_length=512, prefill_chunk_size=chunk, chunk_buckets=spec)
    assert fragment in str(raised.value)


def test_symbolic_backends_compile_one_prefill_graph_for_every_bucket() -> None:
    config = NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="none", backend="inductor")
    prefill, generation, _ = graph_specs(config)
    assert prefill.name == "chunked_prefill" and prefill.chunks == (4, 8) and prefill.tokens == 8
    assert symbolic_dims(prefill) is not None and set(symbolic_dims(prefill) or {}) == {
        "input_ids",
        "position_ids",
        "slot_mapping",
    }, "one window: only the chunk columns are symbolic"
    assert symbolic_dims(generation) is None, "token generation has one token per row"
    assert "chunk_buckets" not in graph_fields(config), "the buckets reach a graph through its spec only"


def test_static_backends_compile_one_graph_per_bucket_and_window() -> None:
    config = NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", chunk_buckets="4", backend="xla")
    specs = graph_specs(config.derive(prompt_logprobs=True))
    assert [s.name for s in specs] == [
        "chunked_prefill_c4_w16",
        "chunked_prefill_c4",
        "chunked_prefill_w16",
        "chunked_prefill",
        "chunked_prefill_all_rows",  # the logits variants run only for requests asking logits: full chunk and window
        "token_generation_w16",
        "token_generation",
        "token_generation_logits",
    ]
    assert all(s.tokens == s.chunks[0] for s in specs if s.kind is GraphKind.CHUNKED_PREFILL)


@pytest.mark.parametrize("backend", ["inductor", "xla"])
@pytest.mark.parametrize(("tokens", "reach", "call"), [
    (1, 0, (4, 16)),
    (4, 16, (4, 16)),
    (5, 16, (8, 16)),
    (8, 17, (8, 32)),
    (3, 24, (4, 32)),
])  # fmt: skip
def test_a_call_takes_the_shortest_bucket_holding_its_tokens(
    backend: str, tokens: int, reach: int, call: tuple[int, int]
) -> None:
    config = NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", chunk_buckets="4", backend=backend)
    found = select_graph(graph_specs(config), GraphKind.CHUNKED_PREFILL, reach=reach, tokens=tokens)
    assert found is not None
    assert (found.tokens, found.window) == call
    assert found.tokens in found.spec.chunks and found.window in found.spec.windows
    assert select_graph(graph_specs(config), GraphKind.CHUNKED_PREFILL, tokens=9) is None, "a chunk holds at most C"
