"""Decode latency benchmark: ms per token-generation step for SmolLM2-135M, ours vs transformers,
and each configuration's ratio to the memory-bandwidth floor: weight bytes / copy bandwidth (the issue's
definition) and weight bytes / read bandwidth (a multi-threaded read-only stream, the tighter floor).

    .venv/bin/python -m benchmark.decode [--quick]

Each measurement runs in a fresh process (a process that just compiled runs slower). Results go
to ``benchmark/results/<machine>/decode.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmark.fresh import answer, run_worker
from benchmark.machine import check_device, copy_bandwidth, describe, machine_line, read_bandwidth

RESULTS = Path(__file__).parent / "results"
SEQUENCE_LENGTH, CHUNK, CONTEXT = 1024, 256, 256


def _prompts(batch: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (length,), generator=generator).tolist() for _ in range(batch)]


def measure_ours(artifact: str, batch: int, steps: int, context: int = CONTEXT) -> list[float]:
    """Per-step decode times (s) of our engine with ``batch`` live slots after a ``context``-token prefill."""
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


def measure_transformers(
    model_dir: str, dtype: str, batch: int, steps: int, device: str = "cpu", context: int = CONTEXT
) -> list[float]:
    """Per-step times (s) of transformers eager decoding with its dynamic KV cache after a ``context``-token
    prompt, on ``device``."""
    from transformers import AutoModelForCausalLM

    from optimum.neuron.config import DTYPES

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval().to(device)
    ids = torch.tensor(_prompts(batch, context), device=device)
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps + 3):
            start = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            token.cpu()  # the step is over when its token is known (waits for a GPU)
            times.append(time.perf_counter() - start)
    return times[3:]


def _worker(spec: dict[str, Any]) -> None:
    if spec["impl"] == "transformers":
        times = measure_transformers(spec["model_dir"], spec["dtype"], spec["batch"], spec["steps"], spec["device"])
    else:
        times = measure_ours(spec["artifact"], spec["batch"], spec["steps"])
    answer({"median_ms": 1000 * statistics.median(times), "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))]})


def run_fresh(spec: dict[str, Any]) -> dict[str, float]:
    """Run one measurement in a fresh interpreter (`benchmark.fresh`)."""
    return {k: float(v) for k, v in run_worker("benchmark.decode", spec).items()}


def weight_bytes(model_dir: str, dtype: str) -> int:
    """Bytes of weights read by one decode step (tied embeddings counted once)."""
    from transformers import AutoConfig

    from optimum.neuron.models.registry import build_decoder

    with torch.device("meta"):
        decoder = build_decoder(AutoConfig.from_pretrained(model_dir), SEQUENCE_LENGTH, 1)
    size = {"fp32": 4, "bf16": 2}[dtype]
    return sum(p.numel() for p in decoder.parameters()) * size


def export_for(model_dir: Path, dtype: str, backend: str, batch: int, device: str = "cpu") -> str:
    """The benchmarked artifact (cached export)."""
    from optimum.exporters.neuron.cache import cache_root
    from optimum.exporters.neuron.export import export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=batch,
        sequence_length=SEQUENCE_LENGTH,
        prefill_chunk_size=CHUNK,
        auto_cast_type=dtype,
        backend=backend,
        device=device,
    )
    out = cache_root() / "bench" / f"smollm2-{dtype}-{backend}-{device}-b{batch}"
    return str(export(model_dir, out, config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fp32 only, batch 1, 8 steps")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both implementations run")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    check_device(args.device)
    dtypes, batches = (["fp32"], [1]) if args.quick else (["fp32", "bf16"], [1, 4])
    steps = 8 if args.quick else args.steps
    rows = []
    bandwidth = {"copy": copy_bandwidth(), "read": read_bandwidth()}  # host memory: the floors of a CPU run
    for dtype in dtypes:
        model_dir = convert_smollm2(default_smollm2_dir(dtype), dtype=dtype)
        floor_ms = {k: 1000 * weight_bytes(str(model_dir), dtype) / v for k, v in bandwidth.items()}
        for batch in batches:
            spec = {"model_dir": str(model_dir), "dtype": dtype, "batch": batch, "steps": steps, "device": args.device}
            ref = run_fresh({"impl": "transformers", **spec})
            rows.append((dtype, batch, "transformers eager", ref, floor_ms, ref["median_ms"]))
            for backend in ("eager", "inductor"):
                artifact = export_for(model_dir, dtype, backend, batch, args.device)
                got = run_fresh({"impl": "ours", "artifact": artifact, "batch": batch, "steps": steps})
                rows.append((dtype, batch, f"optimum-neuronx {backend}", got, floor_ms, ref["median_ms"]))
    write_report(args.machine, rows, bandwidth, steps, args.device)


def write_report(machine: str, rows: list, bandwidth: dict[str, float], steps: int, device: str = "cpu") -> None:
    """Markdown table of the results under benchmark/results/<machine>/decode.md."""
    info = describe()
    lines = [
        "# Decode step latency: SmolLM2-135M-Instruct",
        "",
        f"Command: `.venv/bin/python -m benchmark.decode --device {device}` ({steps} timed steps after 3 warm-up, "
        f"context {CONTEXT} tokens, S={SEQUENCE_LENGTH}, C={CHUNK}; each row in a fresh process).",
        "",
        "Machine: " + machine_line(info),
        f"Copy bandwidth: {bandwidth['copy'] / 1e9:.1f} GB/s copied (read + write = "
        f"{2 * bandwidth['copy'] / 1e9:.1f} GB/s); read bandwidth (fp32 sum, all threads): "
        f"{bandwidth['read'] / 1e9:.1f} GB/s. Floors = weight bytes / that bandwidth "
        "(every weight read once per step)"
        + ("; host-memory floors, they do not bound a GPU run." if device != "cpu" else "."),
        "",
        "| dtype | batch | implementation | median ms/step | p90 ms/step | x copy floor | x read floor "
        "| x transformers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype, batch, impl, got, floor_ms, ref_ms in rows:
        median = got["median_ms"]
        lines.append(
            f"| {dtype} | {batch} | {impl} | {median:.1f} | {got['p90_ms']:.1f} | {median / floor_ms['copy']:.2f} | "
            f"{median / floor_ms['read']:.2f} | {median / ref_ms:.2f} |"
        )
    out = RESULTS / machine / "decode.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
