"""Multi-LoRA on SmolLM2-135M-Instruct through ``vllm serve``: the serving benchmark's main workload, driven by
``vllm bench serve``, on an artifact without adapter slots and on one with them.

    .venv/bin/python -m benchmark.lora_serve [--rounds N] [--machine NAME]

Two artifacts, fp32, inductor, batch 8, S=2048, C=256 (the serving benchmark's shape, `benchmark.serving.configs.FULL`):
one without adapter slots, one with ``--max_loras 4 --max_lora_rank 16`` (every projection). The load is
``FULL.main``: 16 random prompts of 1,500 +- 10 % tokens, 128 +- 10 % new tokens each (EOS ignored, greedy), at most 8
in flight. Three cells, interleaved over rounds, each after a small warm-up load on the same server:

* **plain**: ``vllm serve`` of the artifact without slots;
* **LoRA artifact, base model**: ``vllm serve --enable-lora --lora-modules ...`` of the artifact with slots, every
  request on the base model (slot 0: the adapter products run, on zeros);
* **LoRA artifact, 4 adapters**: the same server, the requests assigned round-robin to 4 random rank-16 PEFT adapters
  (``vllm bench serve --lora-modules``; `benchmark.lora.adapters`).

Output tok/s, inter-token latency (p50 / p99), TPOT and TTFT (p50) as ``vllm bench serve`` measures them; each cell's
median over the rounds and its ratio to plain. Results: ``benchmark/results/<machine>/lora-serve.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmark.lora import BATCH, CHUNK, LABELS, LORAS, RANK, adapters, export_for
from benchmark.machine import describe, machine_line, save_results
from benchmark.serving.configs import FULL, Load
from benchmark.serving.loadgen import run_load
from benchmark.serving.server import SERVED_NAME, serving

RESULTS = Path(__file__).parent / "results"
CELLS = ("plain", "lora-base", "lora-4")
METRICS = ("output_throughput", "p50_itl_ms", "p99_itl_ms", "p50_tpot_ms", "p50_ttft_ms")
WARM_UP = Load(prompts=4, users=4, input_len=300, output_len=8)
"""Before each cell: graphs touched, the 4 adapters loaded into their slots (LoRA cell)."""


def server_flags(paths: list[Path] | None) -> tuple[str, ...]:
    """``vllm serve``'s flags: LoRA enabled with ``paths`` as modules ``l0``.. (None: a plain server)."""
    flags: tuple[str, ...] = ("--served-model-name", SERVED_NAME, "--seed", "0")
    if paths is None:
        return flags
    modules = [f"l{i}={p}" for i, p in enumerate(paths)]
    return (
        *flags,
        "--enable-lora",
        "--max-loras",
        str(LORAS),
        "--max-lora-rank",
        str(RANK),
        "--lora-modules",
        *modules,
    )


def load_flags(cell: str) -> tuple[str, ...]:
    """`vllm bench serve`'s extra flags of ``cell``: its requests spread round-robin over the 4 adapters (lora-4)."""
    if cell != "lora-4":
        return ()
    return ("--lora-modules", *(f"l{i}" for i in range(LORAS)), "--lora-assignment", "round-robin")


def serve_round(artifacts: dict[str, Path], paths: list[Path], work: Path, index: int) -> dict[str, dict[str, float]]:
    """One round: the plain server's cell, then the LoRA server's two cells; each cell's `METRICS`."""
    found: dict[str, dict[str, float]] = {}
    for server, cells in (("plain", ("plain",)), ("lora", ("lora-base", "lora-4"))):
        artifact = artifacts[server]
        log = work / f"{server}-{index}.log"
        with serving(artifact, log, *server_flags(paths if server == "lora" else None)) as running:
            for cell in cells:
                run_load(WARM_UP, running.port, artifact, work / f"{cell}-{index}-warm.json", extra=load_flags(cell))
                result = run_load(
                    FULL.main, running.port, artifact, work / f"{cell}-{index}.json", extra=load_flags(cell)
                )
                found[cell] = {m: float(result[m]) for m in METRICS}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each cell: the median)")
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    args = parser.parse_args()
    from optimum.neuron.progress import StepProgress
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    model_dir = convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32")
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in CELLS}
    with StepProgress("benchmark multi-LoRA serving", args.rounds + 2) as bar:
        with bar.step("export (cached) and adapters"):
            artifacts = {
                "plain": export_for(model_dir, False, FULL.sequence_length),
                "lora": export_for(model_dir, True, FULL.sequence_length),
            }
            paths = adapters(model_dir)
        with tempfile.TemporaryDirectory(prefix="bench-lora-serve-") as tmp:
            for index in range(args.rounds):
                with bar.step(f"round {index + 1}: plain, LoRA base, 4 adapters"):
                    for cell, metrics in serve_round(artifacts, paths, Path(tmp), index).items():
                        samples[cell].append(metrics)
        with bar.step("report"):
            body = {
                "machine": describe(),
                "rounds": args.rounds,
                "load": vars(FULL.main),
                "samples": samples,
                "median": {c: {m: statistics.median(s[m] for s in v) for m in METRICS} for c, v in samples.items()},
            }
            report = render(body)
    save_results(RESULTS / args.machine / "lora-serve.json", body, report)


def render(body: dict[str, Any]) -> str:
    """The markdown report."""
    median = body["median"]
    plain = median["plain"]
    labels = {**LABELS, "lora-4": f"the same server, requests round-robin over {LORAS} random rank-{RANK} adapters"}
    lines = [
        "# Multi-LoRA through `vllm serve`: SmolLM2-135M-Instruct fp32, inductor, CPU, the main serving workload",
        "",
        "Command: `.venv/bin/python -m benchmark.lora_serve`. Machine: "
        + machine_line(body["machine"])
        + f". Batch {BATCH}, S={FULL.sequence_length}, C={CHUNK}; load {body['load']} through `vllm bench serve` "
        f"(random prompts, fixed seed, EOS ignored, greedy), after a warm-up load; the median of {body['rounds']} "
        "interleaved round(s), each server started afresh per round.",
        "",
        "| cell | output tok/s | x plain | ITL p50 / p99 ms | x plain (p50) | TPOT p50 ms | TTFT p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in CELLS:
        m = median[cell]
        speed = m["output_throughput"] / plain["output_throughput"]
        lines.append(
            f"| {labels[cell]} | {m['output_throughput']:.1f} | {speed:.2f}x "
            f"| {m['p50_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} | {m['p50_itl_ms'] / plain['p50_itl_ms']:.2f}x "
            f"| {m['p50_tpot_ms']:.1f} | {m['p50_ttft_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
