"""Tensor parallelism on the xla backend: what can be checked with torch-xla 2.9 on XLA:CPU (docs/xla.md).

The exporter's own rank graph (tiny llama at 2 ranks, rank 0's decoder bound to its slice, under the export's fake
process group) traced by `XlaBackend.compile`: every HLO module holds one all-reduce (sum, over all replicas) per
row-parallel projection, the collective neuronx-cc would lower, with no CPU fallback in the trace. Running it is not
possible here (a process is a world of one XLA:CPU device; CPU_NUM_DEVICES threads deadlock in XLA's rendezvous), so
the export stays refused (`IncompatibleConfigError`, also checked here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from optimum.exporters.neuron.compile import hf_config_of, load_decoder
from optimum.exporters.neuron.parallel import tracing_group
from optimum.neuron.artifact import allocate_cache
from optimum.neuron.backends import xla_compat
from optimum.neuron.backends.xla import XlaBackend
from optimum.neuron.backends.xla_graph import ParameterMap
from optimum.neuron.config import NeuronConfig
from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.graphs import example_inputs, graph_args, graph_specs, symbolic_dims
from optimum.neuron.models.base import graph_module
from tests.fixtures.llm.models import tiny_model

pytestmark = pytest.mark.xla

ALL_REDUCE = re.compile(r"= \((f32\[[\d,]+\])[^)]*\) all-reduce\(.*replica_groups=\{\},.*to_apply=%(\S+)")


def test_rank_graph_hlo_holds_the_all_reduces(tmp_path: Path) -> None:
    model = tiny_model("llama", num_key_value_heads=2)
    # the rank decoder does not depend on the backend: the config is eager's (one KV window, so its graphs are the
    # static ones the xla backend would compile, aten linears and the gather + SDPA attention, what the xla backend's
    # graphs call), the trace is the xla backend's
    config = NeuronConfig(
        batch_size=2,
        sequence_length=32,
        prefill_chunk_size=8,
        kv_buckets="none",
        chunk_buckets="none",  # an eager config traced by xla: one window and one chunk length, static shapes
        tp_degree=2,
        backend="eager",
        linear_kernel="aten",
        attention_kernel="sdpa",
        decode_logits=False,  # the two graphs this test has always traced
    )
    backend, hf_config = XlaBackend(), hf_config_of(model)
    device = backend.placement("cpu")
    with tracing_group(2):
        decoder, _weights = load_decoder(hf_config, model, config, device)
        cache = allocate_cache(hf_config, config, device)
        blocks = (config.kv_blocks, 1, config.block_size, 16)  # the pool and the scratch block
        assert [tuple(t.shape) for t in cache[:1]] == [blocks]  # one of the 2 KV heads per rank
        for spec in graph_specs(config):
            inputs = {k: v.to(device) for k, v in example_inputs(spec).items()}
            path = tmp_path / f"{spec.name}.xla.json"
            args = graph_args(spec.kind, inputs, cache)
            backend.compile(graph_module(decoder, spec).eval(), args, path, symbolic_dims(spec))
            text = xla_compat.hlo_text((tmp_path / f"{spec.name}.hlo.pb").read_bytes())
            found = ALL_REDUCE.findall(text)
            # one after each o_proj and each down_proj, of the hidden states [rows, tokens, hidden]
            assert len(found) == 2 * hf_config.num_hidden_layers, f"{spec.name}: {found}"
            hidden = f",{hf_config.hidden_size}]"
            assert all(shape.endswith(hidden) for shape, _ in found), found
            for _, reducer in found:
                body = text.split(f"%{reducer} ", 1)[1].split("}", 1)[0]
                assert " add(" in body, f"{spec.name}: the all-reduce does not sum ({body})"
            weights = {p.key: p.shape for p in ParameterMap.read(path).parameters if p.source == "weight"}
            q = next(shape for key, shape in weights.items() if key.endswith("layers.0.self_attn.q_proj.weight"))
            o = next(shape for key, shape in weights.items() if key.endswith("layers.0.self_attn.o_proj.weight"))
            heads_dim = hf_config.num_attention_heads * hf_config.head_dim
            assert q == [heads_dim // 2, hf_config.hidden_size] and o == [hf_config.hidden_size, heads_dim // 2]


def test_export_refuses_xla_tensor_parallelism() -> None:
    with pytest.raises(IncompatibleConfigError, match="cannot run it across ranks on XLA:CPU") as err:
        NeuronConfig(tp_degree=2, backend="xla")
    assert "--tensor_parallel_size 1" in str(err.value) and "--backend inductor" in str(err.value)
