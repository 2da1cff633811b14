"""KV-length buckets: how ``--kv_buckets`` resolves to windows, which graphs an artifact compiles for them on
each kind of backend, and the rules that pick a call's window (the smallest covering bucket; on a symbolic window,
the fewest blocks covering what it reads)."""

from __future__ import annotations

import pytest

from optimum.neuron.config import NeuronConfig
from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.graphs import GraphKind, exact_window, graph_specs, select_graph, symbolic_dims, window_spans


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({"sequence_length": 2048, "prefill_chunk_size": 256}, (256, 512, 1024, 2048)),
        ({"sequence_length": 2048, "prefill_chunk_size": 512}, (512, 1024, 2048)),  # never below the chunk
        ({"sequence_length": 1000, "prefill_chunk_size": 0}, (256, 512, 1000)),  # S is always the last window
        ({"sequence_length": 256, "prefill_chunk_size": 64}, (256,)),
        ({"sequence_length": 32, "prefill_chunk_size": 8}, (32,)),  # auto never goes below 256
        ({"sequence_length": 2048, "kv_buckets": "none"}, (2048,)),
        ({"sequence_length": 2048, "kv_buckets": "128, 1024"}, (128, 1024, 2048)),
        ({"sequence_length": 32, "prefill_chunk_size": 8, "kv_buckets": "16,32"}, (16, 32)),
    ],
)
def test_kv_buckets_resolve_to_windows(fields: dict, windows: tuple[int, ...]) -> None:
    assert NeuronConfig(**fields).kv_windows == windows


@pytest.mark.parametrize(
    ("buckets", "fragment"),
    [
        ("16,8", "strictly increasing"),
        ("4", "between 8"),  # below the chunk
        ("16,64", "sequence_length=32"),  # above the sequence length
        ("big", "not auto, none or a list"),
        ("", "not auto, none or a list"),
    ],
)
def test_bad_kv_buckets_are_refused_naming_the_flag(buckets: str, fragment: str) -> None:
    with pytest.raises(IncompatibleConfigError, match="--kv_buckets") as raised:
        NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets=buckets)
    assert fragment in str(raised.value)


def test_symbolic_window_backends_compile_each_graph_once() -> None:
    config = NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", backend="inductor")
    specs = graph_specs(config)
    assert [s.name for s in specs] == ["chunked_prefill", "token_generation", "token_generation_logits"]
    assert all(s.windows == (16, 32) and s.symbolic_window for s in specs)
    assert all(symbolic_dims(s) is not None for s in specs)
    single = graph_specs(config.derive(kv_buckets="none", chunk_buckets="none"))
    assert all(symbolic_dims(s) is None for s in single), "one window and one chunk length need no symbolic dimension"


def test_static_backends_compile_one_graph_per_window() -> None:
    config = NeuronConfig(
        sequence_length=32,
        prefill_chunk_size=8,
        kv_buckets="16",
        backend="xla",
        prompt_logprobs=True,
    )
    names = [s.name for s in graph_specs(config)]
    assert names == [
        "chunked_prefill_w16",
        "chunked_prefill",
        "chunked_prefill_all_rows",  # the logits variants run only for requests asking logits: full window
        "token_generation_w16",
        "token_generation",
        "token_generation_logits",
    ]
    ce = graph_specs(NeuronConfig(sequence_length=32, kv_buckets="16", backend="xla", decode_logits=False))
    assert [s.name for s in ce] == ["context_encoding", "token_generation_w16", "token_generation"]
    assert ce[0].windows == (), "context encoding reads no earlier cache"


@pytest.mark.parametrize("backend", ["inductor", "xla"])
@pytest.mark.parametrize(("kind", "reach", "window"), [
    (GraphKind.TOKEN_GENERATION, 1, 16),
    (GraphKind.TOKEN_GENERATION, 16, 16),
    (GraphKind.TOKEN_GENERATION, 17, 32),
    (GraphKind.CHUNKED_PREFILL, 0, 16),
    (GraphKind.CHUNKED_PREFILL, 16, 16),
    (GraphKind.CHUNKED_PREFILL, 24, 32),
])  # fmt: skip
def test_the_smallest_covering_window_is_chosen(backend: str, kind: GraphKind, reach: int, window: int) -> None:
    specs = graph_specs(NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", backend=backend))
    found = select_graph(specs, kind, reach=reach)
    assert found is not None
    spec, chosen, _ = found
    assert chosen == window and window in spec.windows
    assert select_graph(specs, kind, reach=33) is None, "nothing reads past the sequence length"


def test_logits_variants_run_in_the_full_window_on_static_backends() -> None:
    specs = graph_specs(NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", backend="xla"))
    found = select_graph(specs, GraphKind.TOKEN_GENERATION, logits=True, reach=3)
    assert found is not None and found[1] == 32 and found[0].name == "token_generation_logits"


def test_neuron_config_json_lists_the_windows() -> None:
    import json

    config = NeuronConfig(sequence_length=2048, prefill_chunk_size=256)
    body = json.loads(config.to_json(["chunked_prefill", "token_generation"]))
    assert (body["kv_buckets"], body["kv_windows"]) == ("auto", [256, 512, 1024, 2048])
    assert NeuronConfig.from_json(config.to_json([])) == config


@pytest.mark.parametrize(("reach", "window"), [(0, 8), (1, 8), (8, 8), (9, 12), (16, 16), (17, 20), (32, 32)])
def test_a_symbolic_window_reads_the_fewest_blocks_covering_the_call(reach: int, window: int) -> None:
    """Blocks of 4, windows 16 and 32 compiled as one graph spanning 8 (two blocks) to 32: a call reads what covers its
    reach, at least the span's lowest, at most its bucket."""
    config = NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", kv_block_size=4)
    specs = graph_specs(config)
    spans = window_spans(specs)
    assert set(spans.values()) == {(8, 32)} and set(spans) == {s.name for s in specs}
    for kind in (GraphKind.TOKEN_GENERATION, GraphKind.CHUNKED_PREFILL):
        found = select_graph(specs, kind, reach=reach)
        assert found is not None
        call = exact_window(found, spans[found.spec.name], reach)
        assert (call.spec, call.window, call.tokens) == (found.spec, window, found.tokens)
        assert exact_window(found, None, reach) == found, "an artifact that records no span keeps to its buckets"


def test_static_windows_record_no_span_and_keep_their_buckets() -> None:
    specs = graph_specs(NeuronConfig(sequence_length=32, prefill_chunk_size=8, kv_buckets="16", backend="xla"))
    assert window_spans(specs) == {}
    found = select_graph(specs, GraphKind.TOKEN_GENERATION, reach=3)
    assert found is not None and exact_window(found, (8, 32), 3) == found
