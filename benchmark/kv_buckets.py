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

from benchmark.decode import measure_ours, measure_transformers
from benchmark.machine import describe, machine_line

RESULTS = Path(__file__).parent / "results"
SEQUENCE_LENGTH, CHUNK = 2048, 256
CASES = [(8, 64), (8, 256), (8, 1024), (8, 2000), (1, 64), (1, 2000)]
"""(batch, live context) points: every slot holds a prompt of that many tokens, then decodes."""
QUICK_CASES = [(8, 64), (8, 2000)]


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
    batch, context, steps = spec["batch"], spec["context"], spec["steps"]
    if spec["task"] == "transformers":
        times = measure_transformers(spec["model_dir"], "fp32", batch, steps, context=context)
    else:
        times = measure_ours(spec["artifact"], batch, steps, context=context)
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
    parser.add_argument(
        "--decode-only", action="store_true", help="reuse the artifacts and export times of the last run (its JSON)"
    )
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
    exports = _recorded_exports(args.machine) if args.decode_only else {}
    rows: list[tuple[int, int, dict[str, float]]] = []
    with Progress() as progress:
        task = progress.add_task("kv buckets", total=2 * len(batches) + 3 * len(cases))
        for batch in batches if not args.decode_only else []:
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


def _recorded_exports(machine: str) -> dict[tuple[str, int], float]:
    """The export times of the last full run (``kv_buckets.json``)."""
    body = json.loads((RESULTS / machine / "kv_buckets.json").read_text())
    return {(e["buckets"], e["batch"]): e["seconds"] for e in body["exports"]}


def write_report(machine: str, exports: dict[tuple[str, int], float], rows: list, steps: int) -> None:
    """Markdown tables (and their JSON) under benchmark/results/<machine>/kv_buckets.{md,json}."""
    info = describe()
    body = {
        "exports": [{"buckets": k, "batch": b, "seconds": v} for (k, b), v in exports.items()],
        "decode": [{"batch": b, "context": c, **row} for b, c, row in rows],
        "machine": info,
    }
    (RESULTS / machine).mkdir(parents=True, exist_ok=True)
    (RESULTS / machine / "kv_buckets.json").write_text(json.dumps(body, indent=1))
    lines = [
        "# KV-length buckets: SmolLM2-135M-Instruct, fp32, inductor",
        "",
        f"Command: `.venv/bin/python -m benchmark.kv_buckets` (S={SEQUENCE_LENGTH}, C={CHUNK}; `auto` = windows "
        f"256, 512, 1024, 2048; median of {steps} decode steps after 3 warm-up, every slot at the given context; "
        "each point in a fresh process, the three of a point back to back).",
        "",
        "Machine: " + machine_line(info) + " (1-minute load when the run ended).",
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
