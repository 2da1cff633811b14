"""Multi-LoRA on the xla backend (`--max_loras 2 --max_lora_rank 8`): the adapter slots are HLO parameters bound like
weights, so adapters load, unload and reload at run time with no new compile; rows on two adapters and the base model
share steps and each equals peft on transformers; no op falls back to the CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from optimum.neuron.artifact import Artifact
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import GREEDY, Recorder, prompt
from tests.fixtures.llm.lora import peft_adapter
from tests.fixtures.llm.models import export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy
from tests.models.test_lora import NEW, generate_together
from tests.utils import subprocess_test

pytestmark = pytest.mark.xla


@pytest.mark.slow
@subprocess_test
def test_xla_adapters_load_at_run_time_and_equal_peft() -> None:
    from optimum.neuron.backends import xla_compat

    engine = Engine(Artifact.open(export_fixture("llama-2x4x8-lora2-xla")))
    paths = {key: peft_adapter(key) for key in ("a", "b", "c")}
    model = tiny_model("llama")
    recorder = Recorder(engine)
    engine.load_adapter("a", paths["a"])
    run(
        engine,
        model,
        paths,
        {"a": prompt(11, seed=90), None: prompt(6, seed=91)},
        then=lambda: engine.load_adapter("b", paths["b"]),
    )
    engine.unload_adapter("a")
    engine.load_adapter("c", paths["c"])  # into a's old slot
    run(engine, model, paths, {"b": prompt(9, seed=92), "c": prompt(7, seed=93)})
    called = {name for name, _ in recorder.calls}
    assert xla_compat.compile_count() == len(called), f"{xla_compat.compile_count()} compiles for graphs {called}"
    assert xla_compat.fallback_ops() == {}, "ops fell back to the CPU"


def run(engine: Engine, model: object, paths: dict, asked: dict, then: Callable[[], None] | None = None) -> None:
    """Generate `NEW` tokens for each prompt of ``asked`` (by adapter; None: the base model) in shared steps, calling
    ``then`` after the first step (while the rows run); each row must equal peft's greedy tokens."""
    for key, ids in asked.items():
        engine.admit(str(key), ids, GREEDY, adapter=key, reuse=False)
    work = {str(key): len(ids) for key, ids in asked.items()}
    engine.step(work)
    if then is not None:
        then()
    generate_together(engine, dict.fromkeys(work, 1))
    for key, ids in asked.items():
        want = hf_greedy(model, ids, NEW, adapter=paths.get(key))
        assert engine.sequence(str(key)).generated[:NEW] == want, f"row on {key}"
        engine.release(str(key))
