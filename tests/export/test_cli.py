"""The export CLIs end to end: ``optimum-cli export neuron`` and ``python -m optimum.exporters.neuron``.

Round trips export a tiny llama (batch 2, S 32, C 8), load it and compare greedy tokens with
transformers; an identical second export is a cache hit that copies; bad flags exit with status 2
and a one-line message that says how to fix them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimum.exporters.neuron.cache import cache_root
from optimum.exporters.neuron.export import export
from optimum.neuron import NeuronConfig, NeuronModelForCausalLM
from tests.fixtures.llm.models import tiny_model
from tests.fixtures.llm.reference import hf_greedy as reference_greedy

OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")
SMALL = ["--batch_size", "2", "--sequence_length", "32", "--prefill_chunk_size", "8"]
LENGTHS = [1, 7, 8, 9, 16, 17, 24]
GRAPH_FILES = {"inductor": (".pt2",), "eager": (".json",), "xla": (".xla.json", ".hlo.pb", ".constants.safetensors")}
"""Per backend, the files each graph of an artifact has under ``graphs/``."""
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
NEW_TOKENS = 6


def run_cli(entry: str, *args: str) -> subprocess.CompletedProcess:
    """Run one export CLI (``optimum-cli`` or ``python -m``) with ``args``; never raises on failure."""
    if entry == "optimum-cli":
        cmd = [OPTIMUM_CLI, "export", "neuron", *args]
    else:
        cmd = [sys.executable, "-m", "optimum.exporters.neuron", *args]
    env = {**os.environ, "COLUMNS": "500"}  # rich must not wrap the messages the tests read
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)


def export_llama(entry: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """Export the tiny llama with the small config and ``flags``; asserts success."""
    done = run_cli(entry, "--model", str(tiny_model("llama")), *SMALL, *flags, str(out))
    assert done.returncode == 0, f"{entry} failed:\n{done.stdout}\n{done.stderr}"
    assert f"exported to {out}" in done.stdout
    return done


def hf_greedy(ids: torch.Tensor) -> list[int]:
    """Greedy new tokens of transformers' ``generate`` on the tiny llama (no EOS stop)."""
    return reference_greedy(tiny_model("llama"), ids[0].tolist(), NEW_TOKENS)


def check_round_trip(out: Path, backend: str) -> None:
    """The artifact at ``out`` has the expected layout and generates transformers' greedy tokens."""
    body = json.loads((out / "neuron_config.json").read_text())
    assert (body["backend"], body["batch_size"], body["prefill_chunk_size"]) == (backend, 2, 8)
    kinds = ("chunked_prefill", "token_generation")
    expected = {f"{kind}{suffix}" for kind in kinds for suffix in GRAPH_FILES[backend]} | {"manifest.json"}
    assert {p.name for p in (out / "graphs").iterdir()} == expected
    model = NeuronModelForCausalLM.from_pretrained(out)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (1, length), generator=generator) for length in LENGTHS]
    for ids in prompts:
        ours = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, ids.shape[1] :].tolist()
        assert ours == hf_greedy(ids), f"{backend}: prompt length {ids.shape[1]}"
    short, long = prompts[1][0], prompts[5][0]
    batch = torch.zeros(2, long.shape[0], dtype=torch.long)
    mask = torch.zeros_like(batch)
    batch[0, -short.shape[0] :], mask[0, -short.shape[0] :] = short, 1
    batch[1], mask[1] = long, 1
    together = model.generate(batch, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert together[0, long.shape[0] :].tolist() == hf_greedy(short[None])
    assert together[1, long.shape[0] :].tolist() == hf_greedy(long[None])


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
    ("optimum-cli", ["--tensor_parallel_size", "2"], ["tensor parallelism", "--tensor_parallel_size 1"]),
    ("python -m", ["--prefill_chunk_size", "64"], ["prefill_chunk_size=64", "--prefill_chunk_size"]),
    ("optimum-cli", ["--prefill_chunk_size", "-8"], ["prefill_chunk_size=-8", "--prefill_chunk_size"]),
    ("python -m", ["--backend", "neuron"], ["torch_neuronx", "--backend inductor"]),
    ("optimum-cli", ["--backend", "neuron", "--device", "neuron"], ["torch_neuronx", "--backend inductor"]),
    ("python -m", ["--device", "cuda"], ["no CUDA device", "--device cpu"]),
    ("python -m", ["--backend", "xla", "--device", "neuron"], ["torch-neuronx", "no Neuron device", "not verified"]),
    ("optimum-cli", ["--backend", "xla", "--device", "cuda"], ["--device cpu", "--backend inductor --device cuda"]),
    ("python -m", ["--backend", "xla"], ["torch-xla is not installed", "make install-xla"]),
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
        ("python -m", None, ["not a transformers checkpoint folder", "--model"]),
        ("optimum-cli", "my_unknown_arch", ["my_unknown_arch", "supported model types", "llama", "qwen2"]),
        ("python -m", "gpt2", ["'gpt2' is not supported", "llama", "qwen3"]),
    ],
)
def test_bad_model_exits_2_with_fix(tmp_path: Path, entry: str, model_type: str | None, fragments: list[str]) -> None:
    folder = unknown_arch(tmp_path, model_type) if model_type else str(tmp_path / "nowhere")
    done = run_cli(entry, "--model", folder, "--sequence_length", "32", str(tmp_path / "out"))
    assert_refused(done, fragments)


def test_missing_model_flag_is_a_usage_error(tmp_path: Path) -> None:
    done = run_cli("python -m", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "--model" in done.stderr


def assert_refused(done: subprocess.CompletedProcess, fragments: list[str]) -> None:
    """The CLI exited with status 2 and a plain ``error:`` line holding ``fragments``, no traceback."""
    assert done.returncode == 2, f"status {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    assert "error: " in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr
