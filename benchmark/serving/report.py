"""The serving benchmark's report: one markdown file of ratio tables, a JSON summary and three PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmark.serving.configs import CONFIGS

BASE = "ce-ods"
"""Every ratio of the main table is to standard context encoding with on-device sampling."""
LABELS = {c.name: c.label for c in CONFIGS}


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def main_table(results: dict[str, dict[str, Any]], floor_ms: float) -> list[str]:
    """One row per configuration and peer: throughput and its ratio to `BASE`, TTFT, ITL, E2E, floor ratio."""
    base = results[BASE]["output_throughput"] if BASE in results else float("nan")
    rows = [
        "| configuration | output tok/s | x CE+ODS | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | mean E2E s "
        "| ITL p50 / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {LABELS.get(name, name)} | not run: {r['error']} | | | | | |")
            continue
        ttft = " / ".join(_fmt(r[f"p{q}_ttft_ms"], 0) for q in (50, 90, 99))
        itl = f"{_fmt(r['p50_itl_ms'])} / {_fmt(r['p99_itl_ms'])}"
        rows.append(
            f"| {LABELS.get(name, name)} | {_fmt(r['output_throughput'])} | {_fmt(r['output_throughput'] / base, 2)} | "
            f"{ttft} | {itl} | {_fmt(r['mean_e2el_ms'] / 1000, 2)} | {_fmt(r['p50_itl_ms'] / floor_ms, 1)} |"
        )
    return rows


def mixed_table(mixed: dict[str, dict[str, Any]]) -> list[str]:
    """Per mixed configuration: the chats' ITL idle vs during long-prompt arrivals, and TTFTs under the mix."""
    rows = [
        "| configuration | chat ITL p50 idle ms | chat ITL p99 idle ms | chat ITL p99 with arrivals ms | x idle | "
        "chat TTFT p90 ms | long-prompt TTFT p90 ms | all TTFT p90 ms | a long prompt every s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in mixed.items():
        idle, chats, longs = m["idle"], m["chats"], m["arrivals"]
        all_ttft = percentile_ms(chats["ttfts"] + longs["ttfts"], 90)
        rows.append(
            f"| {LABELS[name]} | {_fmt(idle['p50_itl_ms'])} | {_fmt(idle['p99_itl_ms'])} | "
            f"{_fmt(chats['p99_itl_ms'])} | "
            f"{_fmt(chats['p99_itl_ms'] / idle['p99_itl_ms'], 2)} | {_fmt(chats['p90_ttft_ms'], 0)} | "
            f"{_fmt(longs['p90_ttft_ms'], 0)} | {_fmt(all_ttft, 0)} | {_fmt(m['interval']['arrival_interval_s'])} |"
        )
    return rows


def percentile_ms(seconds: list[float], q: float) -> float:
    from benchmark.serving.peers import percentile

    return 1000 * percentile(seconds, q) if seconds else float("nan")


def plot_throughput(results: dict[str, dict[str, Any]], path: Path) -> None:
    names = [n for n, r in results.items() if "error" not in r]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 1.2))
    ax.barh([LABELS.get(n, n) for n in names], [results[n]["output_throughput"] for n in names], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title("Throughput at the main workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(results: dict[str, dict[str, Any]], path: Path) -> None:
    names = [n for n, r in results.items() if "ttfts" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.6 * len(names) + 1.8))
    labels = [LABELS.get(n, n) for n in names]
    left.boxplot([[1000 * t for t in results[n]["ttfts"]] for n in names], vert=False, tick_labels=labels)
    left.set_xlabel("TTFT ms")
    itls = [[1000 * t for req in results[n]["itls"] for t in req] for n in names]
    right.boxplot(itls, vert=False, tick_labels=[""] * len(names))
    right.set_xlabel("ITL ms")
    right.set_xscale("log")
    left.invert_yaxis()
    right.invert_yaxis()
    fig.suptitle("Per-request TTFT and per-token ITL distributions (main workload)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def token_times(result: dict[str, Any], origin: float) -> tuple[list[float], list[float]]:
    """(time since ``origin`` s, ITL ms) of every token after the first, over all requests of ``result``."""
    xs, ys = [], []
    for start, ttft, itls in zip(result["start_times"], result["ttfts"], result["itls"], strict=True):
        t = start + ttft
        for gap in itls:
            t += gap
            xs.append(t - origin)
            ys.append(1000 * gap)
    return xs, ys


def plot_mixed(mixed: dict[str, dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(len(mixed), 1, figsize=(10, 3.2 * len(mixed)), sharex=True, squeeze=False)
    for ax, (name, m) in zip(axes[:, 0], mixed.items(), strict=True):
        chats, longs = m["chats"], m["arrivals"]
        origin = min(chats["start_times"])
        for start, ttft in zip(longs["start_times"], longs["ttfts"], strict=True):
            ax.axvspan(start - origin, start + ttft - origin, color="tab:orange", alpha=0.25)
        ax.scatter(*token_times(chats, origin), s=6, color="tab:blue")
        ax.axhline(m["idle"]["p99_itl_ms"], color="gray", linestyle="--", linewidth=1, label="idle ITL p99")
        ax.set_yscale("log")
        ax.set_ylabel("chat ITL ms")
        ax.set_title(f"{LABELS[name]}: orange = a long prompt waiting for its first token")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the chats started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SUMMARY_KEYS = (
    "output_throughput",
    "duration",
    "completed",
    "total_output_tokens",
    "mean_e2el_ms",
    "arrival_interval_s",
)


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """A result without its per-request lists: the numbers the tables read."""
    return {k: v for k, v in result.items() if k in SUMMARY_KEYS or k.endswith("_ms") or k == "error"}


def write_report(
    folder: Path,
    header: list[str],
    results: dict[str, dict[str, Any]],
    mixed: dict[str, dict[str, Any]],
    floor_ms: float,
) -> Path:
    """Write ``serving.md``, ``serving.json`` and the plots into ``folder``; the markdown's path."""
    folder.mkdir(parents=True, exist_ok=True)
    plot_throughput(results, folder / "throughput.png")
    plot_latency(results, folder / "latency.png")
    if mixed:
        plot_mixed(mixed, folder / "mixed-itl.png")
    lines = [
        *header,
        "",
        "## Main workload",
        "",
        *main_table(results, floor_ms),
        "",
        "![throughput](throughput.png)",
        "",
    ]
    lines += ["![latency](latency.png)", ""]
    if mixed:
        lines += ["## Mixed workload: short chats decoding while long prompts arrive", "", *mixed_table(mixed), ""]
        lines += ["![mixed workload ITL](mixed-itl.png)", ""]
    (folder / "serving.md").write_text("\n".join(lines))
    summary = {
        "floor_ms": floor_ms,
        "main": {n: compact(r) for n, r in results.items()},
        "mixed": {n: {part: compact(r) for part, r in m.items()} for n, m in mixed.items()},
    }
    (folder / "serving.json").write_text(json.dumps(summary, indent=1))
    return folder / "serving.md"
