"""The figures of one run, the ratios the goals name (all within that run) and the floors, computed from the
recorded JSON alone (so a report can be re-rendered, and tested, without rerunning anything)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

OURS, VLLM, OPENVINO, LLAMA = "ours", "ours vllm.LLM", "openvino", "llamacpp"
COLUMNS = (OURS, VLLM, OPENVINO, LLAMA)
SYSTEM_OF = {OURS: "ours", VLLM: "ours", OPENVINO: "openvino", LLAMA: "llamacpp"}
"""The system (``--only``) that measures each column."""
COLUMN_LABELS = {
    OURS: "ours (engine / `generate()`)",
    VLLM: "ours (`vllm.LLM`)",
    OPENVINO: "OpenVINO GenAI",
    LLAMA: "llama.cpp F32",
}


def weight_format(run: dict[str, Any]) -> str:
    """The run's ``--weight-format`` (a run recorded before the option existed was fp32)."""
    return str(run.get("weight_format", "fp32"))


def labels(run: dict[str, Any]) -> dict[str, str]:
    """`COLUMN_LABELS` with llama.cpp's GGUF type of the run's format (F32, Q8_0, Q4_0)."""
    from benchmark.peerbench.layout import GGUF_TYPES

    return COLUMN_LABELS | {LLAMA: f"llama.cpp {GGUF_TYPES[weight_format(run)]}"}


@dataclass(frozen=True)
class Row:
    """One row of the table: a figure every column may have, and whether lower is better."""

    key: str
    label: str
    unit: str
    lower_is_better: bool = True


def rows(run: dict[str, Any]) -> list[Row]:
    """The table's rows for this run: decode at batch 1 and 8, one prefill row per prompt length, the workload."""
    prefills = [Row(f"prefill_{n}_ms", f"prefill {n:,} tokens", "ms") for n in run["prefill_lengths"]]
    return [
        Row("decode_b1_ms", "decode, batch 1", "ms/token"),
        Row("decode_b8_ms", f"decode, batch {run['batch']}", "ms/step"),
        *prefills,
        Row("workload_tok_s", "batch workload", "output tok/s", lower_is_better=False),
    ]


@dataclass(frozen=True)
class Goal:
    """A ratio the issue sets a bound on: ``numerator / denominator`` (each a row and a column, or the better of
    several columns) compared with ``bound``."""

    label: str
    row: str
    numerator: str
    denominators: tuple[str, ...]
    bound: float
    at_most: bool = True
    denominator_row: str | None = None


def goals(run: dict[str, Any]) -> list[Goal]:
    """The goals of issue 26 for this run's rows."""
    prefills = [
        Goal(f"prefill {n:,}: ours / OpenVINO", f"prefill_{n}_ms", OURS, (OPENVINO,), 1.0)
        for n in run["prefill_lengths"]
    ]
    batch = run["batch"]
    return [
        Goal("decode batch 1: ours / better peer", "decode_b1_ms", OURS, (OPENVINO, LLAMA), 1.0),
        Goal(f"decode batch {batch} step / our batch-1 step", "decode_b8_ms", OURS, (OURS,), 1.3, True, "decode_b1_ms"),
        *prefills,
        Goal("workload tok/s: vllm.LLM / OpenVINO CB", "workload_tok_s", VLLM, (OPENVINO,), 1.0, at_most=False),
        # a ratio of times: vllm.LLM's time / generate()'s = generate()'s tok/s / vllm.LLM's
        Goal("workload time: vllm.LLM / engine generate()", "workload_tok_s", OURS, (VLLM,), 1.1),
    ]


def samples(run: dict[str, Any], row: str, column: str) -> list[float]:
    """The per-round values of one cell (empty when that system has no such figure or it failed)."""
    return [float(v) for v in run["figures"].get(row, {}).get(column, []) if v is not None]


def median(values: list[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def cell(values: list[float]) -> str:
    """``median (min-max)`` of a cell's rounds, ``—`` when empty."""
    if not values:
        return "—"
    mid = statistics.median(values)
    text = _fmt(mid)
    return text if len(values) == 1 else f"{text} ({_fmt(min(values))}–{_fmt(max(values))})"


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def goal_ratio(run: dict[str, Any], goal: Goal) -> tuple[float | None, str]:
    """The goal's ratio of medians within the run, and which denominator column it used (the better one: the
    lower time, the higher throughput)."""
    top = median(samples(run, goal.row, goal.numerator))
    row = goal.denominator_row or goal.row
    bottoms = [(median(samples(run, row, c)), c) for c in goal.denominators]
    present = [(v, c) for v, c in bottoms if v is not None]
    if top is None or not present:
        return None, ""
    lower = next(r for r in rows(run) if r.key == row).lower_is_better
    value, column = min(present) if lower else max(present)
    return top / value, column


def paired_ratios(run: dict[str, Any], goal: Goal, column: str) -> list[float]:
    """The goal's ratio within each round: the numerator's value over ``column``'s (the denominator `goal_ratio`
    chose) in the same round, for the rounds where both were measured. A round's two measurements ran minutes apart at
    most, so a slow spell of the machine weighs on both; the ratio of medians can pair a fast round of one system
    with a slow round of the other."""
    when = run.get("measured") or {}  # a merged run: each system's own run (`peers.merge`)
    if when.get(SYSTEM_OF[goal.numerator]) != when.get(SYSTEM_OF[column]):
        return []  # measured in different runs: their rounds are not the same minutes
    tops = run["figures"].get(goal.row, {}).get(goal.numerator, [])
    bottoms = run["figures"].get(goal.denominator_row or goal.row, {}).get(column, [])
    return [float(t) / float(b) for t, b in zip(tops, bottoms, strict=False) if t is not None and b]


@dataclass(frozen=True)
class RoundCompute:
    """What the machine gave in one round, over its measurements (`probes.core_rates`, recorded before each one):
    the median two-thread rate (FLOP/s) and the median of the two-thread rate over the one-thread one."""

    round: int
    two: float
    scaling: float


def round_compute(run: dict[str, Any]) -> list[RoundCompute]:
    """`RoundCompute` of each round whose log records ``compute`` (none for a run recorded before it did), in order."""
    by_round: dict[int, list[dict[str, float]]] = {}
    for entry in run["log"]:
        if entry.get("compute"):
            by_round.setdefault(entry["round"], []).append(entry["compute"])
    return [
        RoundCompute(
            index, statistics.median(c["two"] for c in rates), statistics.median(c["two"] / c["one"] for c in rates)
        )
        for index, rates in sorted(by_round.items())
    ]


def met(goal: Goal, ratio: float | None) -> str:
    """``met`` / ``not met`` / ``n/a``."""
    if ratio is None:
        return "n/a"
    return "met" if (ratio <= goal.bound if goal.at_most else ratio >= goal.bound) else "not met"


KV_VALUE_BYTES = 4
"""Bytes of one cached key or value element in our artifacts of these runs (fp32 cache)."""


def kv_bytes(run: dict[str, Any], rows: int, positions: float) -> float:
    """The KV cache a decode step of ``rows`` sequences reads when each attends ``positions`` cache positions: keys
    and values of every layer, fp32; 0 for a run recorded before the probes' shape held the KV width."""
    shape = run["probes"][0]["shape"]
    return rows * positions * shape["layers"] * 2 * shape.get("kv_width", 0) * KV_VALUE_BYTES


def workload_positions(run: dict[str, Any]) -> float:
    """The mean cache positions a decode step of the batch workload attends: the mean prompt, then half the new
    tokens."""
    work = run["workload"]
    return sum(work["prompt_lengths"]) / len(work["prompt_lengths"]) + work["new_tokens"] / 2


def floors(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each row's floor from the run's best probe: ``bytes_ms`` = the bytes a step reads / read bandwidth (the
    weights; for a decode step also the KV cache it reads at the run's mean decode context, `kv_bytes`),
    ``flops_ms`` = FLOPs / peak, ``floor`` the larger (in the row's unit; the workload's is a ceiling in tok/s: its
    prompts' prefill FLOPs / peak + one batch decode floor per new token, at the workload's own contexts)."""
    from benchmark.peerbench.probes import decode_flops, prefill_flops

    best = machine_limits(run)
    shape, peak, bandwidth = run["probes"][0]["shape"], best["peak_flops"], best["read_bw"]
    positions = run.get("decode_positions", 0.0)

    def both(flops: float, kv: float = 0.0) -> dict[str, float]:
        flops_ms, bytes_ms = 1000 * flops / peak, 1000 * (best["weight_bytes"] + kv) / bandwidth
        return {"bytes_ms": bytes_ms, "flops_ms": flops_ms, "floor": max(bytes_ms, flops_ms)}

    batch = run["batch"]
    out = {
        "decode_b1_ms": both(decode_flops(shape, 1), kv_bytes(run, 1, positions)),
        "decode_b8_ms": both(decode_flops(shape, batch), kv_bytes(run, batch, positions)),
    }
    out |= {f"prefill_{n}_ms": both(prefill_flops(shape, n)) for n in run["prefill_lengths"]}
    work = run["workload"]
    prefill_ms = 1000 * sum(prefill_flops(shape, n) for n in work["prompt_lengths"]) / peak
    step = both(decode_flops(shape, batch), kv_bytes(run, batch, workload_positions(run)))
    decode_ms = work["new_tokens"] * step["floor"]
    tokens = work["new_tokens"] * len(work["prompt_lengths"])
    out["workload_tok_s"] = {
        "bytes_ms": decode_ms,
        "flops_ms": prefill_ms,
        "floor": 1000 * tokens / (prefill_ms + decode_ms),
    }
    return out


def decode_bytes(run: dict[str, Any]) -> tuple[int, str]:
    """The bytes of weights a decode step of ours reads, the numerator of the bandwidth floor, and where they were
    counted: ``artifact``, from our batch-1 artifact's ``model.safetensors`` (`formats.decode_bytes`) when the run
    recorded it; else ``config``, from the model's config (fp32: the probe's 4 bytes per parameter, tied embeddings
    once; int8 / int4: `formats.config_decode_bytes` with `formats.OURS_FORMATS`' LM head)."""
    from benchmark.peerbench.formats import OURS_FORMATS, config_decode_bytes

    ours = run.get("formats", {}).get(OURS, {}).get("decode_bytes")
    if ours:
        return int(ours["decode"]), "artifact"
    fmt, probe = weight_format(run), run["probes"][0]
    if fmt == "fp32":
        return int(probe["weight_bytes"]), "config"
    return config_decode_bytes(probe["shape"], fmt, OURS_FORMATS[fmt]["lm_head_format"]), "config"


def machine_limits(run: dict[str, Any]) -> dict[str, float]:
    """The best read bandwidth (B/s: a ``sum`` or a GEMV stream, whichever read faster) and fp32 peak (FLOP/s) the
    run's probes measured, and the weight bytes a decode step reads (`decode_bytes`)."""
    probes = run["probes"]
    return {
        "read_bw": max(max(p["read_bw_sum"], p["read_bw_gemv"]) for p in probes),
        "peak_flops": max(p["peak_flops"] for p in probes),
        "weight_bytes": decode_bytes(run)[0],
    }
