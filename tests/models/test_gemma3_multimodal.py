"""A multimodal Gemma 3 checkpoint (``Gemma3ForConditionalGeneration``) exports as its text decoder: the
artifact is a ``Gemma3ForCausalLM`` without the vision tower, and generates what transformers' multimodal
model generates from text alone (eager backend: no compile)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from optimum.exporters.neuron.export import export
from optimum.neuron import NeuronConfig, NeuronModelForCausalLM
from tests.fixtures.llm.models import tiny_gemma3_multimodal

NEW_TOKENS = 6


def test_multimodal_checkpoint_serves_its_text_decoder(tmp_path: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    folder = tiny_gemma3_multimodal()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gemma3"
    config = NeuronConfig(batch_size=1, sequence_length=32, prefill_chunk_size=8, backend="eager")
    out = export(folder, tmp_path / "artifact", config, use_cache=False)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert not [k for k in load_file(str(out / "model.safetensors")) if "vision" in k or "multi_modal" in k]
    model = NeuronModelForCausalLM.from_pretrained(out)
    reference = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    for length in (5, 19):  # the second crosses the sliding window (12) while prefilling and generating
        ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(length))
        ours = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, length:].tolist()
        theirs = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, length:].tolist()
        assert ours == theirs, f"prompt length {length}"
