"""Linear-layer kernels per shape: torch's default linear (MKL), oneDNN's packed linear and the toolkit's packed
kernel (`optimum/neuron/kernels`), on every projection shape of SmolLM2-135M and its LM head, for M = 1, 8, 64 and
256 rows, fp32, the machine's threads.

    .venv/bin/python -m benchmark.kernels [--quick] [--threads 2]

Two regimes per shape: **streamed** (a ring of distinct weight copies larger than the last-level cache, one per
call, as a decode step reads 30 layers' weights once each: what the memory delivers) and **hot** (one weight called
again and again: what the arithmetic delivers). Each cell is the median of interleaved repetitions; every
implementation's output is checked against float64 first. Results: ``benchmark/results/<machine>/kernels.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmark.machine import describe, read_bandwidth

RESULTS = Path(__file__).parent / "results"
SHAPES = {"q_proj / o_proj": (576, 576), "k_proj / v_proj": (192, 576), "gate_proj / up_proj": (1536, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}  # fmt: skip
"""SmolLM2-135M's linear layers, ``(out_features, in_features)``."""
ROWS = (1, 8, 64, 256)
IMPLS = ("aten", "onednn", "packed")
RING_BYTES = 256 * 2**20
"""Streamed regime: distinct weight copies totalling at least this many bytes (several times a last-level cache)."""

Linear = Callable[[torch.Tensor, int], torch.Tensor]
"""``(x, copy index) -> x @ W_i^T``."""


def implementations(weight: torch.Tensor, copies: int) -> dict[str, Linear]:
    """Each implementation bound to ``copies`` distinct copies of ``weight`` in its own layout."""
    from optimum.neuron.kernels import packed

    packed.load()
    rows = weight.shape[0]
    plain = [weight.clone() for _ in range(copies)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in plain]
    ours = [packed.pack(w) for w in plain]
    return {
        "aten": lambda x, i: torch.nn.functional.linear(x, plain[i]),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "packed": lambda x, i: packed.packed_linear(x, ours[i], None, rows),
    }


def time_call(fn: Linear, x: torch.Tensor, copies: int, budget_s: float) -> float:
    """Median seconds of one call, cycling through the copies for ``budget_s`` seconds."""
    times, index, start = [], 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or len(times) < 5:
        begin = time.perf_counter()
        fn(x, index)
        times.append(time.perf_counter() - begin)
        index = (index + 1) % copies
    return statistics.median(times)


def measure_shape(out_features: int, in_features: int, rows: tuple[int, ...], budget_s: float) -> list[dict]:
    """Every implementation at every row count, streamed and hot, for one weight shape."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.02
    copies = max(2, -(-RING_BYTES // (weight.numel() * 4)))
    impls = implementations(weight, copies)
    results = []
    for m in rows:
        x = torch.randn(m, in_features)
        reference = torch.nn.functional.linear(x.double(), weight.double())
        for name, fn in impls.items():
            error = (fn(x, 0).double() - reference).abs().max().item()
            assert error < 1e-3, f"{name} is wrong at {out_features}x{in_features}, M={m}: {error}"
        for regime, ring in (("streamed", copies), ("hot", 1)):
            seconds = {name: time_call(fn, x, ring, budget_s) for name, fn in impls.items()}
            results.append({"m": m, "regime": regime, "seconds": seconds})
    return results


def peak_gflops(budget_s: float) -> float:
    """GFLOP/s of torch's fp32 GEMM at a large square shape: the machine's practical peak."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    seconds = time_call(lambda x, _: torch.mm(x, b), a, 1, budget_s)
    return 2 * 1024**3 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="M = 1 and 8 only, shorter timing")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, budget = ((1, 8), 0.2) if args.quick else (ROWS, 0.6)
    with torch.no_grad():
        floors = {"read_gbs": read_bandwidth() / 1e9, "peak_gflops": peak_gflops(budget)}
        table = {name: measure_shape(*shape, rows, budget) for name, shape in SHAPES.items()}
    isa = os.environ.get("OPTIMUM_NEURON_PACKED_ISA", "the best the CPU has: avx512 > avx2 > portable")
    body = {"machine": describe(), "threads": torch.get_num_threads(), "packed_isa": isa, "floors": floors}
    body["results"] = table
    out = RESULTS / args.machine / ("kernels-quick.json" if args.quick else "kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, indent=1))
    report = render(body)
    out.with_suffix(".md").write_text(report)
    print(report)


def render(body: dict) -> str:
    """The markdown report of a run: per shape, M and regime, each implementation's time, its bandwidth or
    arithmetic rate, and the fastest."""
    floors = body["floors"]
    lines = [
        "# Linear-layer kernels per shape (fp32)",
        "",
        "Command: `.venv/bin/python -m benchmark.kernels`. Machine: "
        + ", ".join(f"{k} {v}" for k, v in body["machine"].items())
        + f"; {body['threads']} threads; our kernel's path (OPTIMUM_NEURON_PACKED_ISA): {body.get('packed_isa')}.",
        f"Floors measured in the same run: read bandwidth {floors['read_gbs']:.1f} GB/s (fp32 sum over 512 MiB), "
        f"GEMM peak {floors['peak_gflops']:.0f} GFLOP/s (torch.mm 1024^3).",
        "",
        "| shape (out x in) | M | regime | aten ms | oneDNN packed ms | ours ms | ours GB/s | ours GFLOP/s | fastest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, shape in SHAPES.items():
        n, k = shape
        for row in body["results"][name]:
            s = row["seconds"]
            best = min(s, key=s.get)
            ours = s["packed"]
            lines.append(
                f"| {name} {n}x{k} | {row['m']} | {row['regime']} | {1e3 * s['aten']:.3f} | {1e3 * s['onednn']:.3f} | "
                f"{1e3 * ours:.3f} | {n * k * 4 / ours / 1e9:.1f} | {2 * row['m'] * n * k / ours / 1e9:.1f} | {best} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
