"""Mixed steps (``--mixed_batch``) against two calls a step: SmolLM2-135M-Instruct fp32, inductor, batch 8, S=2048,
C=256, the same artifact with and without the mixed graph (its other graphs shared through the graph cache).

    .venv/bin/python -m benchmark.mixed [--rounds 3] [--machine epyc-2core]

Measured, each in a fresh process, in rounds alternating which artifact goes first:

* ``step``: the engine with 7 sequences decoding (64-token prompts) while an eighth's 1,024-token prompt is fed 249
  tokens a step (what vLLM's budget of C = 256 tokens leaves beside 7 decodes): ms per such step (4 prompts, the
  first a warm-up), and a plain decode step of the 7 for reference;
* ``vllm``: `vllm.LLM` (offline, our plugin) on the peers' batch workload (8 prompts of ~200 tokens -> 128 new
  tokens each) and on long prompts (16 prompts of ~1,000 tokens -> 32 new tokens each, 8 running at a time), greedy,
  no EOS: output tokens per second of wall time.

Results: ``benchmark/results/<machine>/mixed.{md,json}``; run it on a quiet machine (the load is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmark.fresh import answer, run_worker
from benchmark.machine import describe, machine_line

RESULTS = Path(__file__).parent / "results"
BATCH, SEQUENCE_LENGTH, CHUNK = 8, 2048, 256
VARIANTS = ("two calls", "mixed")
WORKLOADS = {"batch": (8, 200, 128), "long prompts": (16, 1000, 32)}
"""vLLM workloads: (prompts, prompt tokens +- 10 %, new tokens)."""


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` random prompts of ``length`` +- 10 % token ids of SmolLM2's vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(length * 9 // 10, length * 11 // 10))]
            for _ in range(count)]  # fmt: skip


def export(model_dir: str, mixed: bool) -> str:
    """The artifact (through the export cache)."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=BATCH, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, mixed_batch=mixed
    )
    return str(cached_export(model_dir, config))


def steps(artifact: str) -> dict[str, float]:
    """Steps of 7 decodes + a 249-token piece of a long prompt, and steps of the 7 decodes alone (ms, medians)."""
    import torch

    from optimum.neuron import NeuronModelForCausalLM
    from optimum.neuron.runtime.sampling import SamplingParams

    torch.set_num_threads(2)
    engine = NeuronModelForCausalLM.from_pretrained(artifact).engine
    rows = list(range(BATCH - 1))
    for row, ids in zip(rows, prompts(len(rows), 64, 0), strict=True):
        engine.admit(row, ids, SamplingParams(), reuse=False)
        engine.step({row: len(ids)})
    piece, fed, decode = CHUNK - len(rows), [], []
    for index, ids in enumerate(prompts(4, 1024, 1)):
        engine.admit("long", ids[:1024], SamplingParams(), reuse=False)
        while not engine.sequence("long").decoding:
            work = dict.fromkeys(rows, 1) | {"long": min(piece, engine.sequence("long").pending)}
            start = time.perf_counter()
            engine.step(work)
            if index:
                fed.append(time.perf_counter() - start)
        engine.release("long")
        start = time.perf_counter()
        engine.step(dict.fromkeys(rows, 1))
        decode.append(time.perf_counter() - start)
    return {"step_ms": 1000 * statistics.median(fed), "decode_ms": 1000 * statistics.median(decode[1:])}


def vllm(artifact: str, workload: str) -> dict[str, float]:
    """Output tok/s of one `vllm.LLM.generate` call on ``workload`` (after a short warm-up request)."""
    from vllm import LLM, SamplingParams

    count, length, new = WORKLOADS[workload]
    llm = LLM(model=artifact, seed=0)
    warmup: list[Any] = [{"prompt_token_ids": [5, 6, 7, 8]}]
    llm.generate(warmup, SamplingParams(max_tokens=4), use_tqdm=False)
    requests: list[Any] = [{"prompt_token_ids": ids} for ids in prompts(count, length, 2)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / wall}


def _worker(spec: dict[str, Any]) -> None:
    if spec["task"] == "export":
        answer({"artifact": export(spec["model_dir"], spec["mixed"])})
    elif spec["task"] == "steps":
        answer(steps(spec["artifact"]))
    else:
        answer(vllm(spec["artifact"], spec["workload"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    from rich.progress import Progress

    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    model_dir = str(convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32"))
    measures = [("steps", None), *(("vllm", w) for w in WORKLOADS)]
    runs: dict[str, list[dict[str, float]]] = {f"{v}:{m}:{w}": [] for v in VARIANTS for m, w in measures}
    loads = [os.getloadavg()[0]]
    with Progress() as progress:
        task = progress.add_task("mixed steps", total=2 + args.rounds * len(VARIANTS) * len(measures))
        artifacts = {}
        for variant in VARIANTS:
            progress.update(task, description=f"export ({variant})")
            spec = {"task": "export", "model_dir": model_dir, "mixed": variant == "mixed"}
            artifacts[variant] = run_worker("benchmark.mixed", spec)["artifact"]
            progress.advance(task)
        for index in range(args.rounds):
            for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
                for measure, workload in measures:
                    progress.update(task, description=f"round {index + 1}: {variant}, {measure} {workload or ''}")
                    spec = {"task": measure, "artifact": artifacts[variant], "workload": workload}
                    runs[f"{variant}:{measure}:{workload}"].append(run_worker("benchmark.mixed", spec))
                    loads.append(os.getloadavg()[0])
                    progress.advance(task)
    write_report(args.machine, args.rounds, runs, loads)


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def write_report(machine: str, rounds: int, runs: dict[str, list[dict[str, float]]], loads: list[float]) -> None:
    """``results/<machine>/mixed.md`` (medians over the rounds, the ratios mixed / two calls) and its JSON."""
    info = describe()
    out = RESULTS / machine
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixed.json").write_text(json.dumps({"machine": info, "runs": runs, "loads": loads}, indent=1))

    def cell(variant: str, measure: str, workload: str | None, key: str) -> float:
        return _median(runs[f"{variant}:{measure}:{workload}"], key)

    def spread(variant: str, measure: str, workload: str | None, key: str) -> str:
        values = [r[key] for r in runs[f"{variant}:{measure}:{workload}"]]
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    rows = [("a step of 7 decodes + 249 prompt tokens, ms", "steps", None, "step_ms"),
            ("a step of the 7 decodes alone, ms", "steps", None, "decode_ms"),
            *((f"`vllm.LLM`, {w} workload, output tok/s", "vllm", w, "tok_s") for w in WORKLOADS)]  # fmt: skip
    lines = [
        "# Mixed steps (`--mixed_batch`) vs two calls a step: SmolLM2-135M-Instruct fp32, inductor",
        "",
        f"Command: `.venv/bin/python -m benchmark.mixed --rounds {rounds} --machine {machine}` (batch {BATCH}, "
        f"S={SEQUENCE_LENGTH}, C={CHUNK}; every measurement in a fresh process, rounds alternating which artifact "
        "goes first; medians over the rounds, range in brackets).",
        "",
        "Machine: " + machine_line(info) + f"; 1-minute load {min(loads):.2f}-{max(loads):.2f} during the run.",
        "",
        "| | two calls (token generation, then the chunk) | mixed (one call) | mixed / two calls |",
        "|---|---|---|---|",
    ]
    for label, measure, workload, key in rows:
        two, mixed = cell("two calls", measure, workload, key), cell("mixed", measure, workload, key)
        lines.append(
            f"| {label} | {spread('two calls', measure, workload, key)} | {spread('mixed', measure, workload, key)} "
            f"| {mixed / two:.3f} |"
        )
    lines += [
        "",
        "- `step`: 7 sequences decode (64-token prompts) while an eighth's 1,024-token prompt is fed 249 tokens a "
        "step, the 256 tokens of vLLM's budget (C) in all; the median over 3 prompts after a warm-up one. The "
        "decode-alone row runs the token-generation graph in both artifacts (the same graph).",
        "- `vllm.LLM`: the batch workload is the peers' (8 prompts of 200 +- 10 % tokens -> 128 new tokens); long "
        "prompts: 16 prompts of 1,000 +- 10 % tokens -> 32 new tokens, 8 running at a time; greedy, no EOS, one "
        "`generate` call, output tokens / its wall time.",
    ]
    (out / "mixed.md").write_text("\n".join(lines) + "\n")
    print((out / "mixed.md").read_text())


if __name__ == "__main__":
    main()
