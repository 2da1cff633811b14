"""The xla artifact: the CLI round trip, what the graph files hold, version checks, and damaged files
(typed `ArtifactError`s; a damaged HLO module is loaded in a fresh interpreter, never crashing pytest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from optimum.neuron.artifact import sha256_of
from optimum.neuron.backends.xla_graph import ParameterMap
from optimum.neuron.config import runtime_versions
from tests.fixtures.artifacts import artifact_copy, edit_json, expect_artifact_error, rehash_manifest
from tests.fixtures.cli import check_round_trip, export_llama, run_cli
from tests.fixtures.llm.models import tiny_model
from tests.utils import subprocess_test

pytestmark = pytest.mark.xla
NAME = "llama-2x4x8-xla"


def test_optimum_cli_xla_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "xla"
    export_llama("optimum-cli", out, "--backend", "xla", "--device", "cpu")
    check_round_trip(out, "xla")
    body = json.loads((out / "neuron_config.json").read_text())
    assert body["device"] == "cpu"
    assert body["versions"]["torch"] == "2.9.0" and body["versions"]["torch-xla"] == "2.9.0"


def test_parameter_map_names_every_weight_cache_tensor_and_input(tmp_path: Path) -> None:
    root = artifact_copy(NAME, tmp_path)
    weights = load_file(str(root / "model.safetensors"))
    for kind, inputs in (("chunked_prefill", 4), ("chunked_prefill_w16", 4), ("token_generation", 8)):
        spec = ParameterMap.read(root / "graphs" / f"{kind}.xla.json")
        sources = [(p.source, p.key) for p in spec.parameters]
        assert len(sources) == len(set(sources)), f"{kind}: a parameter appears twice"
        used = {key for source, key in sources if source == "weight"}
        assert used == set(weights), f"{kind}: weights unused or unknown: {used ^ set(weights)}"
        assert {key for source, key in sources if source == "cache"} == {str(i) for i in range(4)}
        assert {key for source, key in sources if source == "input"} <= {str(i) for i in range(inputs)}
        assert [o.source for o in spec.outputs] == ["result"] + ["cache"] * 4
        assert [o.key for o in spec.outputs[1:]] == ["0", "1", "2", "3"]
        assert spec.versions == runtime_versions("xla")
        assert (spec.versions["torch"], spec.versions["torch-xla"]) == ("2.9.0", "2.9.0")
        assert (root / "graphs" / f"{kind}.hlo.pb").stat().st_size > 1000


def test_torch_xla_version_mismatch(tmp_path: Path) -> None:
    root = artifact_copy(NAME, tmp_path)
    edit_json(root / "neuron_config.json", lambda c: c["versions"].update({"torch-xla": "2.8.0"}))
    expect_artifact_error(root, "exported with", "2.8.0")


@pytest.mark.parametrize("sidecar", ["hlo.pb", "constants.safetensors"])
def test_damaged_sidecar_file(tmp_path: Path, sidecar: str) -> None:
    root = artifact_copy(NAME, tmp_path)
    path = root / "graphs" / f"token_generation.{sidecar}"
    path.write_bytes(path.read_bytes()[:-10])
    expect_artifact_error(root, "does not match the hash in token_generation.xla.json")
    path.unlink()
    expect_artifact_error(root, f"token_generation.{sidecar}", "is missing")


@pytest.mark.parametrize("text", ["{broken", '{"format": "other"}', '{"format": "optimum-neuronx-xla-graph/1"}'])
def test_malformed_parameter_map(tmp_path: Path, text: str) -> None:
    root = artifact_copy(NAME, tmp_path)
    (root / "graphs" / "chunked_prefill.xla.json").write_text(text)
    rehash_manifest(root)
    expect_artifact_error(root, "chunked_prefill.xla.json")


def test_parameter_map_naming_an_unknown_weight(tmp_path: Path) -> None:
    root = artifact_copy(NAME, tmp_path)
    path = root / "graphs" / "token_generation.xla.json"
    edit_json(path, lambda m: next(p for p in m["parameters"] if p["source"] == "weight").update(key="model.nope"))
    rehash_manifest(root)
    expect_artifact_error(root, "needs weight 'model.nope'")


@pytest.mark.slow
@subprocess_test
def test_garbage_hlo_module_with_matching_hashes(tmp_path: Path) -> None:
    root = artifact_copy(NAME, tmp_path)
    hlo = root / "graphs" / "token_generation.hlo.pb"
    hlo.write_bytes(b"\x0a\x05not an hlo module" * 20)
    edit_json(root / "graphs" / "token_generation.xla.json", lambda m: m["files"]["hlo"].update(sha256=sha256_of(hlo)))
    rehash_manifest(root)
    expect_artifact_error(root, "cannot load the HLO module of token_generation.xla.json")


def test_device_neuron_names_what_is_missing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli("python -m", "--model", str(tiny_model("llama")), "--backend", "xla", "--device", "neuron", str(out))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    for fragment in ("torch-neuronx", "libneuronxla", "no Neuron device", "not verified", "--device cpu"):
        assert fragment in done.stderr, done.stderr
    assert not out.exists()
