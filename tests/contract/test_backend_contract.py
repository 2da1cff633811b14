"""The backend contract: every backend (eager, inductor, xla) passes the same tests (DESIGN.md §3, §8).

* 1 — static shapes: every call of a graph has the one signature of its `GraphSpec`, whatever the
  prompt length or the set of decoding slots; xla compiles each graph at most once per process.
* 2 — one KV cache: every graph receives the engine's own tensors and updates them in place, at
  ``(slot, position)`` rows only; no graph holds a cache of its own.
* 3 — one weight set: every graph computes with the engine's weight tensors themselves (an in-place
  change of a weight shows in every graph's output).
* 4 — padded K/V rows of a short chunk equal the real last token's bitwise (`tests/models/test_kv_bitwise.py`).
* 9 — interleaving: slot 0 decodes while slot 1 is half-way through its chunked prefill; the token-
  generation steps never touch slot 1's prefilled rows, and both slots generate what they generate alone.
* parity: greedy tokens equal transformers' for every family and SmolLM2, chunked prefill (C = 8,
  S = 32) and context encoding at the boundary lengths; last-token logits within 1e-4 (fp32).
* seeded sampling is reproducible; an artifact loads and generates in a fresh process without running
  model code (compiled backends); broken artifacts fail with a typed `ArtifactError`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimum.neuron import NeuronModelForCausalLM
from optimum.neuron.graphs import GraphKind, example_inputs, graph_args
from optimum.neuron.runtime.sampling import SamplingParams, SequenceSampler
from tests.contract.engine_tools import (
    BACKENDS,
    Recorder,
    alone,
    decode_steps,
    engine_for,
    fixture_name,
    flat_tensors,
    greedy,
    private_tensor_shapes,
    prompt,
    same,
    slot_rows,
)
from tests.export.test_artifacts import artifact_copy, edit_json, expect_artifact_error
from tests.fixtures.llm.models import FAMILIES, export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy, reference_model
from tests.models import test_kv_bitwise as kv_bitwise
from tests.models.exports import CHUNK, SEQUENCE_LENGTH

LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK, 4 * CHUNK]
NEW_TOKENS = 6
LOGIT_TOLERANCE = 1e-4

_models: dict[str, NeuronModelForCausalLM] = {}


def neuron_model(name: str) -> NeuronModelForCausalLM:
    """The named fixture, loaded once per test session."""
    if name not in _models:
        _models[name] = NeuronModelForCausalLM.from_pretrained(export_fixture(name))
    return _models[name]


def compiles(backend: str) -> int:
    """Graphs compiled by this process so far at run time (only xla compiles when a graph is first called)."""
    if backend != "xla":
        return 0
    from optimum.neuron.backends import xla_compat

    return xla_compat.compile_count()


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_are_called_with_their_static_shapes_only(backend: str) -> None:
    engine = engine_for(backend)
    recorder = Recorder(engine)
    before = compiles(backend)
    for slot, length in enumerate((1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1)):
        engine.prefill(prompt(length, slot), slot % 2)
    for active in ({0: (5, 20)}, {1: (6, 21)}, {0: (7, 22), 1: (8, 23)}):
        engine.decode(active, {s: SequenceSampler(SamplingParams()) for s in active})
    for kind in (GraphKind.CHUNKED_PREFILL, GraphKind.TOKEN_GENERATION):
        example = graph_args(kind, example_inputs(engine.config, kind, engine.hf_config.vocab_size), engine.kv_cache)
        expected = {tuple((tuple(t.shape), t.dtype) for t in flat_tensors(example))}
        assert recorder.signatures(kind) == expected, f"{kind.value} was called with other shapes than its spec"
    assert len(recorder.calls) == 8 + 3, "unexpected number of graph calls"
    assert compiles(backend) - before <= len(engine.graphs), "a graph was compiled more than once"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_kv_cache_updated_in_place(backend: str) -> None:
    engine = engine_for(backend)
    recorder = Recorder(engine)
    cache = engine.kv_cache
    pointers = [t.data_ptr() for t in cache] if backend != "xla" else []  # XLA tensors have no host storage
    assert all(torch.count_nonzero(t.cpu()) == 0 for t in cache)
    length, steps = 2 * CHUNK + 3, 3
    tokens = {1: [greedy(engine.prefill(prompt(length, 0), 1))]}
    decode_steps(engine, tokens, {1: length}, steps)
    assert engine.kv_cache is cache and [t.data_ptr() for t in cache if backend != "xla"] == pointers
    for received in recorder.caches():
        assert all(a is b for a, b in zip(received, cache, strict=True)), "a graph got other cache tensors"
    written = length + steps  # the prompt and the fed tokens, slot 1
    for tensor in cache:
        nonzero_rows = tensor.cpu().abs().sum(dim=(1, 3)) != 0  # [batch, sequence]
        assert nonzero_rows[1, :written].all(), "a prompt or decode row of slot 1 was not written in place"
        assert not nonzero_rows[1, written:].any(), "slot 1 was written past its last token"
        assert not nonzero_rows[0, 1:].any(), "slot 0 (free) was written beyond its next free position 0"
    shapes = private_tensor_shapes(engine)
    kv_shape = tuple(cache[0].shape)
    assert shapes and kv_shape not in shapes, f"a graph holds a tensor shaped like the KV cache {kv_shape}"


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
        tensor.copy_(torch.randn(tensor.shape, dtype=tensor.dtype).to(tensor.device))
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


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["chunked", "ce"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family: str, mode: str, backend: str) -> None:
    name = fixture_name(family, backend, chunked=mode == "chunked")
    model = neuron_model(name)
    for length in LENGTHS:
        ids = prompt(length, length)
        new = min(NEW_TOKENS, SEQUENCE_LENGTH - length + 1)  # a 4C = S prompt fills the cache: one token
        ours = model.generate(torch.tensor([ids]), max_new_tokens=new, eos_token_id=[])[0, length:].tolist()
        assert ours == hf_greedy(tiny_model(family), ids, new), f"{name}: prompt length {length}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match(family: str, backend: str) -> None:
    chunked = neuron_model(fixture_name(family, backend)).engine
    ce = neuron_model(fixture_name(family, backend, chunked=False)).engine
    ref = reference_model(tiny_model(family))
    for length in (1, CHUNK + 1, 3 * CHUNK + 3, 4 * CHUNK):
        ids = prompt(length, length)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0, -1]
        got_chunked, got_ce = chunked.prefill(ids, 1), ce.prefill(ids, 1)
        assert torch.allclose(got_chunked, expected, atol=LOGIT_TOLERANCE), (got_chunked - expected).abs().max()
        assert torch.allclose(got_ce, expected, atol=LOGIT_TOLERANCE), (got_ce - expected).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["chunked", "ce"])
def test_seeded_sampling(mode: str, backend: str) -> None:
    model = neuron_model(fixture_name("llama", backend, chunked=mode == "chunked"))
    ids = torch.tensor([prompt(CHUNK + 3, 0)])
    kwargs = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "top_k": 50, "top_p": 0.95}
    first = model.generate(ids, seed=7, eos_token_id=[], **kwargs)
    assert torch.equal(first, model.generate(ids, seed=7, eos_token_id=[], **kwargs))
    assert not torch.equal(first, model.generate(ids, seed=8, eos_token_id=[], **kwargs)), "seeds 7 and 8 agree"
    greedy_tokens = model.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(model.generate(ids, seed=3, eos_token_id=[], **{**kwargs, "top_k": 1}), greedy_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_kv_rows_are_bitwise_the_last_real_token(backend: str) -> None:
    kv_bitwise.test_padded_columns_compute_the_last_real_kv(backend, "fp32")
    kv_bitwise.test_padded_chunk_writes_what_an_unpadded_chunk_writes(backend, "fp32")


_CHILD = """
import json, sys, torch
from optimum.neuron import NeuronModelForCausalLM
model = NeuronModelForCausalLM.from_pretrained(sys.argv[1])
ids = json.loads(sys.argv[2])
out = model.generate(torch.tensor([ids]), max_new_tokens=6, eos_token_id=[])[0, len(ids):].tolist()
print(json.dumps({"tokens": out, "model_code_ran": model.engine._decoder is not None}))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_loads_in_a_fresh_process(backend: str) -> None:
    artifact = export_fixture(fixture_name("llama", backend))  # exported here, loaded by a new interpreter
    ids = prompt(2 * CHUNK + 1, 4)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(artifact), json.dumps(ids)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == hf_greedy(tiny_model("llama"), ids, 6)
    assert result["model_code_ran"] is (backend == "eager"), "a compiled backend ran the model's Python code"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("damage", ["graph_hash", "graph_missing", "weights", "torch_version"])
def test_broken_artifact_is_a_typed_error(tmp_path: Path, backend: str, damage: str) -> None:
    root = artifact_copy(fixture_name("llama", backend), tmp_path)
    manifest = json.loads((root / "graphs" / "manifest.json").read_text())
    graph = root / manifest["graphs"]["token_generation"]["file"]
    if damage == "graph_hash":
        graph.write_bytes(graph.read_bytes() + b" ")
        expect_artifact_error(root, "does not match its recorded hash")
    elif damage == "graph_missing":
        graph.unlink()
        expect_artifact_error(root, graph.name)
    elif damage == "weights":
        weights = load_file(str(root / "model.safetensors"))
        weights["model.norm.weight"] = torch.ones(7)
        save_file(weights, str(root / "model.safetensors"))
        expect_artifact_error(root, "does not match the weights")
    else:
        edit_json(root / "neuron_config.json", lambda c: c["versions"].update({"torch": "2.0.0"}))
        expect_artifact_error(root, "exported with", "2.0.0")


def _smollm2_engine_name(backend: str) -> str:
    return f"smollm2-1x4x128-{backend}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_greedy_matches_transformers(backend: str) -> None:
    from optimum.exporters.neuron.cache import cache_root
    from optimum.exporters.neuron.export import export
    from optimum.neuron import NeuronConfig
    from tests.models import test_smollm2 as smol

    config = NeuronConfig(
        batch_size=1, sequence_length=smol.SEQUENCE_LENGTH, prefill_chunk_size=smol.CHUNK, backend=backend
    )
    name = _smollm2_engine_name(backend)
    model = NeuronModelForCausalLM.from_pretrained(export(smol.smollm2_dir(), cache_root() / "fixtures" / name, config))
    ids = smol.long_chat_ids()
    ours = model.generate(ids, max_new_tokens=smol.NEW_TOKENS, eos_token_id=[])[0, ids.shape[1] :].tolist()
    assert ours == smol.hf_greedy(ids), f"{name}: {smol.tokenizer().decode(ours)!r}"
    with torch.no_grad():
        expected = smol.reference()(ids).logits[0, -1]
    diff = (model.engine.prefill(ids[0].tolist(), 0) - expected).abs().max().item()
    assert diff <= smol.LOGIT_TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
