"""The packed CPU kernel in the decoder (`--linear_kernel`, docs/architecture.md "Linear layers on the CPU"): an
artifact packing its linear layers computes what the one using torch's linear computes, stores the checkpoint's
layout, and holds one weight set (the packed tensors replace the stored ones; a tied table is packed once and
serves both the lookup and the LM head)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from optimum.neuron.artifact import WEIGHTS_FILE, Artifact, graph_weights
from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.kernels.huge_pages import huge_pages_offered
from optimum.neuron.kernels.packed import PANEL
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import alone, prefill_logits, prompt
from tests.fixtures.llm.models import export_fixture
from tests.utils import tile_one_arena

PACKED, ATEN = "llama-2x4x8-eager", "llama-2x4x8-aten-eager"


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    return Engine(Artifact.open(export_fixture(PACKED))), Engine(Artifact.open(export_fixture(ATEN)))


@pytest.mark.parametrize("length", [1, 7, 9, 20])
def test_packed_and_aten_linears_agree(engines: tuple[Engine, Engine], length: int) -> None:
    packed, aten = engines
    ids = prompt(length, length)
    torch.testing.assert_close(prefill_logits(packed, ids), prefill_logits(aten, ids), rtol=1e-4, atol=1e-4)
    assert alone(packed, ids, 8) == alone(aten, ids, 8)


def test_artifact_stores_the_checkpoint_layout_and_the_engine_one_packed_set(engines: tuple[Engine, Engine]) -> None:
    packed, aten = engines
    stored = load_file(str(packed.artifact.root / WEIGHTS_FILE))
    assert {k: v.shape for k, v in stored.items()} == {k: v.shape for k, v in aten.weights.items()}
    assert packed.config.packed_linears and not aten.config.packed_linears
    assert set(packed.weights) == set(stored), "packing added or dropped a tensor"
    q = packed.weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (-(-stored["model.layers.0.self_attn.q_proj.weight"].shape[0] // PANEL), 64, PANEL)
    padding = sum(t.numel() - stored[n].numel() for n, t in packed.weights.items())
    assert padding == 0, "the tiny llama's rows are multiples of 16: packing must not add memory"
    decoder = packed._module(next(iter(packed.specs.values()))).decoder
    table = packed.weights["model.embed_tokens.weight"]
    assert decoder.model.embed_tokens.weight.data_ptr() == table.data_ptr(), "the decoder holds a copy of the table"
    assert decoder.lm_head is None, "the tied table is held once: the LM head reads the embedding's"


@pytest.mark.skipif(not huge_pages_offered(), reason="this OS offers no transparent huge pages")
def test_the_packed_tensors_share_one_arena_on_huge_pages(engines: tuple[Engine, Engine]) -> None:
    packed, _aten = engines
    streamed = [t for t in packed.weights.values() if t.dim() == 3 and t.shape[-1] == PANEL]
    assert len(streamed) > 2
    assert tile_one_arena(sorted(streamed, key=lambda t: t.data_ptr())), "the packed weights do not tile one arena"


def test_packed_weights_off_the_cpu_are_refused(engines: tuple[Engine, Engine]) -> None:
    packed, _aten = engines
    stored = {k: v.to("meta") for k, v in load_file(str(packed.artifact.root / WEIGHTS_FILE)).items()}
    with pytest.raises(IncompatibleConfigError, match=r"CPU only.*--linear_kernel aten"):
        graph_weights(packed.model_config, packed.config, stored)
