"""Idefics3 (tiny random SmolVLM layout, fp32): greedy parity with transformers for prompts with images whose
placeholder spans fit in one chunk, straddle a chunk boundary or cover more than two chunks; the vision graph runs
once per image; aborting mid-prefill frees the slot and the cached rows; the typed errors of bad image inputs."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
import torch

from optimum.neuron import NeuronModelForImageTextToText
from optimum.neuron.errors import InputError, WeightLoadingError
from optimum.neuron.runtime.images import ImageInput
from optimum.neuron.runtime.sampling import SamplingParams
from tests.contract.engine_tools import Recorder
from tests.fixtures.llm.idefics3 import (
    idefics3_export,
    image_spans,
    inputs,
    our_tokens,
    reference,
    tiny_idefics3,
    transformers_tokens,
)

PROMPTS = {
    "one image, text before and after": ("hello the <image> what is this", [0]),
    "two images": ("hello <image> and <image> what", [0, 1]),
}


@cache
def loaded(chunk: int, backend: str = "eager") -> NeuronModelForImageTextToText:
    return NeuronModelForImageTextToText.from_pretrained(idefics3_export(chunk, backend))


# chunk 64: every image span inside one chunk; 24: spans straddle one chunk boundary; 8: a span covers 4-5 chunks
@pytest.mark.parametrize("chunk", [64, 24, 8])
@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_greedy_parity_with_transformers(chunk: int, case: str) -> None:
    text, images = PROMPTS[case]
    batch = inputs([text], [images])
    spans = image_spans(batch["input_ids"][0].tolist())
    assert any(a // chunk != b // chunk for a, b in spans) == (chunk < 64), spans
    assert any(b // chunk - a // chunk >= 2 for a, b in spans) == (chunk == 8), spans
    assert our_tokens(loaded(chunk), batch) == transformers_tokens(batch)


def test_batch_of_two_requests_with_different_images() -> None:
    batch = inputs(["hello the <image> what is this", "a <image> b <image>"], [[0], [2, 1]])
    alone = [
        transformers_tokens(inputs([t], [i]))[0]
        for t, i in (("hello the <image> what is this", [0]), ("a <image> b <image>", [2, 1]))
    ]
    assert our_tokens(loaded(24), batch) == alone


def test_vision_graph_runs_once_per_image_and_rows_are_dropped_when_consumed() -> None:
    model = loaded(8)
    engine = model.engine
    batch = inputs(["hello <image> and <image> what"], [[0, 1]])
    images = model.images_of(batch["input_ids"], None, batch["pixel_values"], batch["pixel_attention_mask"])[0]
    graphs = dict(engine.graphs)
    recorder = Recorder(engine)
    try:
        engine.admit("r", batch["input_ids"][0].tolist(), SamplingParams(), images, reuse=False)
        encoded, cached = [], []
        while engine.sequence("r").pending > 1 or not engine.sequence("r").generated:
            result = engine.step({"r": min(8, engine.sequence("r").pending)})
            encoded += result.encoded
            cached.append(engine.cached_images)
        vision_calls = [name for name, _ in recorder.calls if name == "vision_encoder"]
        assert encoded == [("r", 0), ("r", 1)] and len(vision_calls) == 2  # each image's tiles fit one call
        assert max(cached) == 1 and cached[-1] == 0  # each image's rows live from its first chunk to its last
        for _ in range(3):
            assert not engine.step({"r": 1}).encoded  # decode never touches the vision graph
        assert len([name for name, _ in recorder.calls if name == "vision_encoder"]) == 2
    finally:
        engine.release("r")
        engine.graphs.update(graphs)


@pytest.mark.slow
def test_inductor_artifact_equals_transformers() -> None:
    """The AOTInductor-compiled vision encoder and image-splicing prefill graph (chunk 16: each image span covers three
    chunks), on a batch of two requests with different images."""
    model = loaded(16, "inductor")
    assert {p.suffix for p in (model.engine.artifact.root / "graphs").iterdir()} == {".pt2", ".json"}
    texts, images = ["hello <image> and <image> what", "a <image> b"], [[0, 1], [2]]
    alone = [transformers_tokens(inputs([t], [i]))[0] for t, i in zip(texts, images, strict=True)]
    assert our_tokens(model, inputs(texts, images)) == alone


def test_abort_mid_prefill_frees_slot_and_cached_rows() -> None:
    model = loaded(8)
    engine = model.engine
    batch = inputs(["hello <image> and <image> what"], [[0, 1]])
    images = model.images_of(batch["input_ids"], None, batch["pixel_values"], batch["pixel_attention_mask"])[0]
    prompt = batch["input_ids"][0].tolist()
    free = engine.slots.free_count
    engine.admit("abort", prompt, SamplingParams(), images, reuse=False)  # no block of an earlier test reused
    result = engine.step({"abort": images[0].positions[0] + 2})  # part of the first image's rows
    assert result.encoded == [("abort", 0)] and engine.cached_images == 1
    engine.release("abort")  # what vLLM's abort and generate()'s cleanup do
    assert engine.cached_images == 0 and engine.slots.free_count == free


def test_more_images_than_the_artifact_serves_is_refused() -> None:
    model = NeuronModelForImageTextToText.from_pretrained(idefics3_export(24, max_images=1))
    assert model.neuron_config.max_images == 1
    with pytest.raises(InputError, match=r"at most max_images=1 per prompt.*--max_images 2"):
        model.generate(**inputs(["hello <image> and <image> what"], [[0, 1]]), max_new_tokens=2)
    assert model.engine.slots.free_count == model.neuron_config.batch_size


def test_bad_image_inputs_are_typed_errors() -> None:
    model = loaded(24)
    engine = model.engine
    batch = inputs(["hello the <image> what is this"], [[0]])
    prompt = batch["input_ids"][0].tolist()
    image = model.images_of(batch["input_ids"], None, batch["pixel_values"], batch["pixel_attention_mask"])[0][0]
    with pytest.raises(InputError, match="image tokens that no image fills"):
        engine.admit("x", prompt, SamplingParams())
    with pytest.raises(InputError, match="placeholder positions"):
        engine.admit("x", prompt, SamplingParams(), [ImageInput(image.pixels, (*image.positions[1:], 0))])
    with pytest.raises(InputError, match=r"takes \[tiles, 3, 64, 64\]"):
        engine.admit("x", prompt, SamplingParams(), [ImageInput(image.pixels[:, :, :32], image.positions)])
    with pytest.raises(InputError, match="placeholders for 5 tiles but pixel_values holds 3"):
        model.generate(batch["input_ids"], pixel_values=inputs(["a <image>"], [[1]])["pixel_values"])
    assert engine.slots.free_count == engine.config.batch_size


def test_checkpoint_loading_is_strict() -> None:
    from optimum.neuron.artifact import empty_decoder
    from optimum.neuron.weights import map_state_dict, read_checkpoint

    hf_config = reference().config
    layout = empty_decoder(hf_config, loaded(24).neuron_config)
    state = read_checkpoint(tiny_idefics3())
    assert any(k.startswith("vision_model.") for k in map_state_dict(layout, dict(state), torch.float32))
    state.pop("model.vision_model.post_layernorm.weight")
    with pytest.raises(WeightLoadingError, match=r"vision_model\.post_layernorm\.weight"):
        map_state_dict(layout, state, torch.float32)


def test_optimum_cli_exports_an_image_text_model(tmp_path) -> None:
    """``optimum-cli export neuron --model <idefics3 folder>`` (eager) reads the tiles from the processor and writes an
    artifact that keeps the whole config and the processor files; a text-only model refuses the image flags."""
    from tests.fixtures.cli import run_cli
    from tests.fixtures.llm.models import tiny_model

    out = tmp_path / "vlm"
    flags = ["--batch_size", "1", "--sequence_length", "128", "--prefill_chunk_size", "24", "--backend", "eager"]
    done = run_cli("optimum-cli", "--model", str(tiny_idefics3()), *flags, str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    saved = json.loads((out / "neuron_config.json").read_text())
    assert (saved["image_tiles"], saved["image_size"], saved["max_images"]) == (5, 64, 6)
    assert saved["graphs"] == ["chunked_prefill", "token_generation", "token_generation_logits", "vision_encoder"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "idefics3"
    assert (out / "processor_config.json").is_file()
    batch = inputs(["hello the <image> what is this"], [[0]])
    assert our_tokens(NeuronModelForImageTextToText.from_pretrained(out), batch) == transformers_tokens(batch)
    refused = run_cli(
        "optimum-cli", "--model", str(tiny_model("llama")), *flags, "--max_images", "2", str(tmp_path / "t")
    )
    assert refused.returncode == 2 and "apply to image-text models only" in refused.stdout + refused.stderr


def test_a_failed_step_restores_the_cached_image_rows() -> None:
    """`Engine.step` is atomic for the image cache too: a step that consumed the first image's cached rows and encoded
    the second's, then failed in its last prefill chunk, leaves the cache as before (the first image's rows, the very
    tensor); retried, the request generates transformers' tokens."""
    model = loaded(8)
    engine = model.engine
    batch = inputs(["hello <image> and <image> what"], [[0, 1]])
    images = model.images_of(batch["input_ids"], None, batch["pixel_values"], batch["pixel_attention_mask"])[0]
    graphs = dict(engine.graphs)
    engine.admit("atomic", batch["input_ids"][0].tolist(), SamplingParams(), images, reuse=False)
    try:
        engine.step({"atomic": images[0].positions[0] + 2})  # part of the first image's rows
        sequence = engine.sequence("atomic")
        assert sequence.images is not None
        cached, computed, rest = dict(sequence.images.cache), sequence.computed, sequence.pending
        assert list(cached) == [0]
        last, calls = -(-rest // engine.chunk_size), []  # the step's last prefill call, the calls so far

        def failing(graph: Any) -> Any:
            def call(*args: Any) -> Any:
                out = graph(*args)
                calls.append(1)
                if len(calls) == last:
                    raise RuntimeError("injected")
                return out

            return call

        for name, spec in engine.specs.items():
            if spec.kind is engine.prefill_kind:
                engine.graphs[name] = failing(engine.graphs[name])
        with pytest.raises(RuntimeError, match="injected"):
            engine.step({"atomic": rest})
        assert sequence.computed == computed and sequence.pending == rest and not sequence.generated
        assert sequence.images.cache.keys() == cached.keys() and sequence.images.cache[0] is cached[0]
        engine.graphs.update(graphs)
        engine.step({"atomic": rest})
        while len(sequence.generated) < 8:
            engine.step({"atomic": 1})
        assert sequence.generated == transformers_tokens(batch)[0]
    finally:
        engine.release("atomic")
        engine.graphs.update(graphs)


def test_prefix_cache_shares_blocks_only_for_the_same_images() -> None:
    """A prompt sent again with the same image reuses its blocks (the image's rows included: its encoder call is
    skipped); the same tokens with another image share only the blocks before the image's first position."""
    model = NeuronModelForImageTextToText.from_pretrained(idefics3_export(8))  # its own engine: a clean prefix cache
    engine = model.engine
    text = "hello the <image> what is this and what is that"  # text after the image: a hit can cover all of it
    first = inputs([text], [[0]])
    other = {**first, "pixel_values": first["pixel_values"].flip(-1)}  # the same tiles and tokens, other pixels
    start, end = image_spans(first["input_ids"][0].tolist())[0]
    runs = []
    for batch in (first, first, other):
        prompt = batch["input_ids"][0].tolist()
        images = model.images_of(batch["input_ids"], None, batch["pixel_values"], batch["pixel_attention_mask"])[0]
        sequence = engine.admit("p", prompt, SamplingParams(), images)
        try:
            computed, result = sequence.computed, engine.step({"p": sequence.pending})
        finally:
            engine.release("p")
        runs.append((computed, result.encoded, result.tokens["p"]))
    (cold, encoded, token), (warm, again, same), (shared, changed, _) = runs
    block = engine.block_size
    assert cold == 0 and encoded == [("p", 0)]
    assert warm == (len(first["input_ids"][0]) - 1) // block * block > end, "the image's blocks were not reused"
    assert again == [] and same == token, "a hit covering the image still encoded it, or changed the token"
    assert shared == start // block * block and changed == [("p", 0)], "another image shared the image's blocks"
    assert token == transformers_tokens(first)[0][0]
