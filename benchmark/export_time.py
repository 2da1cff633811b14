"""Export wall time and peak memory, SmolLM2-135M fp32, batch 8, S=2048, chunk 256 (issue 29's benchmark):

- **cold, before**: an empty cache, the exporter of commit 79f02be, the last before issue 29 (no per-graph cache,
  every graph compiled in the exporting process; the minimal artifact was its default, the default one its
  ``--decode_logits``), run from a git worktree of that commit kept under the cache root with its own packed-kernel
  build (``python -m optimum.exporters.neuron``: a second checkout's ``optimum-cli`` clashes with this one's plugin);
- **cold, one process**: an empty cache, every graph compiled in the exporting process one after another (what the
  exporter did before the per-graph cache: ``OPTIMUM_NEURON_COMPILE_WORKERS=1``);
- **cold, parallel**: an empty cache, the graphs compiled by as many processes as cores and memory allow;
- **re-export**: then, in the same cache, only ``--prefill_chunk_size`` changed, to 128 and to 512 (with
  ``kv_buckets=auto`` the smallest KV window follows a chunk over 256): every graph is taken from the per-graph cache
  (a symbolic chunk or window spans every size up to the sequence length, `graphs.compiled_form`); and
  ``--prompt_logprobs`` added, one graph more to compile (the prefill graph returning every row's logits).

Each for the minimal artifact (``--no_decode_logits``: 2 graphs) and the default one (3 graphs).

    .venv/bin/python -m benchmark.export_time [--machine epyc-2core] [--rounds 2]

Every export runs in a fresh process (``optimum-cli export neuron``) with its own empty cache, the packed kernel's
one-time build shared; its peak memory is the largest sum of the RSS of its process tree (the exporter and its
compile workers, compiler subprocesses included), sampled every 50 ms. The two cold exports run ``--rounds`` times,
alternating, each into a fresh cache; the report gives each cell's median (the ratio of the medians) and the JSON
every round. Results:
``benchmark/results/<machine>/export.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

from benchmark.machine import describe, machine_line

RESULTS = Path(__file__).parent / "results"
SHAPE = ("--batch_size", "8", "--sequence_length", "2048")
VARIANTS = {"minimal (--no_decode_logits)": ("--no_decode_logits",), "default": ()}
"""Artifact kinds measured, by their extra flags."""
BEFORE = "79f02be"
"""The commit before issue 29: the exporter the cold export's goal (0.7x) is measured against."""
BEFORE_FLAGS = {"minimal (--no_decode_logits)": (), "default": ("--decode_logits",)}
"""The same artifact kinds in ``BEFORE``'s flags (its default had no logits-returning token-generation graph)."""


def timed(command: list[str], env: dict[str, str], cwd: Path | None = None) -> dict[str, float]:
    """Run ``command`` (in ``cwd``); its wall seconds and the peak summed RSS (GiB) of its process tree."""
    start = time.perf_counter()
    process = psutil.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, _tree_rss(process))
        time.sleep(0.05)
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{process.stderr.read()[-3000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_gib": round(peak / 2**30, 2)}


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    for member in (process, *process.children(recursive=True)):
        with contextlib.suppress(psutil.Error):  # exited between the listing and the read
            total += member.memory_info().rss
    return total


def export_command(model_dir: Path, out: Path, chunk: int, flags: tuple[str, ...]) -> list[str]:
    """``optimum-cli export neuron`` of the benchmark's shape."""
    cli = str(Path(sys.executable).with_name("optimum-cli"))
    chunking = ("--prefill_chunk_size", str(chunk))
    return [cli, "export", "neuron", "--model", str(model_dir), *SHAPE, *chunking, *flags, str(out)]


def before_command(model_dir: Path, out: Path, flags: tuple[str, ...]) -> list[str]:
    """``BEFORE``'s exporter, cold, of the benchmark's shape (run in its worktree, `before_env`)."""
    exporter = (sys.executable, "-m", "optimum.exporters.neuron")
    return [*exporter, "--model", str(model_dir), *SHAPE, "--prefill_chunk_size", "256", *flags, str(out)]


def before_checkout(root: Path) -> tuple[Path, Path]:
    """A git worktree of ``BEFORE`` and the folder of its packed kernel's build, both under ``root`` and kept
    between runs (the kernel's build records its source paths: a new worktree would rebuild it inside a timed
    export); the kernel is built here, untimed."""
    tree, kernels = root / f"export-time-{BEFORE}", root / f"export-time-{BEFORE}-kernels"
    if not (tree / ".git").exists():
        repo = Path(__file__).resolve().parents[1]
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), BEFORE], check=True)
    kernels.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        load = "from optimum.neuron.kernels import packed; packed.load()"
        subprocess.run([sys.executable, "-c", load], env=before_env(tree, Path(scratch), kernels), cwd=tree, check=True)
    return tree, kernels


def before_env(tree: Path, cache: Path, kernels: Path) -> dict[str, str]:
    """`cache_env` for ``BEFORE``'s code in ``tree``."""
    return {**cache_env(cache, kernels, None), "PYTHONPATH": str(tree)}


def cache_env(cache: Path, kernels: Path, workers: str | None) -> dict[str, str]:
    """The environment of an export into the empty cache ``cache`` (its packed-kernel build linked to ``kernels``)."""
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels").exists():
        (cache / "kernels").symlink_to(kernels)
    env = {**os.environ, "OPTIMUM_NEURON_CACHE": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    env.pop(_WORKERS, None)
    if workers is not None:
        env[_WORKERS] = workers
    return env


_WORKERS = "OPTIMUM_NEURON_COMPILE_WORKERS"
REEXPORTS = {"chunk 128": (128, ()), "chunk 512": (512, ()), "+ prompt logprobs": (256, ("--prompt_logprobs",))}
"""Re-exports into the cache of the cold parallel export, by name: their chunk and extra flags."""


def measure(
    model_dir: Path, kernels: Path, scratch: Path, variant: str, rounds: int, before: tuple[Path, Path]
) -> dict[str, Any]:
    """The exports of one artifact kind (the cold ones ``rounds`` times, alternating), and its size; ``before``:
    `before_checkout`."""
    console = Console(stderr=True)
    flags = VARIANTS[variant]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in (BEFORE_CELL, *COLD)}
    for round_ in range(rounds):
        cache = scratch / f"before-{round_}"
        console.print(f"[bold]{BEFORE_CELL}[/bold] {' '.join(BEFORE_FLAGS[variant])} (round {round_ + 1} of {rounds})")
        command = before_command(model_dir, cache / "out", BEFORE_FLAGS[variant])
        runs[BEFORE_CELL].append(timed(command, before_env(before[0], cache, before[1]), cwd=before[0]))
        for name, workers in COLD.items():
            cache = scratch / f"{_slug(name)}-{round_}"
            console.print(f"[bold]{name}[/bold] {' '.join(flags)} (round {round_ + 1} of {rounds})")
            runs[name].append(
                timed(export_command(model_dir, cache / "out", 256, flags), cache_env(cache, kernels, workers))
            )
    row: dict[str, Any] = {name: median_run(measured) for name, measured in runs.items()}
    cache = scratch / f"{_slug('cold, parallel')}-{rounds - 1}"
    for name, (chunk, more) in REEXPORTS.items():
        console.print(f"[bold]re-export, {name}[/bold] {' '.join(flags)}")
        command = export_command(model_dir, cache / _slug(name), chunk, (*flags, *more))
        row[name] = timed(command, cache_env(cache, kernels, None))
    row["artifact_mb"] = round(sum(p.stat().st_size for p in (cache / "out").rglob("*") if p.is_file()) / 1e6, 1)
    row["graphs"] = len(json.loads((cache / "out" / "graphs" / "manifest.json").read_text())["graphs"])
    return row


BEFORE_CELL = f"cold, before ({BEFORE})"
COLD = {"cold, one process": "1", "cold, parallel": None}
"""The cold exports, by name: their ``OPTIMUM_NEURON_COMPILE_WORKERS`` (None: unset, the exporter decides)."""


def median_run(runs: list[dict[str, float]]) -> dict[str, Any]:
    """One cell from its rounds: the median wall time and peak memory, and every round's."""
    return {
        "wall_s": round(statistics.median(r["wall_s"] for r in runs), 1),
        "peak_rss_gib": round(statistics.median(r["peak_rss_gib"] for r in runs), 2),
        "rounds": runs,
    }


def _slug(name: str) -> str:
    return name.replace(", ", "-").replace(" ", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machine", default="epyc-2core")
    parser.add_argument("--rounds", type=int, default=2, help="times each cold export runs (median reported)")
    parser.add_argument("--render", action="store_true", help="rewrite export.md from export.json, measuring nothing")
    args = parser.parse_args()
    if args.render:
        body = json.loads((RESULTS / args.machine / "export.json").read_text())
        write_report(args.machine, body["rows"], body["machine"])
        return
    from optimum.neuron.cache_dir import cache_root
    from optimum.neuron.kernels import library
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    model_dir = convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32")
    library.load()  # the kernel's one-time build, shared by every run
    kernels = cache_root() / "kernels"
    before = before_checkout(cache_root())
    rows = {}
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory(dir=cache_root()) as scratch:
            rows[variant] = measure(model_dir, kernels, Path(scratch), variant, args.rounds, before)
            shutil.rmtree(scratch, ignore_errors=True)
    write_report(args.machine, rows, describe())


def write_report(machine: str, rows: dict[str, dict[str, Any]], described: dict[str, Any]) -> None:
    """``export.md`` (the table and the ratios) and ``export.json`` under ``results/<machine>/``; ``described``: the
    machine the rows were measured on (`machine.describe`)."""
    reexports = " | ".join(f"re-export {name}: s (x cold parallel)" for name in REEXPORTS)
    lines = [
        "# Export time: SmolLM2-135M fp32, batch 8, S=2048, chunk 256 (inductor, CPU)",
        "",
        "Command: `.venv/bin/python -m benchmark.export_time`",
        "",
        "Machine: " + machine_line(described),
        "",
        f"| artifact | graphs | {BEFORE_CELL}: s / peak GiB | cold, one process: s / peak GiB | cold, parallel: s / "
        f"peak GiB | parallel / before | parallel / one process | {reexports} | size MB |",
        "|---|---|---|---|---|---|---|" + "---|" * len(REEXPORTS) + "---|",
    ]
    for variant, row in rows.items():
        before, serial, parallel = row[BEFORE_CELL], row["cold, one process"], row["cold, parallel"]
        again = " | ".join(
            f"{row[name]['wall_s']} ({row[name]['wall_s'] / parallel['wall_s']:.2f})" for name in REEXPORTS
        )
        cells = " | ".join(f"{cell['wall_s']} / {cell['peak_rss_gib']}" for cell in (before, serial, parallel))
        lines.append(
            f"| {variant} | {row['graphs']} | {cells} | **{parallel['wall_s'] / before['wall_s']:.2f}** | "
            f"{parallel['wall_s'] / serial['wall_s']:.2f} | {again} | {row['artifact_mb']} |"
        )
    lines += ["", NOTE]
    folder = RESULTS / machine
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "export.md").write_text("\n".join(lines) + "\n")
    (folder / "export.json").write_text(json.dumps({"machine": described, "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))


NOTE = (
    f"*Parallel / before* is the cold export's gain over the exporter before issue 29 (commit {BEFORE}, run from a "
    "worktree of it with its own kernel build; the minimal artifact was its default, the default one its "
    "`--decode_logits`): the issue's goal, 0.7x. *Cold, one process* is today's exporter with its graphs compiled "
    "in the exporting process one after another (`OPTIMUM_NEURON_COMPILE_WORKERS=1`): *parallel / one process* is "
    "the gain of the parallel compile alone; the rest of the gain over the old exporter (its end without the "
    "interpreter's teardown, the vector-ISA check overlapping the imports) helps both columns. All measured in "
    "this run (each cell the median of its rounds, run alternating, each in a fresh cache). Re-exports "
    "run in the cache of the last cold parallel export. Every time is the wall time of a fresh `optimum-cli` process "
    "(its start, imports and the checkpoint's hash included); peak memory is the largest summed RSS of its process "
    "tree."
)


if __name__ == "__main__":
    main()
