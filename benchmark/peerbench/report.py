"""The peers report: ``peers.md`` (table, ratios, formats, floors, notes), ``peers.json`` (everything recorded) and
``peers.png``, rendered from the run's recorded JSON alone; ``peers-int8.*`` and ``peers-int4.*`` for those
``--weight-format`` runs (`stem`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmark.machine import machine_line
from benchmark.peerbench.figures import (
    COLUMNS,
    LLAMA,
    OPENVINO,
    OURS,
    Goal,
    cell,
    decode_bytes,
    floors,
    goal_ratio,
    goals,
    kv_bytes,
    labels,
    machine_limits,
    median,
    met,
    paired_ratios,
    round_compute,
    rows,
    weight_format,
    workload_positions,
)
from benchmark.peerbench.figures import samples as cell_samples


def table(run: dict[str, Any]) -> list[str]:
    """The figures: one row per measurement, one column per system, ``median (min–max)`` over the rounds."""
    used, names = COLUMNS, labels(run)  # a system that did not run shows "—": the reader sees what is missing
    lines = [
        "| | " + " | ".join(names[c] for c in used) + " | floor |",
        "|---|" + "---|" * (len(used) + 1),
    ]
    bounds = floors(run)
    for row in rows(run):
        cells = [cell(cell_samples(run, row.key, c)) for c in used]
        floor = bounds[row.key]["floor"]
        lines.append(f"| {row.label}, {row.unit} | " + " | ".join(cells) + f" | {floor:,.1f} |")
    return lines


def goal_lines(run: dict[str, Any]) -> list[str]:
    """Each goal's ratio of medians within the run, its bound and whether it is met (the verdict), then the same ratio
    taken within each round: median (min–max) over the rounds (`figures.paired_ratios`)."""
    header = "| goal | ratio | bound | | per round: median (min–max) |"
    lines, names = [header, "|---|---|---|---|---|"], labels(run)
    for goal in goals(run):
        ratio, against = goal_ratio(run, goal)
        shown = "—" if ratio is None else f"{ratio:.2f}x" + (f" (vs {names[against]})" if against else "")
        bound = f"{'<=' if goal.at_most else '>='} {goal.bound:.1f}x"
        lines.append(f"| {goal.label} | {shown} | {bound} | {met(goal, ratio)} | {per_round(run, goal, against)} |")
    return lines


def per_round(run: dict[str, Any], goal: Goal, column: str) -> str:
    """``median (min–max)`` of the goal's ratios within each round, ``—`` without a pair."""
    ratios = paired_ratios(run, goal, column) if column else []
    if not ratios:
        return "—"
    mid = f"{median(ratios):.2f}x"
    return mid if len(ratios) == 1 else f"{mid} ({min(ratios):.2f}–{max(ratios):.2f})"


def floor_lines(run: dict[str, Any]) -> list[str]:
    """What remains between each figure and its floor: weight bytes / read bandwidth and FLOPs / peak."""
    bounds, machine, names = floors(run), machine_limits(run), labels(run)
    quantized = weight_format(run) != "fp32"
    int_note = (
        " (fp32 FLOPs: ours dequantizes in registers and multiplies in fp32; llama.cpp's Q8_0 / Q4_0 dot products "
        "and OpenVINO's dynamically quantized activations (see Weight formats) multiply in int8, which this peak "
        "does not bound)"
        if quantized
        else ""
    )
    lines = [
        f"{bytes_counted(run)} Best read bandwidth in this run {machine['read_bw'] / 1e9:.1f} GB/s (the better of a "
        "2-thread fp32 `sum` over 512 MiB and a 2-thread GEMV over fp32 matrices as large as the fp32 model); peak "
        f"{machine['peak_flops'] / 1e9:.0f} GFLOP/s (2-thread fp32 GEMM 2048^3, the better of torch.mm and our "
        f"packed kernel){int_note}. Bandwidth floor of a "
        f"decode step's weights: {machine['weight_bytes'] / 1e6:,.1f} MB / {machine['read_bw'] / 1e9:.1f} GB/s = "
        f"{1000 * machine['weight_bytes'] / machine['read_bw']:.2f} ms (plus its KV cache, as counted above). Each "
        "row's floor is the larger of bytes / "
        "bandwidth and FLOPs / peak; the batch workload's "
        "is a ceiling: its prompts' prefill FLOPs / peak + one batch decode floor per output token (its two "
        "columns: all decode steps' floor, all prefills' FLOPs / peak). x floor: figure / floor (throughput: floor "
        "/ figure), 1.00 = at the floor.",
        "",
        "Probes (start, end): "
        + "; ".join(
            f"sum {p['read_bw_sum'] / 1e9:.1f} GB/s, GEMV {p['read_bw_gemv'] / 1e9:.1f} GB/s, "
            f"GEMM {p['peak_flops'] / 1e9:.0f} GFLOP/s"
            + "".join(f" ({name} {value / 1e9:.0f})" for name, value in p.get("gemm_flops", {}).items())
            for p in run["probes"]
        )
        + ".",
        "",
        "| | bytes / bandwidth | FLOPs / peak | " + " | ".join(f"{names[c]} x floor" for c in COLUMNS) + " |",
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
        f"# Peers on this CPU: SmolLM2-135M-Instruct {TITLES[weight_format(run)]}, 2 threads, one HF folder",
        "",
        f"Command: `{run['command']}` ({run['rounds']} interleaved rounds of {systems}; every "
        f"measurement in a fresh process; {run['started']} to {run['finished']}).",
        "",
        "Machine: " + machine_line(run["machine"]),
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
    compute = compute_line(run)
    if compute:
        lines += ["", compute]
    return lines


def compute_line(run: dict[str, Any]) -> str:
    """The machine's multiply-add rate before each measurement, per round (`figures.round_compute`); empty for a
    run recorded before it was measured."""
    rounds = round_compute(run)
    if not rounds:
        return ""
    each = ", ".join(f"{r.round}: {r.two / 1e9:.0f} GFLOP/s ({r.scaling:.2f}x)" for r in rounds)
    return (
        "Multiply-adds the machine gave before each measurement (our packed kernel on an in-cache 256 x 576 x 576 "
        "product, two threads, and in brackets two threads over one; the median of each round's measurements): "
        f"{each}. Near 2x: two cores' worth; near 1x: the two threads shared one core's vector units when the "
        "measurement began (a VM's vCPUs on one physical core); a low rate near 2x: the host slowed both. Either "
        "slows whichever system runs then: compare systems within a round (the goals' per-round column)."
    )


def bytes_counted(run: dict[str, Any]) -> str:
    """What the bandwidth floor's bytes are and how they were counted (`figures.decode_bytes`)."""
    total, source = decode_bytes(run)
    fmt = weight_format(run)
    if source == "config" and fmt == "fp32":
        return (
            f"Weight bytes {total / 1e6:,.0f} MB (fp32, tied embeddings once, from the model's config); "
            + kv_counted(run)
        )
    if source == "config":
        return (
            f"Bytes a decode step of ours reads: {total / 1e6:,.1f} MB, computed from the model's config under our "
            f"{fmt} scheme (our artifact was not exported in this run): the decoder layers' linear weights at "
            f"{'1 byte' if fmt == 'int8' else 'half a byte'} each plus their fp32 scales, every other weight fp32 "
            f"(tied embeddings once); {kv_counted(run)}"
        )
    counted = run["formats"][OURS]["decode_bytes"]
    types = ", ".join(f"{t} {b / 1e6:,.1f} MB" for t, b in run["formats"][OURS]["weights"].items())
    embedding = (
        f"the token embedding ({counted['embedding'] / 1e6:,.1f} MB fp32) stored once: the tied LM head reads it "
        "whole every step"
        if counted["tied"]
        else f"less the token embedding table ({counted['embedding'] / 1e6:,.1f} MB: the LM head is stored apart and "
        "the step gathers one row of the table)"
    )
    return (
        f"Bytes a decode step of ours reads: {total / 1e6:,.1f} MB, counted from our batch-1 artifact's "
        f"`model.safetensors` header: every stored tensor ({types}: the quantized linear weights, their scales, the "
        f"norms), {embedding}; {kv_counted(run)}"
    )


def kv_counted(run: dict[str, Any]) -> str:
    """How the floors count the KV cache a decode step reads (`figures.kv_bytes`)."""
    batch, positions = run["batch"], run.get("decode_positions", 0.0)
    if not kv_bytes(run, 1, 1):
        return "the KV cache and activations are not counted (this run predates their count)."
    work = workload_positions(run)
    return (
        f"each decode row adds the KV cache its steps read, fp32 keys and values of every layer at the mean context "
        f"(the decode rows: {positions:.0f} positions, {kv_bytes(run, 1, positions) / 1e6:,.1f} MB at batch 1, "
        f"{kv_bytes(run, batch, positions) / 1e6:,.1f} MB at batch {batch}; the batch workload's steps: {work:.0f} "
        f"positions, {kv_bytes(run, batch, work) / 1e6:,.1f} MB); activations are not counted."
    )


TITLES = {
    "fp32": "fp32",
    "int8": "int8 weights (llama.cpp Q8_0)",
    "int4": "int4 weights (groups of 64; llama.cpp Q4_0)",
}
"""The report's title, per ``--weight-format``."""


def format_lines(run: dict[str, Any]) -> list[str]:
    """Each system's weights exactly, its model file and the bytes of its weight tensors by stored type (read from
    the file in this run), and those bytes / the run's best read bandwidth."""
    recorded = run.get("formats")
    if not recorded:
        return ["Not recorded (a run from before `--weight-format`): fp32 weights everywhere."]
    bandwidth, names = machine_limits(run)["read_bw"], labels(run)
    lines = [
        "| | weights, exactly | model file | file MB | weight tensors, MB by stored type | weights / read bandwidth |",
        "|---|---|---|---|---|---|",
    ]
    for system, column in (("ours", OURS), ("openvino", OPENVINO), ("llamacpp", LLAMA)):
        entry = recorded.get(system)
        if entry is None:
            continue
        if "weights" not in entry:
            why = entry.get("error", "not read in this run")
            lines.append(f"| {names[column]} | {entry['format']} | — ({why}) | — | — | — |")
            continue
        total = entry["decode_bytes"]["decode"] if "decode_bytes" in entry else entry["weight_bytes"]
        types = ", ".join(f"{t} {b / 1e6:,.1f}" for t, b in entry["weights"].items() if b >= 1e5)
        file = "/".join(Path(entry["file"]).parts[-3 if system == "ours" else -2 :])  # ours: exports/<key>/...
        lines.append(
            f"| {names[column]} | {entry['format']} | `{file}` | {entry.get('file_bytes', 0) / 1e6:,.1f} | {types} "
            f"| {total / 1e6:,.1f} MB -> {1000 * total / bandwidth:.2f} ms |"
        )
    lines += [
        "",
        "Weights / read bandwidth: ours counts what a decode step reads (see Floors); the peers' count every weight "
        "tensor in their file once (a tied embedding is stored once and its LM head reads it whole); types under "
        "0.1 MB are left out.",
    ]
    plugin = recorded.get("openvino", {}).get("plugin")
    if plugin:
        lines += ["", openvino_plugin_line(plugin)]
    return lines


def openvino_plugin_line(plugin: dict[str, Any]) -> str:
    """What OpenVINO's CPU plugin did with the IR (the worker's ``plugin`` answer)."""
    settings = ", ".join(f"`{k}={v}`" for k, v in plugin.items() if isinstance(v, str))
    kernels = "; ".join(f"{n} x {k}" for k, n in plugin.get("kernels", {}).items())
    text = (
        f"OpenVINO's CPU plugin, the IR compiled with the pipelines' settings: {settings}. Its matrix products "
        f"(layer, kernel, weight precision): {kernels}; the kernel's name does not tell the activations' precision."
    )
    on, off = plugin.get("default"), plugin.get("dynamic_quantization_off")
    if on and off:
        text += (
            " `DYNAMIC_QUANTIZATION_GROUP_SIZE` is the group of the int8 quantization of activations the plugin "
            "applies inside layers with compressed weights (left at its default in every measurement); whether it is "
            "in effect, from a forward of the bare IR (logits at every position, no pipeline; best of 2): 256 tokens "
            f"{on['forward_256_ms']:.0f} ms with the default, {off['forward_256_ms']:.0f} ms with it off (0); a decode "
            f"step {on['decode_ms']:.1f} ms vs {off['decode_ms']:.1f} ms."
        )
    return text


def render(run: dict[str, Any]) -> str:
    """The whole markdown report."""
    lines = header(run)
    lines += ["", "## Figures (median, range over rounds)", "", *table(run), "", *run["settings"]]
    lines += ["", "## Goals (ratios of medians, within this run)", "", *goal_lines(run)]
    lines += ["", f"## Weight formats ({weight_format(run)})", "", *format_lines(run)]
    lines += ["", "## Floors", "", *floor_lines(run)]
    errors = [f"- {m['system']} {m['measure']} round {m['round']}: {m['error']}" for m in run["log"] if m.get("error")]
    if errors:
        lines += ["", "## Failed measurements", "", *errors]
    lines += ["", f"![peers]({stem(run)}.png)", ""]
    return "\n".join(lines)


def plot(run: dict[str, Any], path: Path) -> None:
    """One panel per row: each system's median with its range as an error bar, the floor as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds, table_rows = floors(run), rows(run)
    fig, axes = plt.subplots(1, len(table_rows), figsize=(3.6 * len(table_rows), 4))
    for ax, row in zip(axes, table_rows, strict=True):
        names, mids, colors = [], [], []
        errs: list[list[float]] = [[], []]
        for column in COLUMNS:
            values = cell_samples(run, row.key, column)
            if values:
                mid = median(values) or 0.0
                names.append(labels(run)[column].replace(" (", "\n(").replace("`", ""))
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


def stem(run_or_format: dict[str, Any] | str) -> str:
    """The report's file name without its suffix: ``peers`` for fp32, ``peers-int8``, ``peers-int4``."""
    fmt = run_or_format if isinstance(run_or_format, str) else weight_format(run_or_format)
    return "peers" if fmt == "fp32" else f"peers-{fmt}"


def write(run: dict[str, Any], folder: Path) -> Path:
    """Write `stem`'s ``.json``, ``.md`` and ``.png`` (``peers.*`` for fp32) into ``folder``; returns the markdown's
    path."""
    folder.mkdir(parents=True, exist_ok=True)
    name = stem(run)
    (folder / f"{name}.json").write_text(json.dumps(run, indent=1) + "\n")
    plot(run, folder / f"{name}.png")
    out = folder / f"{name}.md"
    out.write_text(render(run))
    return out


def rerender(recorded: Path) -> Path:
    """Rewrite the markdown beside ``recorded`` (a run's JSON) from that JSON with this code's `render`; the JSON and
    the plot stay as they are. Returns the markdown's path."""
    if not recorded.is_file():
        raise SystemExit(f"no recorded run at {recorded}: pass the .json a run wrote (benchmark/results/<machine>/)")
    run = recorded_run(recorded)
    out = recorded.with_suffix(".md")
    out.write_text(render(run))
    return out


RECORDED_KEYS = ("command", "rounds", "systems", "figures", "probes", "log", "settings")
"""Keys every run's JSON holds (`python -m benchmark.peers` writes them): what tells a recorded run from another
file."""


def recorded_run(path: Path) -> dict[str, Any]:
    """The run recorded at ``path``; `SystemExit` naming the fix when the file is not JSON or not a peers run's JSON
    (another benchmark's results, a truncated file)."""
    try:
        run = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        fix = "pass the .json that `python -m benchmark.peers` wrote"
        raise SystemExit(f"{path} is not JSON ({error}): {fix}") from None
    missing = [key for key in RECORDED_KEYS if not isinstance(run, dict) or key not in run]
    if missing:
        raise SystemExit(
            f"{path} is not a peers run (no {', '.join(missing)}): pass the .json that `python -m benchmark.peers` "
            "wrote, e.g. benchmark/results/<machine>/peers.json"
        )
    return run
