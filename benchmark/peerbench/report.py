"""The peers report: ``peers.md`` (table, ratios, floors, notes), ``peers.json`` (everything recorded) and
``peers.png``, rendered from the run's recorded JSON alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmark.peerbench.figures import (
    COLUMN_LABELS,
    COLUMNS,
    cell,
    floors,
    goal_ratio,
    goals,
    machine_limits,
    median,
    met,
    rows,
)
from benchmark.peerbench.figures import samples as cell_samples


def table(run: dict[str, Any]) -> list[str]:
    """The figures: one row per measurement, one column per system, ``median (min–max)`` over the rounds."""
    used = COLUMNS  # a system that did not run shows "—": the reader sees what is missing
    lines = [
        "| | " + " | ".join(COLUMN_LABELS[c] for c in used) + " | floor |",
        "|---|" + "---|" * (len(used) + 1),
    ]
    bounds = floors(run)
    for row in rows(run):
        cells = [cell(cell_samples(run, row.key, c)) for c in used]
        floor = bounds[row.key]["floor"]
        lines.append(f"| {row.label}, {row.unit} | " + " | ".join(cells) + f" | {floor:,.1f} |")
    return lines


def goal_lines(run: dict[str, Any]) -> list[str]:
    """Each goal's ratio of medians within the run, its bound and whether it is met."""
    lines = ["| goal | ratio | bound | |", "|---|---|---|---|"]
    for goal in goals(run):
        ratio, against = goal_ratio(run, goal)
        shown = "—" if ratio is None else f"{ratio:.2f}x" + (f" (vs {COLUMN_LABELS[against]})" if against else "")
        bound = f"{'<=' if goal.at_most else '>='} {goal.bound:.1f}x"
        lines.append(f"| {goal.label} | {shown} | {bound} | {met(goal, ratio)} |")
    return lines


def floor_lines(run: dict[str, Any]) -> list[str]:
    """What remains between each figure and its floor: weight bytes / read bandwidth and FLOPs / peak."""
    bounds, machine = floors(run), machine_limits(run)
    lines = [
        f"Weight bytes {machine['weight_bytes'] / 1e6:,.0f} MB (fp32, tied embeddings once); best read bandwidth in "
        f"this run {machine['read_bw'] / 1e9:.1f} GB/s (the better of a 2-thread fp32 `sum` over 512 MiB and a "
        f"2-thread GEMV over weight-sized matrices); peak {machine['peak_flops'] / 1e9:.0f} GFLOP/s (2-thread fp32 "
        "GEMM 2048^3). Each row's floor is the larger of bytes / bandwidth and FLOPs / peak; the batch workload's "
        "is a ceiling: its prompts' prefill FLOPs / peak + one batch decode floor per output token (its two "
        "columns: all decode steps' floor, all prefills' FLOPs / peak). x floor: figure / floor (throughput: floor "
        "/ figure), 1.00 = at the floor.",
        "",
        "Probes (start, end): "
        + "; ".join(
            f"sum {p['read_bw_sum'] / 1e9:.1f} GB/s, GEMV {p['read_bw_gemv'] / 1e9:.1f} GB/s, "
            f"GEMM {p['peak_flops'] / 1e9:.0f} GFLOP/s"
            for p in run["probes"]
        )
        + ".",
        "",
        "| | bytes / bandwidth | FLOPs / peak | " + " | ".join(f"{COLUMN_LABELS[c]} x floor" for c in COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for row in rows(run):
        bound = bounds[row.key]
        ratios = []
        for column in COLUMNS:
            value = median(cell_samples(run, row.key, column))
            ratios.append(
                "—"
                if value is None
                else f"{(value / bound['floor'] if row.lower_is_better else bound['floor'] / value):.2f}"
            )
        lines.append(
            f"| {row.label} | {bound['bytes_ms']:,.1f} ms | {bound['flops_ms']:,.1f} ms | " + " | ".join(ratios) + " |"
        )
    return lines


def header(run: dict[str, Any]) -> list[str]:
    """Command, machine, versions, settings and loads."""
    systems = ", ".join(run.get("systems", ["ours", "openvino", "llamacpp"]))
    lines = [
        "# Peers on this CPU: SmolLM2-135M-Instruct fp32, 2 threads, one HF folder",
        "",
        f"Command: `{run['command']}` ({run['rounds']} interleaved rounds of {systems}; every "
        f"measurement in a fresh process; {run['started']} to {run['finished']}).",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in run["machine"].items()),
        "",
        "Versions: " + "; ".join(f"{k}: {v}" for k, v in run["versions"].items()),
        "",
    ]
    if run.get("merged"):
        lines += [f"Merged run: {run['merged']}.", ""]
    loads = [m["load_before"] for m in run["log"]] + [m["load_after"] for m in run["log"]]
    if loads:
        lines.append(
            f"1-minute load average around the measurements: {min(loads):.2f}–{max(loads):.2f} (2 cores: above "
            "~2.5 another process shared them; rerun on a quiet machine)."
        )
    return lines


def render(run: dict[str, Any]) -> str:
    """The whole markdown report."""
    lines = header(run)
    lines += ["", "## Figures (median, range over rounds)", "", *table(run), "", *run["settings"]]
    lines += ["", "## Goals (ratios of medians, within this run)", "", *goal_lines(run)]
    lines += ["", "## Floors", "", *floor_lines(run)]
    errors = [f"- {m['system']} {m['measure']} round {m['round']}: {m['error']}" for m in run["log"] if m.get("error")]
    if errors:
        lines += ["", "## Failed measurements", "", *errors]
    lines += ["", "![peers](peers.png)", ""]
    return "\n".join(lines)


def plot(run: dict[str, Any], path: Path) -> None:
    """One panel per row: each system's median with its range as an error bar, the floor as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds, table_rows = floors(run), rows(run)
    fig, axes = plt.subplots(1, len(table_rows), figsize=(3.6 * len(table_rows), 4))
    for ax, row in zip(axes, table_rows, strict=True):
        names, mids, errs, colors = [], [], [[], []], []
        for column in COLUMNS:
            values = cell_samples(run, row.key, column)
            if values:
                mid = median(values) or 0.0
                names.append(COLUMN_LABELS[column].replace(" (", "\n(").replace("`", ""))
                mids.append(mid)
                errs[0].append(mid - min(values))
                errs[1].append(max(values) - mid)
                colors.append(f"C{COLUMNS.index(column)}")
        ax.bar(range(len(mids)), mids, yerr=errs, capsize=4, color=colors)
        ax.axhline(bounds[row.key]["floor"], linestyle="--", color="grey", label="floor")
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{row.label}\n{row.unit} ({'lower' if row.lower_is_better else 'higher'} is better)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(run: dict[str, Any], folder: Path) -> Path:
    """Write ``peers.json``, ``peers.md`` and ``peers.png`` into ``folder``; returns the markdown's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "peers.json").write_text(json.dumps(run, indent=1) + "\n")
    plot(run, folder / "peers.png")
    out = folder / "peers.md"
    out.write_text(render(run))
    return out
