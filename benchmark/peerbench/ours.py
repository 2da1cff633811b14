"""Our measurements, each run in a fresh interpreter by the orchestrator (`benchmark.peers`):

    python -m benchmark.peerbench.ours SPEC.json     # prints one JSON line

``SPEC`` names the measurement (``decode``, ``prefill``, ``generate`` or ``vllm``), the artifact and the inputs
(token ids made by the orchestrator, identical for every system). Two threads, as every peer gets.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from benchmark.peerbench.plan import DECODE_WARMUP

THREADS = 2


def _engine(artifact: str) -> Any:
    from optimum.neuron import NeuronModelForCausalLM

    return NeuronModelForCausalLM.from_pretrained(artifact).engine


def decode(spec: dict[str, Any]) -> dict[str, Any]:
    """Token-generation steps of the engine with ``batch`` live rows after a short prompt each (as
    `benchmark.decode` does): `DECODE_WARMUP` warm-up steps, then ``steps`` timed ones. ms per step."""
    from optimum.neuron.runtime.sampling import SamplingParams

    engine = _engine(spec["artifact"])
    prompts = spec["prompts"]
    for row, prompt in enumerate(prompts):
        engine.admit(row, prompt, SamplingParams())
        engine.step({row: len(prompt)})
    every = dict.fromkeys(range(len(prompts)), 1)
    for _ in range(DECODE_WARMUP):
        engine.step(every)
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        engine.step(every)
        times.append(time.perf_counter() - start)
    return {"mean_ms": 1000 * statistics.mean(times), "median_ms": 1000 * statistics.median(times)}


def prefill(spec: dict[str, Any]) -> dict[str, Any]:
    """Time to first token (ms) of each prompt: one engine step that prefills it whole (chunk by chunk inside
    the step) and samples its first token. One warm-up prompt of each length first; every timed prompt is new."""
    from optimum.neuron.runtime.sampling import SamplingParams

    engine = _engine(spec["artifact"])
    out: dict[str, Any] = {}
    for length, prompts in spec["prompts"].items():
        times = []
        for i, prompt in enumerate(prompts):
            engine.admit("p", prompt, SamplingParams())
            start = time.perf_counter()
            engine.step({"p": len(prompt)})
            elapsed = time.perf_counter() - start
            engine.release("p")
            if i > 0:
                times.append(elapsed)
        out[length] = 1000 * statistics.median(times)
    return out


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """The batch workload through `NeuronModelForCausalLM.generate`: every prompt in one left-padded call,
    exactly ``new_tokens`` greedy tokens each (no end-of-sequence). Output tokens per second of wall time."""
    import torch

    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(spec["artifact"])
    model.generate(torch.tensor([spec["warmup"]]), max_new_tokens=4, eos_token_id=[])
    prompts, new = spec["prompts"], spec["new_tokens"]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[])
    wall = time.perf_counter() - start
    tokens = int(out.shape[0] * (out.shape[1] - width))
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """The batch workload through `vllm.LLM` (offline, our platform plugin): all prompts in one ``generate``
    call, greedy, ``ignore_eos``. Output tokens per second of the ``generate`` call's wall time."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["artifact"], seed=0)
    warmup: list[Any] = [{"prompt_token_ids": spec["warmup"]}]
    llm.generate(warmup, SamplingParams(max_tokens=4), use_tqdm=False)
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    requests: list[Any] = [{"prompt_token_ids": p} for p in spec["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def export(spec: dict[str, Any]) -> dict[str, Any]:
    """Our fp32 inductor artifact of ``batch`` rows (and ``linear_kernel``, ``weight_format``,
    ``weight_group_size``, ``lm_head_format``) through the export cache (compiled on first use)."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=spec["batch"],
        sequence_length=spec["sequence_length"],
        prefill_chunk_size=spec["chunk"],
        auto_cast_type="fp32",
        backend="inductor",
        linear_kernel=spec.get("linear_kernel", "auto"),
        weight_format=spec.get("weight_format", "float"),
        weight_group_size=spec.get("weight_group_size", 0),
        lm_head_format=spec.get("lm_head_format", "float"),
    )
    return {"artifact": str(cached_export(spec["model"], config))}


MEASUREMENTS = {"export": export, "decode": decode, "prefill": prefill, "generate": generate, "vllm": vllm}


def main() -> None:
    """Run the measurement the spec file names and print its result as the last JSON line."""
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    import torch

    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    result = MEASUREMENTS[spec["measure"]](spec)
    print("PEERS_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
