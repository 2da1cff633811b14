"""Multi-LoRA (`--max_loras 2 --max_lora_rank 8`, issue 31): PEFT adapters loaded into the artifact's adapter slots at
run time, each request on its adapter or the base model, in the same steps.

Every comparison is against peft's own ``PeftModel`` on transformers (the adapter's forward, unmerged): adapters of
different ranks (4, 8; rsLoRA scaling on one) and target modules, random non-zero B, prompts across a chunk seam (chunks
of 8) and generations across the KV window edge at 16. Then the refusals, each naming its fix, and what unloading does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from optimum.neuron.artifact import Artifact
from optimum.neuron.errors import InputError
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.sampling import SamplingParams
from tests.contract.engine_tools import GREEDY, neuron_model, prompt
from tests.fixtures.llm.lora import peft_adapter
from tests.fixtures.llm.models import FAMILIES, export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy, hf_sampled

NEW = 10
SEEDED = SamplingParams(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=11)


def lora_engine(backend: str) -> Engine:
    """A fresh engine of the ``-lora2`` fixture (tests load and unload adapters: state of their own)."""
    return Engine(Artifact.open(export_fixture(f"llama-2x4x8-lora2-{backend}")))


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_each_adapter_and_the_base_model_equal_peft(backend: str) -> None:
    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM(lora_engine(backend))
    a, b = peft_adapter("a"), peft_adapter("b")
    model.load_adapter(a, "a")
    model.load_adapter(b, "b")
    ids = prompt(11, seed=80)  # a chunk and 3 tokens; 11 + 10 tokens cross the KV window edge at 16
    base = tiny_model("llama")
    for name, adapter in (("a", a), ("b", b), (None, None)):
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, eos_token_id=[], adapter_name=name)
        assert out[0, len(ids) :].tolist() == hf_greedy(base, ids, NEW, adapter=adapter), f"adapter {name}"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_serves_two_adapters_and_the_base_model_in_one_step(family: str) -> None:
    """Two rows, on adapters a and b (Phi-3: its fused projections adapted), decode together; then the base model
    beside a seeded row on b, which draws what peft's distributions give."""
    engine = Engine(Artifact.open(export_fixture(f"{family}-2x4x8-lora2-eager")))
    paths = {key: peft_adapter(key, family) for key in ("a", "b")}
    for key, path in paths.items():
        engine.load_adapter(key, path)
    model = tiny_model(family)
    asked = {"a": prompt(11, seed=86), "b": prompt(6, seed=87)}
    for key, ids in asked.items():
        engine.admit(key, ids, GREEDY, adapter=key, reuse=False)
    generate_together(engine, {key: len(ids) for key, ids in asked.items()})
    for key, ids in asked.items():
        want = hf_greedy(model, ids, NEW, adapter=paths[key])
        assert engine.sequence(key).generated[:NEW] == want, f"{family} on {key}"
        engine.release(key)
    ids = prompt(9, seed=88)
    engine.admit("base", ids, GREEDY, reuse=False)
    engine.admit("seeded", ids, SEEDED, adapter="b", reuse=False)
    generate_together(engine, {"base": len(ids), "seeded": len(ids)})
    assert engine.sequence("base").generated[:NEW] == hf_greedy(model, ids, NEW), f"{family}: the base model"
    want = hf_sampled(model, ids, NEW, SEEDED, engine.config.max_topk, adapter=paths["b"])
    assert engine.sequence("seeded").generated[:NEW] == want, f"{family}: seeded sampling on b"


def generate_together(engine: Engine, work: dict[str, int]) -> None:
    """Step the sequences of ``work`` (their prompt lengths) together until each has `NEW` tokens."""
    while any(len(engine.sequence(s).generated) < NEW for s in work):
        engine.step(work)
        work = {s: 1 for s in work}


def test_requests_on_different_adapters_share_steps() -> None:
    """Two rows on adapters a and b decode in one token-generation call, then the base model beside a; seeded
    sampling on an adapter draws what peft's distributions give."""
    engine = lora_engine("eager")
    a, b = peft_adapter("a"), peft_adapter("b")
    engine.load_adapter("a", a)
    engine.load_adapter("b", b)
    base = tiny_model("llama")
    runs = [(("x", "a", a, 9), ("y", "b", b, 13)), (("z", None, None, 7), ("w", "a", a, 12))]
    for pair in runs:
        for seq_id, name, _, length in pair:
            engine.admit(seq_id, prompt(length, seed=length), GREEDY, adapter=name, reuse=False)
        work = {seq_id: length for seq_id, _, _, length in pair}
        decodes = 0
        while any(len(engine.sequence(s).generated) < NEW for s in work):
            result = engine.step(work)
            decodes += len(result.decodes) == 2
            work = {s: 1 for s in work}
        assert decodes >= NEW - 2, "the two rows did not decode together"
        for seq_id, _, adapter, length in pair:
            want = hf_greedy(base, prompt(length, seed=length), NEW, adapter=adapter)
            assert engine.sequence(seq_id).generated[:NEW] == want, f"{seq_id} on {adapter}"
            engine.release(seq_id)
    ids = prompt(10, seed=81)
    engine.admit("s", ids, SEEDED, adapter="b", reuse=False)
    engine.step({"s": len(ids)})
    while len(engine.sequence("s").generated) < NEW:
        engine.step({"s": 1})
    assert engine.sequence("s").generated == hf_sampled(base, ids, NEW, SEEDED, 256, adapter=b), "seeded on b"
    engine.release("s")


def test_the_prefix_cache_keeps_adapters_apart() -> None:
    """The same prompt on the base model then on an adapter: the adapter's request computes its whole prompt (its K/V
    differ), a second request on the same adapter reuses its blocks."""
    engine = lora_engine("eager")
    engine.load_adapter("a", peft_adapter("a"))
    ids = prompt(17, seed=82)
    for seq_id, adapter in (("base", None), ("first", "a"), ("again", "a")):
        sequence = engine.admit(seq_id, ids, GREEDY, adapter=adapter)
        computed = sequence.computed
        engine.step({seq_id: sequence.pending})
        engine.release(seq_id)
        assert computed == (16 if seq_id == "again" else 0), f"{seq_id}: {computed} tokens taken from the cache"


def test_refusals_name_the_limit_and_unloading_frees_the_slot(tmp_path: Path) -> None:
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    engine = lora_engine("eager")
    base = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    get_peft_model(base, IA3Config(target_modules=["k_proj", "down_proj"])).save_pretrained(tmp_path / "ia3")
    with pytest.raises(InputError, match="only LoRA adapters"):
        engine.load_adapter("ia3", tmp_path / "ia3")
    engine.load_adapter("a", peft_adapter("a"))
    engine.load_adapter("b", peft_adapter("b"))
    with pytest.raises(InputError, match="--max_loras"):
        engine.load_adapter("c", peft_adapter("c"))
    with pytest.raises(InputError, match="already loaded"):
        engine.load_adapter("a", peft_adapter("a"))
    with pytest.raises(InputError, match="no adapter 'nope' is loaded"):
        engine.admit("x", prompt(5, seed=1), GREEDY, adapter="nope")
    engine.admit("x", prompt(5, seed=83), GREEDY, adapter="b", reuse=False)
    with pytest.raises(InputError, match="in use"):
        engine.unload_adapter("b")
    engine.release("x")
    engine.unload_adapter("b")
    assert all(not t[2].any() for t in _slot_tensors(engine)), "an unloaded slot kept its tensors"
    for key, message in (("rank16", "--max_lora_rank 16"), ("dora", "use_dora"), ("embeddings", "embed_tokens")):
        with pytest.raises(InputError, match=message):
            engine.load_adapter(key, peft_adapter(key))
    assert set(engine.adapters.loaded) == {"a"}, "a refused adapter took a slot"
    engine.load_adapter("c", peft_adapter("c"))  # into b's old slot
    ids = prompt(9, seed=84)
    engine.admit("c", ids, GREEDY, adapter="c", reuse=False)
    engine.step({"c": len(ids)})
    for _ in range(3):
        engine.step({"c": 1})
    assert engine.sequence("c").generated == hf_greedy(tiny_model("llama"), ids, 4, adapter=peft_adapter("c"))
    engine.release("c")
    plain = neuron_model("llama-2x4x8-eager").engine
    with pytest.raises(InputError, match="--max_loras"):
        plain.load_adapter("a", peft_adapter("a"))
    with pytest.raises(InputError, match="--max_loras"):
        plain.admit("x", prompt(5, seed=1), GREEDY, adapter="a")


def _slot_tensors(engine: Engine) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per projection: slot 2's A and B (b's slot: the second loaded) and both stacked."""
    names = sorted(n.removesuffix(".lora_a") for n in engine.weights if n.endswith(".lora_a"))
    pairs = [(engine.weights[f"{n}.lora_a"], engine.weights[f"{n}.lora_b"]) for n in names]
    return [(a[2], b[2], torch.cat([a[2].flatten(), b[2].flatten()])) for a, b in pairs]


def rank_tokens(keys: list[str | None]) -> list[list[int]]:
    """On one tensor-parallel rank of the ``-tp2-lora2`` fixture: greedy tokens on each adapter of ``keys`` (None: the
    base model), the adapters loaded into the rank's slots (its part of A and B)."""
    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(export_fixture("llama-2x4x8-tp2-lora2-eager"))
    for key in {k for k in keys if k}:
        model.load_adapter(peft_adapter(key), key)
    ids = torch.tensor([prompt(11, seed=85)])
    return [model.generate(ids, max_new_tokens=NEW, eos_token_id=[], adapter_name=k)[0, 11:].tolist() for k in keys]


@pytest.mark.slow
def test_two_tensor_parallel_ranks_equal_peft(tmp_path: Path) -> None:
    """Each rank holds its slice of every adapter: A's columns for the o and down projections (the delta joins the
    partial product before the all-reduce), B's rows for the others."""
    from tests.models.ranks import run_on_ranks

    keys: list[str | None] = ["a", "b", None]
    export_fixture("llama-2x4x8-tp2-lora2-eager")
    for key in ("a", "b"):
        peft_adapter(key)  # made here, not by both ranks
    ranks = run_on_ranks(2, rank_tokens, keys, tmp=tmp_path)
    assert ranks[0] == ranks[1], "the ranks generated different tokens"
    ids = prompt(11, seed=85)
    for key, tokens in zip(keys, ranks[0], strict=True):
        adapter = peft_adapter(key) if key else None
        assert tokens == hf_greedy(tiny_model("llama"), ids, NEW, adapter=adapter), f"adapter {key}"


def test_loading_and_unloading_an_adapter_while_a_request_runs_leaves_it_alone() -> None:
    engine = lora_engine("eager")
    a = peft_adapter("a")
    engine.load_adapter("a", a)
    ids = prompt(10, seed=89)
    engine.admit("x", ids, GREEDY, adapter="a", reuse=False)
    engine.step({"x": len(ids)})
    for step in range(NEW - 1):
        if step == 2:
            engine.load_adapter("b", peft_adapter("b"))  # the other slot, mid-generation
        if step == 5:
            engine.unload_adapter("b")
        engine.step({"x": 1})
    assert engine.sequence("x").generated == hf_greedy(tiny_model("llama"), ids, NEW, adapter=a)


def test_adapters_over_int8_weights_equal_peft_on_the_dequantized_model() -> None:
    """The slots add to a quantized projection's output (`--weight_format int8`, the packed int8 kernel): the
    reference is peft on transformers running the same dequantized weights."""
    from optimum.neuron.artifact import read_config
    from tests.fixtures.llm.reference import dequantized_checkpoint

    artifact = export_fixture("llama-2x4x8-int8-lora2-eager")
    engine = Engine(Artifact.open(artifact))
    a = peft_adapter("a")
    engine.load_adapter("a", a)
    config = read_config(artifact)
    reference = dequantized_checkpoint(tiny_model("llama"), config.weight_format, config.weight_group_size)
    for name, adapter, seed in (("a", a, 95), (None, None, 96)):
        ids = prompt(11, seed=seed)
        engine.admit("x", ids, GREEDY, adapter=name, reuse=False)
        generate_together(engine, {"x": len(ids)})
        assert engine.sequence("x").generated[:NEW] == hf_greedy(reference, ids, NEW, adapter=adapter), name
        engine.release("x")
