"""Broken artifacts fail at load with `ArtifactError` and a fix; oversized requests with typed errors.

Every test corrupts its own copy of a fixture artifact in ``tmp_path``; the shared cache is never
touched. Corrupt AOTInductor packages are loaded in a fresh interpreter (`subprocess_test`), so a
crash of the native loader fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimum.neuron import NeuronModelForCausalLM
from optimum.neuron.errors import InputError, SlotError
from tests.contract.engine_tools import GREEDY
from tests.fixtures.artifacts import artifact_copy, edit_json, expect_artifact_error, load, rehash_manifest
from tests.fixtures.llm.models import export_fixture
from tests.utils import subprocess_test

EAGER = "llama-2x4x8-eager"
INDUCTOR = "llama-2x4x8-inductor"
CP_GRAPH, TG_GRAPH = "graphs/chunked_prefill", "graphs/token_generation"


def test_intact_copy_loads(tmp_path: Path) -> None:
    model = load(artifact_copy(EAGER, tmp_path))
    assert model.neuron_config.prefill_chunk_size == 8


def test_not_an_artifact(tmp_path: Path) -> None:
    expect_artifact_error(tmp_path, "neuron_config.json is missing")


@pytest.mark.parametrize(
    "name", ["neuron_config.json", "config.json", "model.safetensors", "graphs/manifest.json", f"{CP_GRAPH}.json"]
)
def test_missing_file(tmp_path: Path, name: str) -> None:
    root = artifact_copy(EAGER, tmp_path)
    (root / name).unlink()
    expect_artifact_error(root, name.rsplit("/", 1)[-1])


@pytest.mark.parametrize("graph", [CP_GRAPH, TG_GRAPH])
@pytest.mark.parametrize("damage", ["garbage", "truncate", "append"])
def test_corrupt_eager_graph_file(tmp_path: Path, graph: str, damage: str) -> None:
    root = artifact_copy(EAGER, tmp_path)
    path = root / f"{graph}.json"
    data = path.read_bytes()
    path.write_bytes({"garbage": b"\x00\xff" * 50, "truncate": data[: len(data) // 2], "append": data + b" "}[damage])
    expect_artifact_error(root, "does not match its recorded hash")


def test_eager_graph_of_another_backend(tmp_path: Path) -> None:
    root = artifact_copy(EAGER, tmp_path)
    (root / f"{TG_GRAPH}.json").write_text(json.dumps({"backend": "inductor"}))
    rehash_manifest(root)
    expect_artifact_error(root, "not an eager graph")


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty"])
def test_unreadable_weights(tmp_path: Path, damage: str) -> None:
    root = artifact_copy(EAGER, tmp_path)
    path = root / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"garbage": b"\x13" * 4096, "truncate": data[: len(data) - 100], "empty": b""}[damage])
    expect_artifact_error(root, "cannot read weights")


@pytest.mark.parametrize("tamper", ["reshape", "rename", "drop", "dtype", "extra"])
def test_weights_that_do_not_fit_the_graphs(tmp_path: Path, tamper: str) -> None:
    root = artifact_copy(EAGER, tmp_path)
    path = root / "model.safetensors"
    weights = load_file(str(path))
    name = "model.layers.0.mlp.down_proj.weight"
    if tamper == "reshape":
        weights[name] = weights[name][:, :-1].contiguous()
    elif tamper == "rename":
        weights["model.layers.0.mlp.down.weight"] = weights.pop(name)
    elif tamper == "drop":
        del weights[name]
    elif tamper == "dtype":
        weights[name] = weights[name].to(torch.bfloat16)
    else:
        weights["model.extra"] = torch.zeros(3)
    save_file(weights, str(path))
    expect_artifact_error(root, "does not match the weights the graphs were compiled with")


def test_config_from_another_version(tmp_path: Path) -> None:
    root = artifact_copy(EAGER, tmp_path)
    edit_json(root / "neuron_config.json", lambda c: c["versions"].update({"optimum-neuronx": "0.0.1"}))
    expect_artifact_error(root, "exported with", "0.0.1")


def test_config_from_another_torch(tmp_path: Path) -> None:
    root = artifact_copy(EAGER, tmp_path)
    edit_json(root / "neuron_config.json", lambda c: c["versions"].update({"torch": "2.0.0"}))
    expect_artifact_error(root, "exported with", "2.0.0")


@pytest.mark.parametrize(("field", "value"), [("batch_size", 4), ("prefill_chunk_size", 16), ("hash", "0" * 16)])
def test_config_edited_after_export(tmp_path: Path, field: str, value: object) -> None:
    root = artifact_copy(EAGER, tmp_path)
    edit_json(root / "neuron_config.json", lambda c: c.update({field: value}))
    expect_artifact_error(root, "hash mismatch")


@pytest.mark.parametrize("text", ["{broken", "[]", "{}", '{"graphs": []}', '{"graphs": {"x": 1}}'])
def test_malformed_manifest(tmp_path: Path, text: str) -> None:
    root = artifact_copy(EAGER, tmp_path)
    (root / "graphs/manifest.json").write_text(text)
    expect_artifact_error(root, "manifest")


def test_an_artifact_without_window_spans_keeps_to_its_buckets(tmp_path: Path) -> None:
    """A manifest without ``window_span`` (an artifact exported before spans were recorded): the engine calls every
    graph in its buckets, and generates the tokens of the same artifact reading exact windows."""
    root = artifact_copy(EAGER, tmp_path)
    edit_json(root / "graphs/manifest.json", lambda m: [e.pop("window_span", None) for e in m["graphs"].values()])
    older, current = (NeuronModelForCausalLM.from_pretrained(p) for p in (root, export_fixture(EAGER)))
    assert set(older.engine.window_spans.values()) == {None}
    assert any(span is not None for span in current.engine.window_spans.values())
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])
    tokens = [m.generate(prompt, max_new_tokens=12, eos_token_id=[]) for m in (older, current)]
    assert torch.equal(tokens[0], tokens[1])


def test_manifest_entry_without_hash(tmp_path: Path) -> None:
    root = artifact_copy(EAGER, tmp_path)
    edit_json(root / "graphs/manifest.json", lambda m: m["graphs"]["token_generation"].pop("sha256"))
    expect_artifact_error(root, "manifest")


def rewrite_member(path: Path, suffix: str, data: bytes) -> None:
    """Rewrite the zip at ``path`` with the member ending in ``suffix`` replaced (valid CRCs)."""
    with zipfile.ZipFile(path) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, content in members:
            archive.writestr(info, data if info.filename.endswith(suffix) else content)


def damage_package(root: Path, damage: str) -> None:
    """Damage the token-generation package of the inductor artifact at ``root``."""
    tg, cp = root / f"{TG_GRAPH}.pt2", root / f"{CP_GRAPH}.pt2"
    data = tg.read_bytes()
    if damage == "swap":
        tg.write_bytes(cp.read_bytes())
        cp.write_bytes(data)
    elif damage == "flip":
        middle = len(data) // 2
        tg.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :])
    elif damage == "bad_so":
        rewrite_member(tg, ".so", b"\x7fELF not really" * 64)
    else:
        tg.write_bytes({"garbage": b"PK\x03\x04" + b"\x00" * 4096, "truncate": data[: len(data) // 3]}[damage])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "rehash", "fragment"),
    [
        ("truncate", False, "does not match its recorded hash"),
        ("garbage", False, "does not match its recorded hash"),
        ("truncate", True, "not a valid package"),
        ("garbage", True, "not a valid package"),
        ("flip", True, "is corrupt"),
        ("swap", True, "files swapped or renamed"),
    ],
)
def test_corrupt_inductor_package(tmp_path: Path, damage: str, rehash: bool, fragment: str) -> None:
    """Damage the checks refuse before AOTInductor opens the package (hash, archive, member names): in this process."""
    root = artifact_copy(INDUCTOR, tmp_path)
    damage_package(root, damage)
    if rehash:
        rehash_manifest(root)
    expect_artifact_error(root, fragment)


@pytest.mark.slow
@subprocess_test
def test_inductor_package_with_a_broken_library(tmp_path: Path) -> None:
    """A package whose shared library is not one: refused by AOTInductor's loader, in a fresh process."""
    root = artifact_copy(INDUCTOR, tmp_path)
    damage_package(root, "bad_so")
    rehash_manifest(root)
    expect_artifact_error(root, "cannot load compiled graph")


@pytest.mark.slow
@subprocess_test
def test_inductor_weights_do_not_fit(tmp_path: Path) -> None:
    root = artifact_copy(INDUCTOR, tmp_path)
    path = root / "model.safetensors"
    weights = load_file(str(path))
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, str(path))
    expect_artifact_error(root, "does not match the weights")


@pytest.fixture(scope="module")
def eager_model() -> NeuronModelForCausalLM:
    """The eager fixture (batch 2, S 32, C 8), loaded once for the request checks."""
    return NeuronModelForCausalLM.from_pretrained(export_fixture(EAGER))


def test_prompt_longer_than_compiled_length(eager_model: NeuronModelForCausalLM) -> None:
    with pytest.raises(InputError, match="--sequence_length") as info:
        eager_model.generate(torch.randint(3, 256, (1, 33)), max_new_tokens=2)
    assert "33 tokens" in str(info.value)
    assert eager_model.engine.slots.free_count == 2


def test_batch_larger_than_compiled_batch(eager_model: NeuronModelForCausalLM) -> None:
    with pytest.raises(InputError, match="--batch_size") as info:
        eager_model.generate(torch.randint(3, 256, (3, 4)), max_new_tokens=2)
    assert "3 prompts" in str(info.value)
    assert eager_model.engine.slots.free_count == 2


def test_empty_prompt_row(eager_model: NeuronModelForCausalLM) -> None:
    ids = torch.randint(3, 256, (2, 4))
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(InputError, match="0 tokens"):
        eager_model.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_full_length_prompt_gets_one_token_then_stops(eager_model: NeuronModelForCausalLM) -> None:
    ids = torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    out = eager_model.generate(ids, max_new_tokens=5, eos_token_id=[])
    assert out.shape == (1, 33)
    assert eager_model.engine.slots.free_count == 2


def test_models_still_usable_after_errors(eager_model: NeuronModelForCausalLM) -> None:
    for bad in (torch.randint(3, 256, (3, 4)), torch.randint(3, 256, (1, 40))):
        with pytest.raises(InputError):
            eager_model.generate(bad, max_new_tokens=2)
    out = eager_model.generate(torch.randint(3, 256, (2, 5)), max_new_tokens=3, eos_token_id=[])
    assert out.shape == (2, 8)


def test_partial_prefill_on_a_context_encoding_artifact() -> None:
    engine = NeuronModelForCausalLM.from_pretrained(export_fixture("llama-2x1x32-ce-eager")).engine
    engine.admit("a", [5, 6, 7, 8], GREEDY)
    with pytest.raises(InputError, match="--prefill_chunk_size"):
        engine.step({"a": 3})
    assert engine.step({"a": 4}).tokens.keys() == {"a"}, "the whole prompt still prefills after the refusal"


def test_bad_engine_calls_are_refused_and_leak_nothing(eager_model: NeuronModelForCausalLM) -> None:
    engine = eager_model.engine
    with pytest.raises(InputError, match="vocabulary"):
        engine.admit("a", [5, 300], GREEDY)
    with pytest.raises(InputError, match="--sequence_length"):
        engine.admit("a", list(range(3, 36)), GREEDY)
    with pytest.raises(InputError, match="no sequence 'x'"):
        engine.step({"x": 1})
    engine.admit("a", [5, 6, 7], GREEDY)
    try:
        with pytest.raises(InputError, match="already admitted"):
            engine.admit("a", [5], GREEDY)
        with pytest.raises(InputError, match="3 pending tokens; 4 were scheduled"):
            engine.step({"a": 4})
        engine.admit("b", [5], GREEDY)
        with pytest.raises(SlotError, match="--batch_size"):
            engine.admit("c", [5], GREEDY)
        engine.preempt("b")
        with pytest.raises(InputError, match="resume"):
            engine.step({"b": 1})
        assert engine.step({"a": 3}).tokens.keys() == {"a"}, "the engine still works after the refusals"
    finally:
        engine.release("a")
        engine.release("b")
    assert engine.slots.free_count == 2


def test_full_sequence_is_refused(eager_model: NeuronModelForCausalLM) -> None:
    engine = eager_model.engine
    sequence = engine.admit("a", list(range(3, 35)), GREEDY)  # 32 tokens: the slot is full after prefill
    try:
        engine.step({"a": 32})
        assert sequence.full
        with pytest.raises(InputError, match="full"):
            engine.step({"a": 1})
    finally:
        engine.release("a")
