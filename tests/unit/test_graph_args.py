"""`graphs.graph_args`, the one source of each graph's argument order: a chunked-prefill graph returning the last
real token's logits takes ``wants_logits`` last, the optional arguments left out before it passed as None."""

from __future__ import annotations

import dataclasses

import torch

from optimum.neuron.graphs import GraphKind, GraphSpec, example_inputs, graph_args

CHUNK = GraphSpec(GraphKind.CHUNKED_PREFILL, 1, 8, False, windows=(0, 16), block_size=4, chunks=(8,), chunk_size=8)


def test_a_chunk_takes_wants_logits_last() -> None:
    cache = [torch.zeros(1)]
    inputs = example_inputs(CHUNK)
    assert CHUNK.takes_logits_flag and inputs["wants_logits"].dtype == torch.bool
    args = graph_args(CHUNK.kind, inputs, cache)
    assert args[3] is cache and args[4] is inputs["block_table"] and args[5] is None
    assert args[-1] is inputs["wants_logits"] and len(args) == 7
    without_window = {k: v for k, v in inputs.items() if k != "block_table"}  # a call in window 0 reads no cache
    assert graph_args(CHUNK.kind, without_window, cache)[4:] == (None, None, inputs["wants_logits"])


def test_graphs_returning_every_row_or_no_chunk_take_no_flag() -> None:
    for spec in (
        dataclasses.replace(CHUNK, all_rows=True),
        dataclasses.replace(CHUNK, kind=GraphKind.CONTEXT_ENCODING, windows=(), chunks=(), chunk_size=0),
        dataclasses.replace(CHUNK, kind=GraphKind.VERIFICATION),
    ):
        inputs = example_inputs(spec)
        assert not spec.takes_logits_flag and "wants_logits" not in inputs, spec.name
        assert graph_args(spec.kind, inputs, [torch.zeros(1)])[-1] is not None, spec.name


def test_verification_and_token_generation_keep_their_order() -> None:
    """A verification graph holds None in its absent window's place before the adapters; a token-generation graph
    takes its block table, then the four sampling inputs (None each when it returns logits), then the adapters."""
    cache, slots = [torch.zeros(1)], torch.zeros(2, dtype=torch.int32)
    table = torch.zeros(2, 4, dtype=torch.int32)
    tokens = {"input_ids": slots, "position_ids": slots, "slot_mapping": slots}
    sampling = {k: torch.ones(2) for k in ("temperature", "top_k", "top_p", "uniforms")}
    verify = graph_args(GraphKind.VERIFICATION, {**tokens, "adapter_ids": slots}, cache)
    assert verify[3] is cache and verify[4:] == (None, slots)  # no window: the block table's place holds None
    assert graph_args(GraphKind.VERIFICATION, tokens, cache)[3:] == (cache,)
    step = graph_args(GraphKind.TOKEN_GENERATION, {**tokens, "block_table": table, **sampling}, cache)
    assert step[4] is table and step[5:] == tuple(sampling.values())
    logits_only = graph_args(GraphKind.TOKEN_GENERATION, {**tokens, "block_table": table, "adapter_ids": slots}, cache)
    assert logits_only[4] is table and logits_only[5:] == (None, None, None, None, slots)
