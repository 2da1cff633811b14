"""Parallelism benchmark: SmolLM2-135M served by `vllm serve` at TP=1, DP=2 (two replicas of the TP=1 artifact)
and TP=2 (SmolLM2's 9 query / 3 KV heads padded to 12 / 4, `layers.parallel.HeadLayout`), the same
`vllm bench serve` load against each: output throughput and inter-token latency (the decode step's time).

    .venv/bin/python -m benchmark.parallel [--quick]

On a 2-core CPU this measures what a user of such a machine gets, not what parallelism buys on a Neuron host:
DP=2 gives each replica one core and TP=2 each rank one core (`VLLM_CPU_OMP_THREADS_BIND="0|1"`); TP=2 pays two
gloo all-reduces per layer per step and computes a third more attention heads (the padded ones). Results go to
``benchmark/results/<machine>/parallel.md``; run it on a quiet machine (the load is recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmark.machine import describe, machine_line
from benchmark.serving.configs import Load
from benchmark.serving.loadgen import run_load
from benchmark.serving.server import SERVED_NAME, serving

RESULTS = Path(__file__).parent / "results"
BATCH, SEQUENCE_LENGTH, CHUNK = 4, 1024, 256
LOAD = Load(prompts=24, users=8, input_len=256, output_len=64, range_ratio=0.1)
QUICK_LOAD = Load(prompts=8, users=4, input_len=128, output_len=16, range_ratio=0.1)
SETUPS: dict[str, tuple[int, tuple[str, ...], dict[str, str]]] = {
    # name -> (tensor-parallel degree of the artifact, extra `vllm serve` flags, extra environment)
    "TP=1": (1, (), {}),
    "DP=2": (1, ("--data-parallel-size", "2", "--api-server-count", "1"), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    "TP=2": (2, (), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
}


def export_for(model_dir: Path, degree: int) -> Path:
    """The served artifact (inductor, fp32, the README's shape) at tensor-parallel degree ``degree`` (cached)."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(batch_size=BATCH, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, tp_degree=degree)
    return cached_export(model_dir, config)


def serve_once(artifact: Path, flags: tuple[str, ...], env: dict[str, str], load: Load, work: Path) -> dict[str, Any]:
    """Serve ``artifact`` with ``flags`` and ``env`` and drive ``load``: `vllm bench serve`'s summary."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server inherits it
    try:
        with serving(artifact, work / "server.log", "--served-model-name", SERVED_NAME, "--seed", "0", *flags) as srv:
            return run_load(load, srv.port, artifact, work / "result.json")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 short prompts per setup")
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    args = parser.parse_args()
    from rich.progress import Progress

    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    load = QUICK_LOAD if args.quick else LOAD
    model_dir = convert_smollm2(default_smollm2_dir("float32"), dtype="float32")
    results: dict[str, dict[str, Any]] = {}
    with Progress() as progress, tempfile.TemporaryDirectory() as tmp:
        task = progress.add_task("parallel", total=len(SETUPS))
        for name, (degree, flags, env) in SETUPS.items():
            progress.update(task, description=f"export + serve {name}")
            work = Path(tmp) / name.replace("=", "")
            work.mkdir()
            results[name] = serve_once(export_for(model_dir, degree), flags, env, load, work)
            progress.advance(task)
    write_report(args.machine, load, results, args.quick)


def write_report(machine: str, load: Load, results: dict[str, dict[str, Any]], quick: bool) -> None:
    """Markdown table (and JSON) under benchmark/results/<machine>/parallel.{md,json}."""
    keys = ("output_throughput", "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "median_e2el_ms")
    summary = {name: {k: result.get(k) for k in keys} for name, result in results.items()}
    out = RESULTS / machine
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.json").write_text(json.dumps({"load": dataclasses.asdict(load), "results": summary}, indent=1))
    base = summary["TP=1"]["output_throughput"]
    lines = [
        "# Parallelism: SmolLM2-135M-Instruct served by vLLM, fp32, inductor",
        "",
        f"Command: `.venv/bin/python -m benchmark.parallel{' --quick' if quick else ''}` (artifact batch {BATCH}, "
        f"S={SEQUENCE_LENGTH}, C={CHUNK}; `vllm bench serve` random dataset, {load.prompts} prompts of "
        f"{load.input_len} +- {int(load.range_ratio * 100)} % tokens, {load.output_len} new tokens, "
        f"{load.users} users, greedy).",
        "",
        "Machine: " + machine_line(describe()) + " (1-minute load when the run ended).",
        "",
        "| setup | output tok/s | x TP=1 | ITL p50 ms | ITL p99 ms | TTFT p50 ms | e2e p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        lines.append(
            f"| {name} | {row['output_throughput']:.1f} | {row['output_throughput'] / base:.2f} | "
            f"{row['median_itl_ms']:.1f} | {row['p99_itl_ms']:.1f} | {row['median_ttft_ms']:.0f} | "
            f"{row['median_e2el_ms']:.0f} |"
        )
    (out / "parallel.md").write_text("\n".join(lines) + "\n")
    print((out / "parallel.md").read_text())


if __name__ == "__main__":
    main()
