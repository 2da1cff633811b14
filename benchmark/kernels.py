"""Linear-layer kernels per shape: torch's default linear (MKL), oneDNN's packed linear and the toolkit's packed
kernel (`optimum/neuron/kernels`), on every projection shape of SmolLM2-135M and its LM head, for M = 1, 8, 64 and
256 rows, fp32, the machine's threads; and weight-only int8 (per output channel) and int4 (groups of 64 along K) on
the projection shapes: the toolkit's ``packed_qlinear`` against torch's ``_weight_int8pack_mm`` and
``_weight_int4pack_mm_for_cpu``.

    .venv/bin/python -m benchmark.kernels [--quick] [--threads 2] [--formats fp32,int8,int4]

Two regimes per shape: **streamed** (a ring of distinct weight copies larger than the last-level cache, one per
call, as a decode step reads 30 layers' weights once each: what the memory delivers) and **hot** (one weight called
again and again: what the arithmetic delivers). Each cell is the median of interleaved repetitions; every
implementation's output is checked against float64 first (the quantized ones against the float64 product with the
dequantized weight). Results: ``benchmark/results/<machine>/kernels.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmark.machine import describe, machine_line, read_bandwidth, save_results

RESULTS = Path(__file__).parent / "results"
SHAPES = {"q_proj / o_proj": (576, 576), "k_proj / v_proj": (192, 576), "gate_proj / up_proj": (1536, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}  # fmt: skip
"""SmolLM2-135M's linear layers, ``(out_features, in_features)``."""
FP32_ONLY = {"lm_head"}
"""Shapes measured in fp32 only (the LM head stays fp32 in the quantized decoders)."""
ROWS = (1, 8, 64, 256)
FORMATS = ("fp32", "int8", "int4")
IMPLS = {"fp32": ("aten", "onednn", "packed"), "int8": ("aten_int8", "packed_int8"),
         "int4": ("aten_int4", "packed_int4")}  # fmt: skip
"""Each weight format's implementations, as named in the results."""
INT4_GROUP = 64
"""int4's group size along K (one fp32 scale per output column and group)."""
RING_BYTES = 256 * 2**20
"""Streamed regime: distinct weight copies totalling at least this many bytes (several times a last-level cache)."""

Linear = Callable[[torch.Tensor, int], torch.Tensor]
"""``(x, copy index) -> x @ W_i^T``."""


def weight_bytes(fmt: str, out_features: int, in_features: int) -> int:
    """Bytes of one weight in ``fmt``, scales included (what a call that streams it reads)."""
    values = out_features * in_features
    if fmt == "int8":
        return values + 4 * out_features
    if fmt == "int4":
        return values // 2 + 4 * out_features * (in_features // INT4_GROUP)
    return 4 * values


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric weight-only quantization: ``q [N, K]`` int8 (in [-127, 127] for int8, [-7, 7] for int4) and fp32
    scales ``[N, groups]`` (one group for int8, ``K / 64`` for int4), ``W ~ q * scales`` per group."""
    levels, group = (127, weight.shape[1]) if fmt == "int8" else (7, INT4_GROUP)
    grouped = weight.view(weight.shape[0], -1, group)
    scales = (grouped.abs().amax(dim=-1) / levels).clamp_min(1e-8)
    q = torch.round(grouped / scales[..., None]).clamp(-levels, levels).to(torch.int8)
    return q.view_as(weight), scales


def dequantized(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float64 weight that ``(q, scales)`` stands for."""
    return q.double() * scales.double().repeat_interleave(q.shape[1] // scales.shape[1], dim=1)


def implementations(weight: torch.Tensor, copies: int, fmt: str = "fp32") -> tuple[dict[str, Linear], torch.Tensor]:
    """Each implementation of ``fmt`` bound to ``copies`` distinct copies of ``weight`` in its own layout, and the
    float64 weight they compute with (``weight`` itself for fp32, its dequantized twin otherwise)."""
    from optimum.neuron.kernels import library, packed

    library.load()
    rows = weight.shape[0]
    if fmt == "fp32":
        plain = [weight.clone() for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in plain]
        ours = [packed.pack(w) for w in plain]
        return {
            "aten": lambda x, i: torch.nn.functional.linear(x, plain[i]),
            "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
            "packed": lambda x, i: packed.packed_linear(x, ours[i], None, rows),
        }, weight.double()
    q, scales = quantize(weight, fmt)
    table = packed.pack_int8(q) if fmt == "int8" else packed.pack_int4(q)
    ours_q = [(table.clone(), packed.pack_scales(scales)) for _ in range(copies)]
    if fmt == "int8":
        plain_q = [(q.clone(), scales[:, 0].contiguous()) for _ in range(copies)]
        return {
            "aten_int8": lambda x, i: torch.ops.aten._weight_int8pack_mm(x, *plain_q[i]),
            "packed_int8": lambda x, i: packed.packed_qlinear(x, *ours_q[i], None, rows),
        }, dequantized(q, scales)
    # torch's int4 layout: int32 [N, K] holding q + 8 in 0..15, qScaleAndZeros [K / G, N, 2] with W = (q' - 8) * scale
    # + zero (zero = 0: symmetric).
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 2)
    scale_zeros = torch.stack((scales.t(), torch.zeros_like(scales.t())), dim=-1).contiguous()
    plain_4 = [(int4.clone(), scale_zeros.clone()) for _ in range(copies)]
    return {
        "aten_int4": lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, plain_4[i][0], INT4_GROUP, plain_4[i][1]
        ),
        "packed_int4": lambda x, i: packed.packed_qlinear(x, *ours_q[i], None, rows),
    }, dequantized(q, scales)


def time_call(fn: Linear, x: torch.Tensor, copies: int, budget_s: float) -> float:
    """Median seconds of one call, cycling through the copies for ``budget_s`` seconds."""
    times: list[float] = []
    index, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or len(times) < 5:
        begin = time.perf_counter()
        fn(x, index)
        times.append(time.perf_counter() - begin)
        index = (index + 1) % copies
    return statistics.median(times)


def measure_shape(
    out_features: int, in_features: int, rows: tuple[int, ...], budget_s: float, formats: tuple[str, ...] = ("fp32",)
) -> list[dict]:
    """Every implementation of every format at every row count, streamed and hot, for one weight shape."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.02
    xs = {m: torch.randn(m, in_features) for m in rows}
    cells: dict[tuple[int, str], dict[str, float]] = {(m, regime): {} for m in rows for regime in ("streamed", "hot")}
    for fmt in formats:
        copies = max(2, -(-RING_BYTES // weight_bytes(fmt, out_features, in_features)))
        impls, reference_weight = implementations(weight, copies, fmt)
        for m, x in xs.items():
            reference = torch.nn.functional.linear(x.double(), reference_weight)
            for name, fn in impls.items():
                error = (fn(x, 0).double() - reference).abs().max().item()
                assert error < 1e-3, f"{name} is wrong at {out_features}x{in_features}, M={m}: {error}"
            for regime, ring in (("streamed", copies), ("hot", 1)):
                cells[(m, regime)].update({name: time_call(fn, x, ring, budget_s) for name, fn in impls.items()})
        del impls
    return [{"m": m, "regime": regime, "seconds": seconds} for (m, regime), seconds in cells.items()]


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
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help=f"weight formats to measure, comma-separated (default: {FORMATS})"
    )
    args = parser.parse_args()
    formats = tuple(f for f in FORMATS if f in args.formats.split(","))
    unknown = set(args.formats.split(",")) - set(FORMATS)
    if unknown or not formats:
        parser.error(f"--formats takes some of {', '.join(FORMATS)}; got {args.formats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, budget = ((1, 8), 0.2) if args.quick else (ROWS, 0.6)
    with torch.no_grad():
        floors = {"read_gbs": read_bandwidth() / 1e9, "peak_gflops": peak_gflops(budget)}
        table = {
            name: measure_shape(*shape, rows, budget, ("fp32",) if name in FP32_ONLY else formats)
            for name, shape in SHAPES.items()
        }
    isa = os.environ.get("OPTIMUM_NEURON_PACKED_ISA", "the best the CPU has: avx512 > avx2 > portable")
    body = {"machine": describe(), "threads": torch.get_num_threads(), "packed_isa": isa, "floors": floors}
    body["formats"] = list(formats)
    body["results"] = table
    save_results(RESULTS / args.machine / ("kernels-quick.json" if args.quick else "kernels.json"), body, render(body))


_COLUMNS = {
    "fp32": ["aten ms", "oneDNN packed ms", "ours ms", "ours GB/s", "ours GFLOP/s"],
    "int8": ["aten int8 ms", "ours int8 ms", "ours int8 GB/s"],
    "int4": [f"aten int4 (G={INT4_GROUP}) ms", "ours int4 ms", "ours int4 GB/s"],
}


def _cells(fmt: str, seconds: dict[str, float], n: int, k: int, m: int) -> list[str]:
    """One format's cells of a row: each implementation's ms, then ours' bandwidth (its format's bytes, scales
    included) and, for fp32, its arithmetic rate; dashes where the format was not measured."""
    names = IMPLS[fmt]
    if not all(name in seconds for name in names):
        return ["-"] * len(_COLUMNS[fmt])
    ms = [f"{1e3 * seconds[name]:.3f}" for name in names]
    ours = seconds[names[-1]]
    rates = [f"{weight_bytes(fmt, n, k) / ours / 1e9:.1f}"]
    if fmt == "fp32":
        rates.append(f"{2 * m * n * k / ours / 1e9:.1f}")
    return ms + rates


def render(body: dict) -> str:
    """The markdown report of a run: per shape, M and regime, each implementation's time, ours' bandwidth per format
    (and arithmetic rate in fp32), and the fastest of all. A run saved before the quantized formats (no
    ``formats``) renders as it did."""
    floors = body["floors"]
    formats = body.get("formats", ["fp32"])
    header = [col for fmt in formats for col in _COLUMNS[fmt]]
    quantized = [f for f in formats if f != "fp32"]
    title = "fp32" + "".join(f", {f} weight-only" for f in quantized)
    lines = [
        f"# Linear-layer kernels per shape ({title})",
        "",
        "Command: `.venv/bin/python -m benchmark.kernels"
        + ("" if formats == ["fp32"] or formats == list(FORMATS) else f" --formats {','.join(formats)}")
        + "`. Machine: "
        + machine_line(body["machine"])
        + f"; {body['threads']} threads; our kernel's path (OPTIMUM_NEURON_PACKED_ISA): {body.get('packed_isa')}.",
        f"Floors measured in the same run: read bandwidth {floors['read_gbs']:.1f} GB/s (fp32 sum over 512 MiB), "
        f"GEMM peak {floors['peak_gflops']:.0f} GFLOP/s (torch.mm 1024^3).",
    ]
    if quantized:
        lines.append(
            "Weight-only formats: int8 per output channel, int4 in groups of "
            f"{INT4_GROUP} along K, fp32 scales; GB/s counts each format's bytes (scales included). "
            f"{', '.join(sorted(FP32_ONLY))}: fp32 only."
        )
    lines += [
        "",
        "| shape (out x in) | M | regime | " + " | ".join(header) + " | fastest |",
        "|---|---|---|" + "---|" * len(header) + "---|",
    ]
    for name, shape in SHAPES.items():
        n, k = shape
        for row in body["results"][name]:
            s = row["seconds"]
            best = min(s, key=s.get)
            cells = [cell for fmt in formats for cell in _cells(fmt, s, n, k, row["m"])]
            lines.append(f"| {name} {n}x{k} | {row['m']} | {row['regime']} | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
