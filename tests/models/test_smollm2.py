"""The real model: SmolLM2-135M-Instruct (fp32), converted from the bundled GGUF (DESIGN.md §6).

Chunked prefill on every backend is part of the backend contract (`tests/contract`). Here: context
encoding (S = 1024, inductor, in the chunked artifacts' batch and length, so that it shares their token-generation
graph) gives transformers' greedy tokens for a ChatML prompt longer than a chunk;
the last-token prefill logits of both prefill modes are within `LOGIT_TOLERANCE` of transformers' for a
long and a short prompt, and of each other; the conversion is strict and reproducible; and the model
answers "What is the capital of France?" with Paris.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from optimum.neuron.errors import WeightLoadingError
from optimum.neuron.smollm2 import MARKER_FILE, SmolLM2UnavailableError, convert_smollm2, rebuild_llama
from tests.contract.engine_tools import loaded, prefill_logits
from tests.fixtures.llm.smollm2 import (
    CHUNKED,
    CONTEXT_ENCODING,
    LOGIT_TOLERANCE,
    NEW_TOKENS,
    XDIST_GROUP,
    chat_ids,
    hf_greedy,
    long_chat_ids,
    reference,
    smollm2_artifact,
    smollm2_dir,
    tokenizer,
)

pytestmark = pytest.mark.xdist_group(XDIST_GROUP)


def neuron_model(name: str) -> Any:
    return loaded(smollm2_artifact(name))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_context_encoding_long_chat_matches_transformers() -> None:
    ids = long_chat_ids()
    ours = neuron_model(CONTEXT_ENCODING).generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    ours = ours[0, ids.shape[1] :].tolist()
    expected = hf_greedy(ids)
    assert len(ours) == NEW_TOKENS
    assert ours == expected, f"ours: {tokenizer().decode(ours)!r}\nhf:   {tokenizer().decode(expected)!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [CHUNKED.format(backend="inductor"), CONTEXT_ENCODING])
def test_prefill_logits_match_transformers(name: str) -> None:
    engine = neuron_model(name).engine
    for ids in (long_chat_ids(), chat_ids("What is the capital of France?")):  # several chunks; part of one
        with torch.no_grad():
            expected = reference()(ids).logits[0, -1]
        got = prefill_logits(engine, ids[0].tolist())
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"{name}: prompt of {ids.shape[1]} tokens, max |logit diff| {diff:.2e}"


@pytest.mark.slow
def test_chunked_prefill_equals_context_encoding() -> None:
    ids = long_chat_ids()[0].tolist()
    chunked = neuron_model(CHUNKED.format(backend="inductor"))
    ce = neuron_model(CONTEXT_ENCODING)
    diff = (prefill_logits(chunked.engine, ids) - prefill_logits(ce.engine, ids)).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"chunked vs context encoding: max |logit diff| {diff:.2e}"
    prompt = torch.tensor([ids])
    assert torch.equal(
        chunked.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[]),
        ce.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[]),
    )


@pytest.mark.slow
def test_capital_of_france() -> None:
    ids = chat_ids("What is the capital of France?")
    out = neuron_model(CHUNKED.format(backend="inductor")).generate(ids, max_new_tokens=NEW_TOKENS)  # stops at EOS
    answer = tokenizer().decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert out[0, -1].item() == tokenizer().eos_token_id, "the answer did not end its turn"


@pytest.mark.slow
def test_converted_checkpoint_is_complete_and_strict() -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder = smollm2_dir()
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        dtypes = {handle.get_slice(k).get_dtype() for k in handle.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert dtypes == {"F32"}
    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    _, info = loaded
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert "<|im_start|>" in tokenizer().chat_template
    assert tokenizer().eos_token == "<|im_end|>"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer().eos_token_id == 2


@pytest.mark.slow
def test_conversion_is_reproducible(tmp_path: Path) -> None:
    again = convert_smollm2(tmp_path / "again", dtype="float32", force=True)  # from the GGUF, not the cache's copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"], "a staging folder was left behind"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json", MARKER_FILE):
        assert sha256(again / name) == sha256(smollm2_dir() / name), name


def test_rebuild_is_strict() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    state = LlamaForCausalLM(config).state_dict()
    assert torch.equal(rebuild_llama(config, state, torch.bfloat16).lm_head.weight, state["lm_head.weight"].bfloat16())
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(WeightLoadingError, match=r"model\.norm\.weight"):
        rebuild_llama(config, missing, torch.float32)
    reshaped = {**state, "model.norm.weight": torch.ones(17)}
    with pytest.raises(WeightLoadingError, match="size mismatch"):
        rebuild_llama(config, reshaped, torch.float32)


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimum.neuron import smollm2

    def interrupted(target: Path, *args: object) -> None:
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(smollm2, "_convert_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_smollm2(tmp_path / "out", force=True)
    assert list(tmp_path.iterdir()) == []


def _fake_conversion(folder: Path) -> Path:
    """A folder that `is_converted` accepts as a finished fp32 conversion (placeholder files)."""
    from optimum.neuron import smollm2

    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        (folder / name).write_text(f"{{{name!r}: 1}}")
    (folder / MARKER_FILE).write_text(json.dumps(smollm2._marker("fp32")))
    return folder


def test_cached_conversion_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimum.neuron import smollm2

    done = _fake_conversion(tmp_path / "done")
    monkeypatch.setattr(smollm2, "default_smollm2_dir", lambda dtype: done)  # the cache's folder: converted from GGUF
    monkeypatch.setattr(smollm2, "_convert_into", lambda *args: pytest.fail("a finished conversion was redone"))
    assert convert_smollm2(done, dtype="float32") == done
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="not a SmolLM2 conversion"):
        convert_smollm2(foreign)
    (done / "model.safetensors").unlink()  # a damaged conversion is redone
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(smollm2, "_convert_into", _raise_redone)
    with pytest.raises(RuntimeError, match="redone"):
        convert_smollm2(done)


def _raise_redone(*args: object) -> None:
    raise RuntimeError("redone")


def test_other_folders_copy_the_cache_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimum.neuron import smollm2

    cache = _fake_conversion(tmp_path / "cache")
    monkeypatch.setattr(smollm2, "default_smollm2_dir", lambda dtype: cache)
    monkeypatch.setattr(smollm2, "_convert_into", lambda *args: pytest.fail("the GGUF was read again"))
    mine = convert_smollm2(tmp_path / "mine", dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mine"], "a staging folder was left behind"
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == {p.name: p.read_bytes() for p in cache.iterdir()}
    (mine / "config.json").write_text("edited")  # a copy, not a link: the cache's file is untouched
    assert (cache / "config.json").read_text() == "{'config.json': 1}"
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(smollm2, "_convert_into", _raise_redone)
    with pytest.raises(RuntimeError, match="redone"):  # force reads the GGUF, whatever the cache holds
        convert_smollm2(tmp_path / "forced", force=True)
    empty = tmp_path / "empty-cache" / "smollm2"
    monkeypatch.setattr(smollm2, "default_smollm2_dir", lambda dtype: empty)
    with pytest.raises(RuntimeError, match="redone"):  # no cache conversion yet: it is made first, from the GGUF
        convert_smollm2(tmp_path / "next")
    assert not (tmp_path / "next").exists()


def test_missing_package_says_make_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimum.neuron import smollm2

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    monkeypatch.setattr(smollm2, "default_smollm2_dir", lambda dtype: tmp_path / "cache")  # no conversion to copy
    with pytest.raises(SmolLM2UnavailableError, match="make install"):
        convert_smollm2(tmp_path / "out")
    with pytest.raises(SmolLM2UnavailableError, match="make install"):  # force reads the GGUF, cache or not
        convert_smollm2(tmp_path / "cache", force=True)
    assert list(tmp_path.iterdir()) == []
