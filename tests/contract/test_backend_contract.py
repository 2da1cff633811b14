"""The backend contract: every backend (eager, inductor, xla) passes the same tests (DESIGN.md §3, §8).

* 1 — static shapes: every call of a graph has the one signature of its `GraphSpec` in one of its KV windows and
  chunk buckets (the smallest window covering what it reads, the shortest bucket holding its real tokens), whatever
  the prompt length or the set of decoding slots; xla compiles each graph at most once per process.
* 2 — one KV cache: every graph receives the engine's own tensors and updates them in place, at the rows of its
  sequences' blocks (and the scratch block) only; no graph holds a cache of its own; a sequence whose blocks are
  scattered over the pool generates what it generates in contiguous ones; prompts of 1, b - 1, b, b + 1 and 2b + 1
  tokens prefilled in pieces that seam inside blocks generate transformers' tokens.
* 3 — one weight set: every graph computes with the engine's weight tensors themselves (an in-place
  change of a weight shows in every graph's output).
* 4 — a short chunk writes exactly its real rows, bitwise equal to the same tokens in a full chunk, and its
  padded columns only the scratch block (`tests/contract/kv_inspection.py`).
* 9 — interleaving: slot 0 decodes while slot 1 is half-way through its chunked prefill; the token-
  generation steps never touch slot 1's prefilled rows (its row writes to the scratch block), and both
  slots generate what they generate alone.
* parity: greedy tokens equal transformers' for every family and SmolLM2, chunked prefill (C = 8,
  S = 32) and context encoding at the boundary lengths; last-token logits within 1e-4 (fp32); a batch of
  mixed lengths; seeded sampling draws what our sampling rule draws from transformers' distributions.
  The tiny configs put sliding windows below, at and between one and two chunks (mistral 5, qwen2 8,
  gemma3 12; phi3 20), so prompts and generations cross them. Context-encoding artifacts are compiled
  for `CE_FAMILIES` only (mistral and qwen2 among them: windowed layers in a context-encoding graph);
  the later families check their context-encoding graph on eager, which runs the same modules, to keep
  each family's compile cost to one chunked artifact per backend.
* seeded sampling is reproducible; an artifact loads and generates in a fresh process without running
  model code (compiled backends); broken artifacts fail with a typed `ArtifactError`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimum.neuron.graphs import GraphKind, example_inputs, graph_args
from optimum.neuron.models.layers.kv_cache import SCRATCH_BLOCK
from optimum.neuron.runtime.sampling import SamplingParams
from tests.contract.engine_tools import (
    BACKENDS,
    GREEDY,
    Recorder,
    alone,
    by_slot,
    call_window,
    decode,
    engine_for,
    fixture_name,
    flat_tensors,
    loaded,
    neuron_model,
    prefill_logits,
    private_tensor_shapes,
    prompt,
    same,
    sequence_rows,
    sequence_slots,
)
from tests.contract.kv_inspection import FAMILIES as KV_FAMILIES
from tests.contract.kv_inspection import check_padded_chunk_writes
from tests.fixtures.artifacts import artifact_copy, edit_json, expect_artifact_error
from tests.fixtures.llm import smollm2 as smol
from tests.fixtures.llm.models import FAMILIES, export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy, hf_sampled, reference_model
from tests.models.exports import CHUNK, SEQUENCE_LENGTH, WINDOWS

LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 2, 4 * CHUNK]
NEW_TOKENS = 6
LOGIT_TOLERANCE = 1e-4
CE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""Families whose context-encoding artifact is compiled on every backend (the others: on eager only)."""


def has_ce(family: str, backend: str) -> bool:
    """Whether the contract uses ``family``'s context-encoding artifact on ``backend``."""
    return family in CE_FAMILIES or backend == "eager"


GREEDY_CASES = [
    pytest.param(family, mode, b.values[0], marks=b.marks, id=f"{family}-{mode}-{b.values[0]}")
    for b in BACKENDS
    for mode in ("chunked", "ce")
    for family in FAMILIES
    if mode == "chunked" or has_ce(family, b.values[0])
]


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
    for index, length in enumerate((1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1)):  # 1+1+1+2+3 chunk calls
        engine.admit(index, prompt(length, index), GREEDY)
        engine.step({index: length})
        if index < 3:
            engine.release(index)
    for work in ({3: 1}, {4: 1}, {3: 1, 4: 1}):  # one token-generation call each
        engine.step(work)
    assert {s.kind for s in engine.specs.values()} == {GraphKind.CHUNKED_PREFILL, GraphKind.TOKEN_GENERATION}
    buckets = engine.config.chunk_sizes
    assert buckets == ((CHUNK,) if backend == "xla" else (CHUNK // 2, CHUNK)), "auto chunk buckets"
    for name, args in recorder.calls:
        spec, window, tokens = engine.specs[name], call_window(args, engine.block_size), int(args[0].shape[1])
        span = engine.window_spans[name]
        if span is None:  # a static window: one of the artifact's buckets
            assert window in spec.windows, f"{name} was called in window {window}, not one of {spec.windows}"
        else:  # a symbolic window: whole blocks within the windows it was compiled for
            assert window % spec.block_size == 0 and span[0] <= window <= span[1], f"{name}: window {window}"
        assert tokens in (spec.chunks or (spec.tokens,)), f"{name} was called with {tokens} tokens per row"
        table = torch.zeros(spec.batch, window // spec.block_size, dtype=torch.long)
        inputs = {**example_inputs(dataclasses.replace(spec, tokens=tokens)), "block_table": table}
        expected = tuple(
            (tuple(t.shape), t.dtype) for t in flat_tensors(graph_args(spec.kind, inputs, engine.kv_cache))
        )
        assert recorder.signature(args) == expected, f"{name} was called with other shapes than its spec"
    real = [1, CHUNK - 1, CHUNK, CHUNK, 1, CHUNK, CHUNK, 1]  # real tokens of each chunk call
    chunks = [int(args[0].shape[1]) for name, args in recorder.calls if engine.specs[name].kind.is_prefill]
    assert chunks == [min(c for c in buckets if c >= n) for n in real], "not the shortest chunk bucket"
    small, full = WINDOWS
    kinds = [(engine.specs[name].kind, window) for name, window in recorder.windows()]
    # chunks start at positions 0 (five calls), 8 (two) and 16; decodes at positions 9, 17, and {10, 18}
    if backend == "xla":  # static windows: the smallest covering bucket
        prefill, decodes = [small] * 8, [small, full, full]
    else:  # symbolic windows: the fewest blocks (of 4) covering the reach, at least two
        prefill, decodes = [8] * 5 + [8, 8, 16], [12, 20, 20]
    expected = [(GraphKind.CHUNKED_PREFILL, w) for w in prefill] + [(GraphKind.TOKEN_GENERATION, w) for w in decodes]
    assert kinds == expected, "not the smallest covering window"
    assert compiles(backend) - before <= len(engine.graphs), "a graph was compiled more than once"


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_in_a_small_window_leaves_a_longer_prefill_intact(backend: str) -> None:
    """Invariant 9 with KV windows: "a" decodes in the smallest window while "b", mid-prefill, holds rows beyond it;
    the token-generation row of b's slot writes to the scratch block, so b's rows stay bitwise intact."""
    engine = engine_for(backend)
    short, long, new, early = prompt(4, 3), prompt(3 * CHUNK + 3, 4), 5, 3
    expected = {"a": alone(engine, short, new + early), "b": alone(engine, long, new)}
    a = engine.admit("a", short, GREEDY, reuse=False)  # prefilled whole, though `alone` ran it before
    engine.step({"a": len(short)})
    b = engine.admit("b", long, GREEDY, reuse=False)
    engine.step({"b": 3 * CHUNK})
    assert b.computed > WINDOWS[0] > a.computed + early
    prefilled = sequence_rows(engine, "b", b.computed)
    recorder = Recorder(engine)
    decode(engine, ["a"], early)
    windows = [w for _, w in recorder.windows()]
    assert len(windows) == early and max(windows) <= WINDOWS[0], "a's decodes did not run in the small window"
    assert same(sequence_rows(engine, "b", b.computed), prefilled), "a decode in a small window overwrote b's rows"
    engine.step({"b": b.pending})
    decode(engine, ["a", "b"], new - 1)
    assert a.generated == expected["a"], "a generated other tokens than alone"
    assert b.generated == expected["b"], "b generated other tokens than alone"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_kv_cache_updated_in_place(backend: str) -> None:
    engine = engine_for(backend)
    recorder = Recorder(engine)
    cache, block = engine.kv_cache, engine.block_size
    pointers = [t.data_ptr() for t in cache] if backend != "xla" else []  # XLA tensors have no host storage
    assert all(torch.count_nonzero(t.cpu()) == 0 for t in cache)
    length, steps = 2 * CHUNK + 3, 3
    scratch = slice(SCRATCH_BLOCK * block, (SCRATCH_BLOCK + 1) * block)  # its slots
    noise = torch.randn(cache[0][SCRATCH_BLOCK].shape).to(cache[0].dtype)
    for tensor in cache:  # marks the scratch block, to see the idle row of the token-generation graph write there
        tensor[SCRATCH_BLOCK] = noise.to(tensor.device)
    engine.admit("hold", [3], GREEDY)  # slot 0, released before any graph runs: slot 0 is free below
    assert engine.admit("seq", prompt(length, 0), GREEDY).slot == 1
    engine.release("hold")
    engine.step({"seq": length})
    decode(engine, ["seq"], steps)
    assert engine.kv_cache is cache and [t.data_ptr() for t in cache if backend != "xla"] == pointers
    for received in recorder.caches():
        assert all(a is b for a, b in zip(received, cache, strict=True)), "a graph got other cache tensors"
    written = length + steps  # the prompt and the fed tokens
    live = sequence_slots(engine, "seq", 0, written)
    for tensor in cache:
        assert tensor.shape[0] == engine.config.kv_blocks and tensor.shape[2] == block, "the pool's blocks"
        nonzero_rows = by_slot(tensor).abs().sum(dim=(1, 2)) != 0  # [slots]
        assert nonzero_rows[live].all(), "a prompt or decode row of the sequence was not written in place"
        nonzero_rows[live] = False
        nonzero_rows[scratch] = False
        assert not nonzero_rows.any(), "a row outside the sequence's positions and the scratch block was written"
        assert not torch.equal(tensor[SCRATCH_BLOCK].cpu(), noise), "the idle row missed the scratch block"
    shapes = private_tensor_shapes(engine)
    kv_shape = tuple(cache[0].shape)
    assert shapes and kv_shape not in shapes, f"a graph holds a tensor shaped like the KV cache {kv_shape}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_scattered_blocks_generate_transformers_tokens(backend: str) -> None:
    """A sequence placed in blocks spread over the pool, out of order (as vLLM may place it), generates what
    transformers generates; every other row of the cache is left as it was."""
    engine = engine_for(backend, caller_blocks=True)
    ids, new = prompt(2 * CHUNK + 5, 6), 7
    blocks = [13, 2, 9, 5, 16, 7, 11, 3]  # positions 0..31; the pool has blocks 1..16
    for tensor in engine.kv_cache:
        tensor.copy_(torch.randn(tensor.shape, dtype=tensor.dtype).to(tensor.device))
    before = [by_slot(t) for t in engine.kv_cache]
    sequence = engine.admit("scattered", ids, GREEDY, blocks=blocks[:2])
    engine.add_blocks("scattered", blocks[2:])
    engine.step({"scattered": len(ids)})
    decode(engine, ["scattered"], new - 1)
    assert sequence.generated == hf_greedy(tiny_model("llama"), ids, new), f"blocks {blocks}"
    written = sequence_slots(engine, "scattered", 0, len(ids) + new - 1)
    for old, tensor in zip(before, engine.kv_cache, strict=True):
        now = by_slot(tensor)
        keep = torch.ones(now.shape[0], dtype=torch.bool)
        keep[written] = False
        keep[SCRATCH_BLOCK * engine.block_size : (SCRATCH_BLOCK + 1) * engine.block_size] = False
        assert torch.equal(now[keep], old[keep]), "a row outside the sequence's positions was written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_boundaries_and_seams_inside_blocks_generate_transformers_tokens(backend: str) -> None:
    """Prompts of 1, b - 1, b, b + 1 and 2b + 1 tokens (b the block size), each prefilled in pieces of b - 1 tokens, so
    chunk seams fall inside blocks and across their boundaries, then decoded across block boundaries, generate what
    transformers generates."""
    engine = engine_for(backend)
    block = engine.block_size
    assert CHUNK % block == 0, "the fixtures' whole chunks seam at block boundaries; this test seams inside them"
    for length in (1, block - 1, block, block + 1, 2 * block + 1):
        ids, new, name = prompt(length, 40 + length), 2 * block + 1, f"p{length}"
        sequence = engine.admit(name, ids, GREEDY, reuse=False)
        while not sequence.generated:
            engine.step({name: min(block - 1, sequence.pending)})
        decode(engine, [name], new - 1)
        assert sequence.generated == hf_greedy(tiny_model("llama"), ids, new), f"prompt length {length}"
        engine.release(name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_weight_set_bound_to_every_graph(backend: str) -> None:
    engine = engine_for(backend)
    ids = prompt(CHUNK + 2, 3)
    assert torch.count_nonzero(prefill_logits(engine, ids)) > 0
    assert engine.hf_config.tie_word_embeddings, "the check below needs the embedding to be the LM head too"
    engine.weights["model.embed_tokens.weight"].zero_()  # in place: every hidden state and logit becomes 0
    assert torch.count_nonzero(prefill_logits(engine, ids)) == 0, "the prefill graph holds its own weights"
    for seq_id, length in (("a", len(ids)), ("b", 1)):
        engine.admit(seq_id, ids[:length], GREEDY, reuse=False)
        engine.step({seq_id: length})
    tokens = engine.step({"a": 1, "b": 1}).tokens
    assert tokens == {"a": 0, "b": 0}, "the token-generation graph holds its own weights (all-zero logits pick id 0)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chunk_before_its_prompts_last_skips_its_logits(backend: str) -> None:
    """Every chunked-prefill call says whether its logits are wanted (`GraphSpec.takes_logits_flag`): only the
    prompt's last chunk's are. A chunk before it returns zeros on the backends whose graphs branch (eager, inductor;
    xla computes the logits all the same), and writes the same KV rows as when its logits are wanted: called again
    with the flag set, it leaves the cache bitwise as it was and returns the logits the skipped call did not."""
    engine = engine_for(backend)
    calls: list[tuple[str, tuple, torch.Tensor]] = []
    for name, graph in list(engine.graphs.items()):

        def recorded(*args: object, name: str = name, graph: object = graph) -> torch.Tensor:
            out = graph(*args)  # type: ignore[operator]
            calls.append((name, args, out.cpu()))
            return out

        engine.graphs[name] = recorded
    engine.admit("a", prompt(2 * CHUNK + 1, 4), GREEDY, reuse=False)
    engine.step({"a": 2 * CHUNK + 1})
    assert [engine.specs[name].takes_logits_flag for name, _, _ in calls] == [True] * 3, "three chunk calls"
    assert [bool(args[-1].item()) for _, args, _ in calls] == [False, False, True], "only the last chunk's wanted"
    skips = engine.config.backend in ("eager", "inductor")
    for _, _, out in calls[:2]:
        assert (torch.count_nonzero(out) == 0) == skips, "skipped logits are zeros, computed ones are not"
    name, args, skipped = calls[0]
    before = [t.clone() for t in engine.kv_cache]
    wanted = engine.graphs[name](*args[:-1], torch.ones_like(args[-1])).cpu()
    assert same(list(engine.kv_cache), before), "the chunk wrote other rows when its logits were wanted"
    assert torch.count_nonzero(wanted) > 0 and torch.isfinite(wanted).all()
    if not skips:
        assert torch.equal(wanted, skipped)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_while_another_slot_is_half_prefilled(backend: str) -> None:
    engine = engine_for(backend)
    short, long = prompt(5, 1), prompt(2 * CHUNK + 5, 2)
    new, early = 7, 5  # "a" decodes `early` steps while "b" is half-way through its prefill
    expected = {"a": alone(engine, short, new + early), "b": alone(engine, long, new)}
    assert len(long) + new <= SEQUENCE_LENGTH
    for tensor in engine.kv_cache:  # stale rows of the runs above must not matter
        tensor.copy_(torch.randn(tensor.shape, dtype=tensor.dtype).to(tensor.device))
    a = engine.admit("a", short, GREEDY, reuse=False)  # prefilled whole, though `alone` ran it before
    engine.step({"a": len(short)})
    b = engine.admit("b", long, GREEDY, reuse=False)
    assert (a.slot, b.slot) == (0, 1)
    for together in (False, True):  # b's first two chunks: alone in a step, then beside a decode of a
        live_a = sequence_rows(engine, "a", a.computed)
        engine.step({"b": CHUNK, "a": 1} if together else {"b": CHUNK})
        assert same(sequence_rows(engine, "a", live_a[0].shape[0]), live_a), "b's prefill overwrote a's rows"
        prefilled = sequence_rows(engine, "b", b.computed)
        decode(engine, ["a"], 2)
        assert same(sequence_rows(engine, "b", b.computed), prefilled), "a decode step overwrote b's prefill"
    engine.step({"b": b.pending})
    decode(engine, ["a", "b"], new - 1)
    assert a.generated == expected["a"], "a generated other tokens than alone"
    assert b.generated == expected["b"], "b generated other tokens than alone"


@pytest.mark.slow
@pytest.mark.parametrize(("family", "mode", "backend"), GREEDY_CASES)
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
    engines = {"chunked": neuron_model(fixture_name(family, backend)).engine}
    if has_ce(family, backend):
        engines["ce"] = neuron_model(fixture_name(family, backend, chunked=False)).engine
    ref = reference_model(tiny_model(family))
    for length in (1, CHUNK + 1, 3 * CHUNK + 3, 4 * CHUNK):
        ids = prompt(length, length)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0, -1]
        for mode, engine in engines.items():
            got = prefill_logits(engine, ids)
            assert torch.allclose(got, expected, atol=LOGIT_TOLERANCE), (
                f"{mode} {length}: {(got - expected).abs().max()}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_matches_transformers(family: str, backend: str) -> None:
    model = neuron_model(fixture_name(family, backend))
    short, long = prompt(CHUNK - 1, 11), prompt(3 * CHUNK + 2, 12)
    ids = torch.zeros(2, len(long), dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, -len(short) :], mask[0, -len(short) :] = torch.tensor(short), 1  # left padding
    ids[1], mask[1] = torch.tensor(long), 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])[:, len(long) :]
    for row, ids_row in enumerate((short, long)):
        assert out[row].tolist() == hf_greedy(tiny_model(family), ids_row, NEW_TOKENS), f"row {row}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_sampling_matches_transformers(family: str, backend: str) -> None:
    model = neuron_model(fixture_name(family, backend))
    ids, new = prompt(2 * CHUNK + 3, 13), 12
    params = SamplingParams(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, seed=21)
    kwargs = {"do_sample": True, "temperature": 1.3, "top_k": 40, "top_p": 0.9, "seed": 21}
    ours = model.generate(torch.tensor([ids]), max_new_tokens=new, eos_token_id=[], **kwargs)[0, len(ids) :].tolist()
    assert ours == hf_sampled(tiny_model(family), ids, new, params, model.engine.config.max_topk)


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
@pytest.mark.parametrize("family", KV_FAMILIES)
def test_padded_chunk_writes_only_its_real_rows_bitwise(family: str, backend: str) -> None:
    check_padded_chunk_writes(backend, "fp32", family)


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


@pytest.mark.slow
@pytest.mark.xdist_group(smol.XDIST_GROUP)
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_greedy_matches_transformers(backend: str) -> None:
    name = smol.CHUNKED.format(backend=backend)
    model = loaded(smol.smollm2_artifact(name))
    ids = smol.long_chat_ids()
    ours = model.generate(ids, max_new_tokens=smol.NEW_TOKENS, eos_token_id=[])[0, ids.shape[1] :].tolist()
    assert ours == smol.hf_greedy(ids), f"{name}: {smol.tokenizer().decode(ours)!r}"
    with torch.no_grad():
        expected = smol.reference()(ids).logits[0, -1]
    diff = (prefill_logits(model.engine, ids[0].tolist()) - expected).abs().max().item()
    assert diff <= smol.LOGIT_TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
