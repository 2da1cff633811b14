"""Multi-LoRA through vLLM (``--enable-lora`` on an artifact exported with ``--max_loras 2 --max_lora_rank 8``):
requests on two adapters and the base model in one ``generate`` call, each equal to peft's ``PeftModel`` greedy; a
third adapter takes the slot of the least recently used one; ``vllm serve`` with ``--lora-modules`` and adapters
loaded and unloaded over HTTP (``/v1/load_lora_adapter``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.contract.engine_tools import prompt
from tests.fixtures.llm.lora import peft_adapter
from tests.fixtures.llm.models import export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy
from tests.utils import settled, subprocess_test
from tests.vllm.server import vllm_serve

pytestmark = [pytest.mark.vllm]
FIXTURE = "llama-2x4x8-lora2-eager"
NEW = 8


def test_read_adapters_stay_in_host_memory_up_to_max_cpu_loras(tmp_path: Path) -> None:
    """``--max-cpu-loras 3`` over 2 slots: an adapter evicted from its slot comes back from host memory (its folder
    is gone by then) and still equals peft; with 2, the least recently read one is dropped and read again."""
    from optimum.neuron.artifact import Artifact
    from optimum.neuron.runtime.engine import Engine
    from optimum.neuron.runtime.generate import generate
    from optimum.neuron.vllm.compat import LoraAdapter
    from optimum.neuron.vllm.lora import VllmAdapters
    from tests.contract.engine_tools import GREEDY

    paths = {key: peft_adapter(key) for key in ("a", "b", "c")}
    copies = {key: shutil.copytree(path, tmp_path / key) for key, path in paths.items()}
    known = {key: LoraAdapter(i + 1, key, str(copies[key])) for i, key in enumerate(paths)}
    engine = Engine(Artifact.open(export_fixture(FIXTURE)))
    adapters = VllmAdapters(engine, host_capacity=3)
    for key in ("a", "b", "c"):  # c takes a's slot
        adapters.slot_name(known[key])
    assert VllmAdapters.name(1) not in engine.adapters.loaded, "a kept its slot"
    for copy in copies.values():
        shutil.rmtree(copy)
    name = adapters.slot_name(known["a"])  # from host memory, into b's slot
    ids = prompt(9, seed=94)
    got = generate(engine, [ids], NEW, GREEDY, set(), adapter=name).tokens[0]
    assert got == hf_greedy(tiny_model("llama"), ids, NEW, adapter=paths["a"])
    assert list(adapters.host) == [2, 3, 1], "the host order is not the order of use"
    bounded = VllmAdapters(Engine(Artifact.open(export_fixture(FIXTURE))), host_capacity=2)
    for key in ("a", "b", "c"):
        bounded.slot_name(LoraAdapter(known[key].lora_id, key, str(paths[key])))
    assert list(bounded.host) == [2, 3], "more adapters than --max-cpu-loras kept in host memory"


@pytest.mark.slow
@subprocess_test
def test_llm_serves_each_request_on_its_adapter() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    base = tiny_model("llama")
    paths = {key: peft_adapter(key) for key in ("a", "b", "c")}
    lora = {key: LoRARequest(key, i + 1, str(path)) for i, (key, path) in enumerate(paths.items())}
    llm = LLM(model=str(export_fixture(FIXTURE)), seed=0, enable_lora=True, max_loras=2, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    asked = [("a", prompt(11, seed=90)), ("b", prompt(6, seed=91)), (None, prompt(9, seed=92))]
    requests = [{"prompt_token_ids": ids} for _, ids in asked]
    outputs = llm.generate(requests, greedy, lora_request=[lora[k] if k else None for k, _ in asked], use_tqdm=False)
    for (key, ids), out in zip(asked, outputs, strict=True):
        want = hf_greedy(base, ids, NEW, adapter=paths[key] if key else None)
        assert list(out.outputs[0].token_ids) == want, f"adapter {key}"
    ids = prompt(7, seed=93)  # a third adapter: into the slot of the least recently used one
    out = llm.generate([{"prompt_token_ids": ids}], greedy, lora_request=lora["c"], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(base, ids, NEW, adapter=paths["c"]), "adapter c"
    out = llm.generate([{"prompt_token_ids": ids}], greedy, lora_request=lora["a"], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(base, ids, NEW, adapter=paths["a"]), "adapter a, reloaded"
    assert settled(lambda: llm.collective_rpc("slot_usage"), [{}]) == [{}], "a finished request kept its KV slot"


def test_vllm_serve_with_lora_modules_and_runtime_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    base, a, b = tiny_model("llama"), peft_adapter("a"), peft_adapter("b")
    flags = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a={a}")
    with vllm_serve(export_fixture(FIXTURE), tmp_path / "serve.log", *flags) as server:
        models = {m["id"] for m in server.get("/v1/models")["data"]}
        assert "a" in models, models
        ids = prompt(10, seed=94)

        def complete(model: str) -> list[int]:
            body = {"model": model, "prompt": ids, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
            return list(server.post("/v1/completions", {**body, "return_token_ids": True})["choices"][0]["token_ids"])

        assert complete("a") == hf_greedy(base, ids, NEW, adapter=a), "adapter a over HTTP"
        base_name = next(m for m in models if m != "a")
        assert complete(base_name) == hf_greedy(base, ids, NEW), "the base model over HTTP"
        status, body = server.post_error("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(b)})
        assert status == 200, body
        assert complete("b") == hf_greedy(base, ids, NEW, adapter=b), "adapter b, loaded at run time"
        status, body = server.post_error("/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 200, body
        status, body = server.post_error("/v1/completions", {"model": "b", "prompt": ids, "max_tokens": 2})
        assert status == 404, (status, body)
