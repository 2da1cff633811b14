"""Chunked prefill vs context encoding for SmolLM2-135M at sequence length 4096:
export wall time and peak RSS, and time to first token for prompts of 256, 1024 and 4000 tokens.

    .venv/bin/python -m benchmark.prefill [--dtype bf16] [--chunk 256]

Exports run without the export cache, each in its own fresh process (peak RSS = that process's maximum).
TTFT is measured in a fresh process per artifact. Results: ``benchmark/results/<machine>/prefill.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmark.machine import check_device, describe, machine_line

RESULTS = Path(__file__).parent / "results"
PROMPTS = (256, 1024, 4000)


def _export_worker(spec: dict[str, Any]) -> None:
    from optimum.exporters.neuron.export import export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=1,
        sequence_length=spec["sequence_length"],
        prefill_chunk_size=spec["chunk"],
        auto_cast_type=spec["dtype"],
        device=spec["device"],
    )
    start = time.perf_counter()
    export(spec["model_dir"], spec["out"], config, use_cache=False)
    wall = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # largest compiler subprocess
    print(json.dumps({"wall_s": wall, "peak_rss_gb": own, "peak_child_rss_gb": child}))


def timed_export(spec: dict[str, Any]) -> dict[str, float]:
    """Export in a fresh process; its wall time and its own peak RSS."""
    cmd = [sys.executable, "-m", "benchmark.prefill", "--export-worker", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prefill_seconds(engine: Any, prompt: list[int]) -> float:
    """Wall time of one engine step that prefills ``prompt`` whole and samples its first token."""
    from optimum.neuron.runtime.sampling import SamplingParams

    engine.admit("prompt", prompt, SamplingParams(), reuse=False)  # every repeat prefills the whole prompt
    start = time.perf_counter()
    engine.step({"prompt": len(prompt)})
    elapsed = time.perf_counter() - start
    engine.release("prompt")
    return elapsed


def _ttft_worker(artifact: str, repeats: int) -> None:
    from optimum.neuron import NeuronModelForCausalLM

    engine = NeuronModelForCausalLM.from_pretrained(artifact).engine
    generator = torch.Generator().manual_seed(0)
    result = {}
    for length in PROMPTS:
        prompt = torch.randint(100, 40000, (length,), generator=generator).tolist()
        _prefill_seconds(engine, prompt)  # warm-up
        times = [_prefill_seconds(engine, prompt) for _ in range(repeats)]
        result[str(length)] = 1000 * statistics.median(times)
    print(json.dumps(result))


def ttft(artifact: str, repeats: int) -> dict[str, float]:
    """Median prefill time (ms) per prompt length, measured in a fresh process."""
    cmd = [sys.executable, "-m", "benchmark.prefill", "--ttft-worker", artifact, "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ttft-worker", help=argparse.SUPPRESS)
    parser.add_argument("--export-worker", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--machine", default="cpu-2core")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.export_worker:
        _export_worker(json.loads(args.export_worker))
        return
    if args.ttft_worker:
        _ttft_worker(args.ttft_worker, args.repeats)
        return
    from optimum.exporters.neuron.cache import cache_root
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    check_device(args.device)
    model_dir = str(convert_smollm2(default_smollm2_dir(args.dtype), dtype=args.dtype))
    rows: dict[str, dict[str, Any]] = {}
    for name, chunk in (("chunked", args.chunk), ("context encoding", 0)):
        out = str(cache_root() / "bench" / f"prefill-{name.replace(' ', '-')}-{args.dtype}-{args.device}")
        spec = {
            "model_dir": model_dir,
            "out": out,
            "sequence_length": args.sequence_length,
            "chunk": chunk,
            "dtype": args.dtype,
            "device": args.device,
        }
        rows[name] = {"export": timed_export(spec)}
        rows[name]["ttft"] = ttft(out, args.repeats)
    write_report(args, rows)


def write_report(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    """Markdown with both tables and the chunked/CE ratios."""
    chunked, ce = rows["chunked"], rows["context encoding"]
    lines = [
        f"# Chunked prefill (C={args.chunk}) vs context encoding, SmolLM2-135M {args.dtype}, S={args.sequence_length}",
        "",
        f"Command: `.venv/bin/python -m benchmark.prefill --dtype {args.dtype} --chunk {args.chunk} "
        f"--device {args.device}`",
        "",
        "Machine: " + machine_line(describe()),
        "",
        "| export | wall s | peak RSS GiB (export process) | peak RSS GiB (largest compile subprocess) |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        e = row["export"]
        lines.append(f"| {name} | {e['wall_s']:.1f} | {e['peak_rss_gb']:.2f} | {e['peak_child_rss_gb']:.2f} |")
    a, b = chunked["export"], ce["export"]
    lines.append(
        f"| chunked / CE | {a['wall_s'] / b['wall_s']:.2f} | {a['peak_rss_gb'] / b['peak_rss_gb']:.2f} | "
        f"{a['peak_child_rss_gb'] / max(b['peak_child_rss_gb'], 1e-9):.2f} |"
    )
    lines += ["", "| prompt tokens | chunked TTFT ms | CE TTFT ms | chunked / CE |", "|---|---|---|---|"]
    for length in PROMPTS:
        a, b = chunked["ttft"][str(length)], ce["ttft"][str(length)]
        lines.append(f"| {length} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
    lines += [
        "",
        "Each export runs without the export cache in its own fresh process: its peak RSS (ru_maxrss of that "
        "process) and the largest peak among the compiler subprocesses it waited for (RUSAGE_CHILDREN). "
        "TTFT = median time of the prefill call(s) that produce the first token's logits, in a fresh process "
        f"after one warm-up, {args.repeats} repeats.",
    ]
    out = RESULTS / args.machine / "prefill.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
