"""The image-text graphs on the xla backend (tiny random Idefics3, fp32, XLA:CPU): the vision encoder and the
image-splicing prefill graphs (chunked: one per KV window; context encoding) traced to HLO, greedy tokens equal to
transformers' for one image whose span straddles a chunk boundary, two images and three images (chunks in both KV
windows), the vision graph run once per image, and each graph compiled once per process with no CPU fallback and
its KV cache donated."""

from __future__ import annotations

import pytest

from optimum.neuron import NeuronModelForImageTextToText
from tests.contract.engine_tools import Recorder
from tests.fixtures.llm.idefics3 import idefics3_export, image_spans, inputs, our_tokens, transformers_tokens
from tests.utils import subprocess_test

pytestmark = pytest.mark.xla
CHUNK = 24
"""Every image span of these prompts straddles a chunk boundary; windows 64 and 128 (`idefics3_export`)."""
PROMPTS = (
    ("hello the <image> what is this", [0]),
    ("hello <image> and <image> what", [0, 1]),
    ("a <image> b <image> c <image> d", [2, 1, 0]),  # 93 tokens: its last chunks run in the full window
)
GRAPHS = {
    CHUNK: {"chunked_prefill", "chunked_prefill_w64"},
    0: {"context_encoding"},  # the whole prompt in one call (reads no earlier cache: one graph)
}


@pytest.mark.slow
@subprocess_test
@pytest.mark.parametrize("chunk", [CHUNK, 0], ids=["chunked", "ce"])
def test_xla_image_text_equals_transformers_one_compile_per_graph(chunk: int) -> None:
    from optimum.neuron.backends import xla_compat

    model = NeuronModelForImageTextToText.from_pretrained(idefics3_export(chunk, "xla"))
    assert xla_compat.compile_count() == 0, "export or load compiled a graph"
    engine = model.engine
    assert set(engine.graphs) == GRAPHS[chunk] | {"token_generation", "token_generation_w64", "vision_encoder"}
    recorder = Recorder(engine)
    for text, images in PROMPTS:
        batch = inputs([text], [images])
        spans = image_spans(batch["input_ids"][0].tolist())
        assert len(spans) == len(images) and (not chunk or all(a // chunk != b // chunk for a, b in spans)), spans
        before = len(recorder.calls)
        assert our_tokens(model, batch) == transformers_tokens(batch), text
        vision = [name for name, _ in recorder.calls[before:] if name == "vision_encoder"]
        assert len(vision) == len(images), f"{text}: {len(vision)} vision calls for {len(images)} images"
    called = {name for name, _ in recorder.calls}
    assert called == set(engine.graphs), f"graphs never run: {set(engine.graphs) - called}"
    assert xla_compat.compile_count() == len(called), f"{xla_compat.compile_count()} compiles for {len(called)} graphs"
    assert xla_compat.fallback_ops() == {}, "ops fell back to the CPU"
    cached = len(called) - 1  # every graph but the vision encoder takes the KV cache and donates it
    assert xla_compat.alias_count() == cached * len(engine.kv_cache), "a KV cache tensor was copied, not donated"
    texts, images = ["hello the <image> what is this", "a <image> b <image>"], [[0], [2, 1]]
    alone = [transformers_tokens(inputs([t], [i]))[0] for t, i in zip(texts, images, strict=True)]
    assert our_tokens(model, inputs(texts, images)) == alone  # two requests at once: other slots, same graphs
    assert xla_compat.compile_count() == len(called), "a second round recompiled"
