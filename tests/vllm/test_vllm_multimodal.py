"""vLLM serving an image-text artifact (tiny Idefics3, eager, chunk 8: every image span covers more than two chunks):
`LLM.generate` with ``multi_modal_data`` and ``vllm serve`` chat with a base64 ``image_url`` give transformers'
greedy tokens through vLLM's own multimodal processor and scheduler; more images than the artifact serves, and
tiles of another size than the artifact's (a request's ``mm_processor_kwargs``), are refused before the request is
scheduled, naming the fix, and the engine serves on; prompts share cached blocks only with the same images."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.llm.idefics3 import idefics3_export, sample_images, tiny_idefics3
from tests.utils import settled, subprocess_test
from tests.vllm.server import vllm_serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NEW_TOKENS = 8
REQUESTS = [("hello <image> and <image> what", [0, 1]), ("a <image> b <image>", [2, 0]), ("hello the <image>", [1])]


def transformers_tokens(text: str, images: list[int]) -> list[int]:
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_idefics3())
    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3(), dtype=torch.float32).eval()
    pictures = sample_images()
    batch = processor(text=text, images=[pictures[i] for i in images], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, batch["input_ids"].shape[1] :].tolist()


@subprocess_test
def test_llm_generate_with_images_equals_transformers() -> None:
    """Three requests with five images on two KV slots, chunk 8 and an image of 20 rows over a 31-token span: vLLM's
    encoder budget (one image) and chunking must neither deadlock nor starve any of them."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    pictures = sample_images()
    llm = LLM(model=str(idefics3_export(8)), seed=0, disable_log_stats=False)  # metrics: the prefix-cache hits
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts: list[Any] = [
        {"prompt": t, "multi_modal_data": {"image": [pictures[i] for i in ims]}} for t, ims in REQUESTS
    ]
    outputs = llm.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [transformers_tokens(t, i) for t, i in REQUESTS]
    assert settled(lambda: llm.collective_rpc("slot_usage"), [{}]) == [{}]
    too_many = {"prompt": "<image> " * 7, "multi_modal_data": {"image": [pictures[0]] * 7}}
    with pytest.raises(VLLMValidationError, match="At most 6 image"):
        llm.generate([too_many], params)
    small = {"max_image_size": {"longest_edge": 32}}  # the processor then makes 32-pixel tiles; the graph takes 64
    tiles = {"prompt": "hello <image>", "multi_modal_data": {"image": [pictures[1]]}, "mm_processor_kwargs": small}
    with pytest.raises(VLLMValidationError, match=r"this artifact takes \[tiles, 3, 64, 64\]"):  # before scheduling
        llm.generate([tiles], params)
    again = llm.generate([prompts[2]], params)[0].outputs[0].token_ids
    assert list(again) == transformers_tokens(*REQUESTS[2]), "the engine serves on after the refusal"
    assert settled(lambda: llm.collective_rpc("slot_usage"), [{}]) == [{}]
    check_prefix_cache(llm, params)


def check_prefix_cache(llm: Any, params: Any) -> None:
    """vLLM keys an image-text prompt's blocks by its images too: a prompt and image sent again is served from the
    cached blocks, its image's encoder call skipped (the hit covers every image position); the same tokens with
    another image of the same size share only the blocks before the image."""
    from PIL import ImageOps

    picture = sample_images()[2]  # an image no earlier request of the test sent with this text
    text = "hello the <image> what is this and what is that"  # text after the image: a hit can cover all of it
    runs = []
    for image in (picture, picture, ImageOps.mirror(picture)):  # the mirror: the same tiles, other pixels
        hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
        steps = len(llm.collective_rpc("step_records")[0])
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": [image]}}], params, use_tqdm=False)[0]
        records = llm.collective_rpc("step_records")[0][steps:]
        hit = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits") - hits
        encoded = [e for r in records for e in r["encoded"]]
        runs.append((hit, len(encoded), list(out.outputs[0].token_ids), len(out.prompt_token_ids)))
    (cold, cold_calls, tokens, length), (warm, warm_calls, again, _), (other, other_calls, _, _) = runs
    assert cold == 0 and cold_calls == 1
    assert warm == (length - 1) // 4 * 4 and warm_calls == 0, "the same image: its blocks and rows were not reused"
    assert again == tokens == transformers_tokens(text, [2])
    assert other < warm and other_calls == 1, "another image shared the first image's blocks"


def _data_url(index: int) -> str:
    buffer = io.BytesIO()
    sample_images()[index].save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@subprocess_test
def test_serve_chat_with_base64_images_equals_transformers(tmp_path: Path) -> None:
    from transformers import AutoProcessor

    artifact = idefics3_export(8, max_images=2)
    content = [
        {"type": "text", "text": "hello the"},
        {"type": "image_url", "image_url": {"url": _data_url(0)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": _data_url(1)}},
        {"type": "text", "text": "what is this"},
    ]
    messages = [{"role": "user", "content": content}]
    processor = AutoProcessor.from_pretrained(tiny_idefics3())
    template = [{"role": "user", "content": [c if c["type"] == "text" else {"type": "image"} for c in content]}]
    text = processor.apply_chat_template(template, add_generation_prompt=True)
    want = transformers_tokens(text, [0, 1])
    greedy = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": False}
    with vllm_serve(artifact, tmp_path / "serve.log") as server:
        name = server.get("/v1/models")["data"][0]["id"]
        body = {"model": name, "messages": messages, **greedy, "return_token_ids": True}
        choice = server.post("/v1/chat/completions", body)["choices"][0]
        assert choice["token_ids"] == want
        third = {"type": "image_url", "image_url": {"url": _data_url(2)}}
        refused = [{"role": "user", "content": [*content, third]}]
        status, answer = server.post_error("/v1/chat/completions", {"model": name, "messages": refused, **greedy})
        assert status == 400 and "At most 2 image" in answer, answer
