"""KV-length buckets benchmark: decode ms/step of SmolLM2-135M at several live contexts, the artifact compiled with
``--kv_buckets auto`` (windows 256 .. S) vs ``none`` (every step attends over S), against transformers eager
(dynamic cache: it attends over exactly the live context) at the same contexts; and the export wall time of
both artifacts, each compiled from an empty inductor cache.

    .venv/bin/python -m benchmark.kv_buckets [--quick]

Every measurement runs in a fresh process, one at a time. Results go to
``benchmark/results/<machine>/kv_buckets.md``; run it on a quiet machine (the load is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmark.machine import describe

RESULTS = Path(__file__).parent / "results"
SEQUENCE_LENGTH, CHUNK = 2048, 256
CASES = [(8, 64), (8, 256), (8, 1024), (8, 2000), (1, 64), (1, 2000)]
"""(batch, live context) points: every slot holds a prompt of that many tokens, then decodes."""
QUICK_CASES = [(8, 64), (8, 2000)]


def _prompts(batch: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (length,), generator=generator).tolist() for _ in range(batch)]


def _ours(artifact: str, batch: int, context: int, steps: int) -> list[float]:
    from optimum.neuron import NeuronModelForCausalLM
    from optimum.neuron.runtime.sampling import SamplingParams

    engine = NeuronModelForCausalLM.from_pretrained(artifact).engine
    for row, prompt in enumerate(_prompts(batch, context)):
        engine.admit(row, prompt, SamplingParams())
        engine.step({row: context})
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        engine.step(dict.fromkeys(range(batch), 1))
        times.append(time.perf_counter() - start)
    return times[3:]


def _transformers(model_dir: str, batch: int, context: int, steps: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(_prompts(batch, context))
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps + 3):
            start = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
    return times[3:]


def _export(model_dir: str, buckets: str, batch: int, out: str) -> float:
    """Export one artifact without the export cache and from an empty inductor cache; its wall time (s)."""
    from optimum.exporters.neuron.export import export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=batch, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, kv_buckets=buckets
    )
    start = time.perf_counter()
    export(model_dir, out, config, use_cache=False)
    return time.perf_counter() - start


def _worker(spec: dict[str, Any]) -> None:
    if spec["task"] == "export":
        print(json.dumps({"seconds": _export(spec["model_dir"], spec["buckets"], spec["batch"], spec["out"])}))
        return
    measure = _transformers if spec["task"] == "transformers" else _ours
    source = spec["model_dir"] if spec["task"] == "transformers" else spec["artifact"]
    times = measure(source, spec["batch"], spec["context"], spec["steps"])
    print(json.dumps({"median_ms": 1000 * statistics.median(times)}))


def run_fresh(spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, float]:
    """One measurement in a fresh interpreter."""
    cmd = [sys.executable, "-m", "benchmark.kv_buckets", "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="batch 8 at contexts 64 and 2000, 8 steps")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    from rich.progress import Progress

    from optimum.exporters.neuron.cache import cache_root
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    cases, steps = (QUICK_CASES, 8) if args.quick else (CASES, args.steps)
    model_dir = str(convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32"))
    batches = sorted({batch for batch, _ in cases})
    exports: dict[tuple[str, int], float] = {}
    rows: list[tuple[int, int, dict[str, float]]] = []
    with Progress() as progress:
        task = progress.add_task("kv buckets", total=2 * len(batches) + 3 * len(cases))
        for batch in batches:
            for buckets in ("none", "auto"):
                progress.update(task, description=f"export batch {batch} kv_buckets={buckets}")
                with tempfile.TemporaryDirectory() as inductor:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor}
                    out = str(cache_root() / "bench" / f"kv-{buckets}-b{batch}")
                    spec = {"task": "export", "model_dir": model_dir, "buckets": buckets, "batch": batch, "out": out}
                    exports[(buckets, batch)] = run_fresh(spec, env)["seconds"]
                progress.advance(task)
        for batch, context in cases:
            row = {}
            for name in ("transformers", "none", "auto"):  # interleaved: the three of one point back to back
                progress.update(task, description=f"decode batch {batch} context {context}: {name}")
                spec = {"task": "transformers" if name == "transformers" else "ours", "model_dir": model_dir}
                spec |= {"artifact": str(cache_root() / "bench" / f"kv-{name}-b{batch}"), "batch": batch}
                row[name] = run_fresh({**spec, "context": context, "steps": steps})["median_ms"]
                progress.advance(task)
            rows.append((batch, context, row))
    write_report(args.machine, exports, rows, steps)


def write_report(machine: str, exports: dict[tuple[str, int], float], rows: list, steps: int) -> None:
    """Markdown tables under benchmark/results/<machine>/kv_buckets.md."""
    info = describe()
    lines = [
        "# KV-length buckets: SmolLM2-135M-Instruct, fp32, inductor",
        "",
        f"Command: `.venv/bin/python -m benchmark.kv_buckets` (S={SEQUENCE_LENGTH}, C={CHUNK}; `auto` = windows "
        f"256, 512, 1024, 2048; median of {steps} decode steps after 3 warm-up, every slot at the given context; "
        "each point in a fresh process, the three of a point back to back).",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + f"; load average {os.getloadavg()[0]:.2f}.",
        "",
        "| batch | context | transformers eager ms/step | `none` ms/step | `auto` ms/step | auto / none "
        "| auto / transformers |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, context, row in rows:
        lines.append(
            f"| {batch} | {context} | {row['transformers']:.1f} | {row['none']:.1f} | {row['auto']:.1f} | "
            f"{row['auto'] / row['none']:.2f} | {row['auto'] / row['transformers']:.2f} |"
        )
    lines += ["", "| batch | export `none` (s) | export `auto` (s) | auto / none |", "|---|---|---|---|"]
    for batch in sorted({b for _, b in exports}):
        none, auto = exports[("none", batch)], exports[("auto", batch)]
        lines.append(f"| {batch} | {none:.0f} | {auto:.0f} | {auto / none:.2f} |")
    out = RESULTS / machine / "kv_buckets.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
