"""The export CLIs end to end: ``optimum-cli export neuron`` and ``python -m optimum.exporters.neuron``.

Round trips export a tiny llama (batch 2, S 32, C 8), load it and compare greedy tokens with
transformers; an identical second export is a cache hit that copies; bad flags exit with status 2
and a one-line message that says how to fix them, as do config fields a family does not implement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from optimum.exporters.neuron.__main__ import add_export_arguments
from optimum.exporters.neuron.export import export
from optimum.neuron import NeuronConfig, NeuronModelForCausalLM
from optimum.neuron.cache_dir import cache_root
from optimum.neuron.config import CHOICES, config_fields, field_docs, flag
from tests.fixtures.cli import assert_refused, check_round_trip, export_llama, run_cli
from tests.fixtures.llm.models import tiny_model
from tests.utils import HAS_TORCH_XLA


def test_optimum_cli_eager_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "eager"
    export_llama("optimum-cli", out, "--backend", "eager")
    check_round_trip(out, "eager")


@pytest.mark.slow
def test_python_m_inductor_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "inductor"
    export_llama("python -m", out, "--backend", "inductor")
    check_round_trip(out, "inductor")


def test_second_identical_export_is_a_cache_hit_that_copies(tmp_path: Path) -> None:
    export_llama("python -m", tmp_path / "first", "--backend", "eager")
    second = export_llama("optimum-cli", tmp_path / "second", "--backend", "eager")
    hit = re.search(r"export cache hit (\S+)", second.stderr)
    assert hit, second.stderr
    cached = Path(hit.group(1))
    assert cached.parent == cache_root() / "exports"
    files = [p for p in (tmp_path / "second").rglob("*") if p.is_file()]
    assert {p.relative_to(tmp_path / "second") for p in files} == {
        p.relative_to(cached) for p in cached.rglob("*") if p.is_file()
    }
    for path in files:
        twin = cached / path.relative_to(tmp_path / "second")
        assert not path.is_symlink() and path.stat().st_nlink == 1, path
        assert path.stat().st_ino != twin.stat().st_ino, path
        assert path.read_bytes() == twin.read_bytes(), path
    before = (cached / "model.safetensors").read_bytes()
    (tmp_path / "second" / "model.safetensors").write_bytes(b"edited copy")
    assert (cached / "model.safetensors").read_bytes() == before


def test_export_never_writes_through_an_old_hard_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me")
    out = tmp_path / "out"
    out.mkdir()
    os.link(outside, out / "model.safetensors")
    config = NeuronConfig(batch_size=2, sequence_length=32, prefill_chunk_size=8, backend="eager")
    export(tiny_model("llama"), out, config)
    assert outside.read_bytes() == b"keep me"
    assert NeuronModelForCausalLM.from_pretrained(out).neuron_config == config


def unknown_arch(tmp_path: Path, model_type: str) -> str:
    """A checkpoint folder whose config.json names ``model_type``."""
    folder = tmp_path / f"arch-{model_type}"
    folder.mkdir()
    body = {"model_type": model_type, "vocab_size": 64, "n_layer": 1, "n_embd": 32, "n_head": 2}
    (folder / "config.json").write_text(json.dumps(body))
    return str(folder)


BAD_INPUTS = [
    ("optimum-cli", ["--tensor_parallel_size", "3"], ["intermediate_size=128", "3 ranks", "--tensor_parallel_size"]),
    ("main()", ["--tensor_parallel_size", "2", "--backend", "xla"], ["eager and inductor", "size 1"]),
    ("main()", ["--prefill_chunk_size", "64"], ["prefill_chunk_size=64", "--prefill_chunk_size"]),
    ("optimum-cli", ["--prefill_chunk_size", "-8"], ["prefill_chunk_size=-8", "--prefill_chunk_size"]),
    ("main()", ["--backend", "neuron"], ["cannot run on device='cpu'", "--backend neuron needs --device neuron"]),
    ("optimum-cli", ["--backend", "neuron", "--device", "neuron"], ["torch_neuronx", "--backend inductor"]),
    ("main()", ["--device", "cuda"], ["no CUDA device", "--device cpu"]),
    ("main()", ["--backend", "xla", "--device", "neuron"], ["torch-neuronx", "no Neuron device", "not verified"]),
    ("optimum-cli", ["--backend", "xla", "--device", "cuda"], ["--device cpu", "--backend inductor --device cuda"]),
    ("main()", ["--backend", "xla"], ["torch-xla is not installed", "make install-xla"]),
    (
        "main()",
        ["--backend", "xla", "--kv_cache_dtype", "int8"],
        ["kv_cache_dtype='int8'", "--kv_cache_dtype auto"],
    ),
    ("optimum-cli", ["--kv_buckets", "16,8"], ["kv_buckets='16,8'", "strictly increasing", "--kv_buckets auto"]),
    ("main()", ["--kv_block_size", "5"], ["kv_block_size=5", "--kv_block_size with a divisor"]),
    ("optimum-cli", ["--kv_cache_tokens", "8"], ["kv_cache_tokens=8", "at least sequence_length=32"]),
]


@pytest.mark.parametrize(("entry", "flags", "fragments"), BAD_INPUTS, ids=[" ".join(b[1]) for b in BAD_INPUTS])
def test_bad_flags_exit_2_with_fix(tmp_path: Path, entry: str, flags: list[str], fragments: list[str]) -> None:
    if "cuda" in flags and "xla" not in flags and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if flags == ["--backend", "xla"] and HAS_TORCH_XLA:
        pytest.skip("torch-xla is installed here: --backend xla works (tests/xla)")
    out = tmp_path / "out"
    done = run_cli(entry, "--model", str(tiny_model("llama")), "--sequence_length", "32", *flags, str(out))
    assert_refused(done, fragments)
    assert not out.exists()


@pytest.mark.parametrize(
    ("entry", "model_type", "fragments"),
    [
        ("main()", None, ["not a transformers checkpoint folder", "--model"]),
        ("optimum-cli", "my_unknown_arch", ["my_unknown_arch", "supported model types", "llama", "qwen2"]),
        ("main()", "gpt2", ["'gpt2' is not supported", "llama", "qwen3"]),
    ],
)
def test_bad_model_exits_2_with_fix(tmp_path: Path, entry: str, model_type: str | None, fragments: list[str]) -> None:
    folder = unknown_arch(tmp_path, model_type) if model_type else str(tmp_path / "nowhere")
    done = run_cli(entry, "--model", folder, "--sequence_length", "32", str(tmp_path / "out"))
    assert_refused(done, fragments)


UNIMPLEMENTED = [
    ("llama", {"rope_parameters": {"rope_type": "fancy", "rope_theta": 10000.0}}, "32", "rope_parameters.rope_type"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "32", "attn_logit_softcapping"),
    ("phi3", {}, "128", "rope_parameters.rope_type 'longrope'"),  # beyond its original_max_position_embeddings (64)
]


@pytest.mark.parametrize(("family", "changes", "length", "field"), UNIMPLEMENTED, ids=[u[3] for u in UNIMPLEMENTED])
def test_unimplemented_config_field_exits_2_naming_it(
    tmp_path: Path, family: str, changes: dict, length: str, field: str
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model(family), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    out = tmp_path / "out"
    done = run_cli("main()", "--model", str(folder), "--sequence_length", length, "--backend", "eager", str(out))
    assert_refused(done, [f"config field {field}"])
    assert not out.exists()


def test_missing_model_flag_is_a_usage_error(tmp_path: Path) -> None:
    done = run_cli("python -m", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "--model" in done.stderr


def test_flags_are_made_from_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = parser.parse_args(["--model", "m", "out"])
    assert NeuronConfig(**{f.name: getattr(args, f.name) for f in config_fields()}) == NeuronConfig()
    actions = {a.dest: a for a in parser._actions}
    docs = field_docs()
    for spec in config_fields():
        action = actions[spec.name]
        assert docs[spec.name][:40] in " ".join((action.help or "").split()), spec.name
        assert tuple(action.choices or ()) == CHOICES.get(spec.name, ()), spec.name
        switch = f"--no_{spec.name}" if spec.default is True else flag(spec.name)
        assert action.option_strings == [switch], spec.name
    assert actions["tp_degree"].option_strings == ["--tensor_parallel_size"]
    off = parser.parse_args(["--model", "m", "--no_on_device_sampling", "--auto_cast_type", "bf16", "out"])
    assert (off.on_device_sampling, off.auto_cast_type) == (False, "bf16")


def test_every_config_field_has_a_docstring() -> None:
    assert set(field_docs()) == {f.name for f in dataclasses.fields(NeuronConfig)}
    assert all(len(doc) > 20 for doc in field_docs().values())


def test_help_shows_the_neuron_backend_as_unavailable() -> None:
    """``optimum-cli export neuron --help`` offers ``neuron`` among the backends but says it is not available."""
    done = run_cli("optimum-cli", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    backend = text[text.rindex("--backend {") : text.rindex("--device {")]  # its help, not the usage line
    assert "neuron" in backend and "NOT AVAILABLE in this release" in backend, backend
