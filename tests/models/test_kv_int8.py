"""The int8 KV cache (``--kv_cache_dtype int8``, `models.layers.kv_cache`): an int8-KV artifact computes what
transformers computes over a KV cache fake-quantized with the same scheme (last-token logits and greedy tokens of
prompts across chunk seams and block boundaries, batches of mixed lengths, chunked and context encoding, the paged
kernel and the gather, eager and inductor, a sliding-window family, two tensor-parallel ranks), and differs from the
float artifact by a small nonzero error; the padded-chunk rule stays bitwise; the cache holds int8 values and float32
scales and the artifact records the dtype; bad values are refused naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from optimum.neuron.artifact import Artifact
from optimum.neuron.config import CONFIG_FILE, NeuronConfig
from optimum.neuron.errors import IncompatibleConfigError
from optimum.neuron.models.layers.kv_cache import cache_bytes, dequantize_kv, quantize_kv
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.generate import generate_tokens
from tests.contract.engine_tools import GREEDY, alone, prefill_logits, prompt
from tests.fixtures.llm.models import KV_INT8_FIXTURES, export_fixture, fixture_named
from tests.fixtures.llm.reference import fake_quantized_kv, hf_int8_kv_greedy, hf_int8_kv_logits
from tests.models.ranks import greedy_on_rank, run_on_ranks

SINGLE = [
    pytest.param(f.name, marks=pytest.mark.slow) if f.backend == "inductor" else f.name
    for f in KV_INT8_FIXTURES
    if f.tp == 1
]
RANKED = [f.name for f in KV_INT8_FIXTURES if f.tp > 1]
LENGTHS = (1, 4, 7, 8, 9, 16, 17, 25)
"""Prompt lengths: inside a block (4 positions), a block, a chunk (8) and its neighbours, two chunks and one past."""
NEW = 6
LOGIT_TOLERANCE = 2e-2
"""Max abs difference of the last-token logits from transformers over the fake-quantized cache. Measured (eager, the
lengths above): at most 1.3e-5, as the float artifact's parity, except where a value lies on a rounding edge of ``x /
scale`` and the two, computing ``x`` in another order, round it one step apart: qwen2 at length 8 (one V value of
layer 1, checked) gives 9.0e-3, llama at 9 gives 1.6e-4. The int8 cache's own error, the distance to the float
artifact, is 4e-2 to 5.6e-1 on these models (`FLOAT_MARGIN`)."""
FLOAT_MARGIN = 10
"""The float artifact lies at least this many times farther than the reference (the reference models the error)."""


def float_twin(name: str) -> str:
    """The float-KV fixture of an int8-KV one."""
    return name.replace("-kvint8", "")


@pytest.mark.parametrize("name", SINGLE)
def test_int8_kv_artifact_equals_transformers_over_a_fake_quantized_cache(name: str) -> None:
    engine = Engine(Artifact.open(export_fixture(name)))
    float_engine = Engine(Artifact.open(export_fixture(float_twin(name))))
    model = fixture_named(name).model()
    for length in LENGTHS:
        ids = prompt(length, length)
        got = prefill_logits(engine, ids)
        error = (got - hf_int8_kv_logits(model, ids)).abs().max().item()
        assert error < LOGIT_TOLERANCE, (name, length, error)
        assert (got - prefill_logits(float_engine, ids)).abs().max().item() > FLOAT_MARGIN * error, (name, length)
        assert alone(engine, ids, NEW) == hf_int8_kv_greedy(model, ids, NEW), (name, length)


def test_a_mixed_batch_equals_transformers_and_the_gather_equals_the_kernel() -> None:
    """Two prompts of other lengths decoded together, on the paged kernel and on the gather (``--attention_kernel
    sdpa``: the int8 blocks dequantized in the graph)."""
    from optimum.exporters.neuron.export import cached_export

    fixture = fixture_named("llama-2x4x8-kvint8-eager")
    gather = Engine(
        Artifact.open(cached_export(fixture.model(), fixture.neuron_config().derive(attention_kernel="sdpa")))
    )
    kernel = Engine(Artifact.open(export_fixture(fixture.name)))
    prompts = [prompt(3, 1), prompt(2 * 8 + 5, 2)]
    want = [hf_int8_kv_greedy(fixture.model(), ids, NEW) for ids in prompts]
    assert generate_tokens(kernel, prompts, NEW, GREEDY, set()) == want
    assert generate_tokens(gather, prompts, NEW, GREEDY, set()) == want


@pytest.mark.parametrize(
    "name", ["llama-2x4x8-kvint8-eager", pytest.param("llama-2x4x8-kvint8-inductor", marks=pytest.mark.slow)]
)
def test_padded_chunk_writes_stay_bitwise_on_an_int8_kv_artifact(name: str) -> None:
    """Values and scales: per-token quantization keeps each padded column's write that of the real last token."""
    from tests.contract import kv_inspection

    kv_inspection.check_padded_chunk_writes_on(Engine(Artifact.open(export_fixture(name))))


def test_padded_chunk_writes_stay_bitwise_on_a_bf16_int8_kv_artifact() -> None:
    """bf16 (the gather, dequantized in the graph into bf16): padded columns still write bitwise the real last token's
    values and scales."""
    from optimum.exporters.neuron.export import cached_export
    from tests.contract import kv_inspection

    fixture = fixture_named("llama-2x4x8-kvint8-eager")
    bf16 = cached_export(fixture.model(), fixture.neuron_config().derive(auto_cast_type="bf16"))
    engine = Engine(Artifact.open(bf16))
    assert engine.kv_cache[0].dtype == torch.int8 and engine.kv_cache[2].dtype == torch.float32
    kv_inspection.check_padded_chunk_writes_on(engine)


def test_the_cache_holds_int8_values_and_float32_scales_and_the_artifact_records_it() -> None:
    root = export_fixture("llama-2x4x8-kvint8-eager")
    engine, float_engine = Engine(Artifact.open(root)), Engine(Artifact.open(export_fixture("llama-2x4x8-eager")))
    assert '"kv_cache_dtype": "int8"' in (root / CONFIG_FILE).read_text()
    assert engine.config.kv_cache_dtype == "int8" and len(engine.kv_cache) == 2 * len(float_engine.kv_cache)
    k, v, k_scale, v_scale = engine.kv_cache[:4]
    assert (k.dtype, v.dtype, k_scale.dtype, v_scale.dtype) == (torch.int8, torch.int8, torch.float32, torch.float32)
    assert k.shape == float_engine.kv_cache[0].shape and k_scale.shape == k.shape[:3]
    ratio = cache_bytes(engine.kv_cache) / cache_bytes(float_engine.kv_cache)
    dim = k.shape[-1]
    assert ratio == (dim + 4) / (4 * dim)  # head_dim 16 here: 0.3125; SmolLM2's 64: 0.265625


@pytest.mark.slow
def test_two_ranks_each_hold_their_heads_values_and_scales(tmp_path: Path) -> None:
    """Padded heads (8 query / 4 KV heads over 2 ranks): both ranks return transformers' greedy tokens over the
    fake-quantized cache."""
    (name,) = RANKED
    export_fixture(name)
    ranks = run_on_ranks(2, greedy_on_rank, [name], LENGTHS, NEW, tmp=tmp_path)
    assert ranks[0] == ranks[1], "the ranks returned different tokens"
    model = fixture_named(name).model()
    for length, tokens in ranks[0][name].items():
        assert tokens == hf_int8_kv_greedy(model, prompt(length, length), NEW), length


def test_the_scheme_is_the_documented_one() -> None:
    """``scale = max|x| / 127`` per (token, head) vector, ``q = round(x / scale)`` half to even, ±127; a zero vector
    gives scale 0 and zeros; the round trip is within half a step and equals the reference's fake quantization."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16)
    x[1, 2, 3] = 0
    q, scale = quantize_kv(x)
    assert (q.dtype, scale.dtype, scale.shape) == (torch.int8, torch.float32, (2, 3, 5))
    assert torch.equal(scale, x.abs().amax(dim=-1) / 127)
    assert not q[1, 2, 3].any() and scale[1, 2, 3].item() == 0
    assert int(q.abs().max()) == 127
    back = dequantize_kv(q, scale, torch.float32)
    assert ((back - x).abs() <= scale.unsqueeze(-1) / 2 + 1e-7).all()
    assert torch.equal(back, fake_quantized_kv(x))
    edge = torch.tensor([[127.0, 0.5, 1.5, -2.5]])  # scale 1: halves round to even
    assert quantize_kv(edge)[0].tolist() == [[127, 0, 2, -2]]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_cache_dtype": "int4"}, r"kv_cache_dtype='int4' is not one of .*--kv_cache_dtype"),
        ({"kv_cache_dtype": "fp8"}, r"fp8 KV cache is not implemented.*--kv_cache_dtype"),
        ({"kv_cache_dtype": "int8", "backend": "xla"}, r"not 'xla'.*--kv_cache_dtype auto"),
        ({"kv_cache_dtype": "int8", "backend": "neuron", "device": "neuron"}, r"not 'neuron'.*--kv_cache_dtype"),
    ],
)
def test_bad_kv_cache_dtypes_are_refused_naming_the_flag(fields: dict, message: str) -> None:
    with pytest.raises(IncompatibleConfigError, match=message):
        NeuronConfig(**fields)


def test_an_image_text_artifact_with_an_int8_kv_cache_equals_transformers() -> None:
    """Idefics3 (eager, chunk 24: an image span straddles a chunk seam): the language decoder's cache is int8, and the
    greedy tokens equal transformers' over the fake-quantized cache."""
    from optimum.neuron import NeuronModelForImageTextToText
    from tests.fixtures.llm.idefics3 import NEW_TOKENS, idefics3_export, inputs, our_tokens, reference
    from tests.fixtures.llm.reference import int8_kv_cache

    model = NeuronModelForImageTextToText.from_pretrained(idefics3_export(24, kv_cache_dtype="int8"))
    assert model.engine.kv_cache[0].dtype == torch.int8
    batch = inputs(["hello the <image> what is this"], [[0]])
    hf = reference()
    cache = int8_kv_cache(hf.config.text_config)
    want = hf.generate(
        **batch, past_key_values=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert our_tokens(model, batch) == want[:, batch["input_ids"].shape[1] :].tolist()
