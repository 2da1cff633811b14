"""Serving benchmark: chunked prefill vs context encoding, hybrid vs CPU sampling, against peers and the
memory-bandwidth floor, through `vllm serve` driven by `vllm bench serve`.

    .venv/bin/python -m benchmark.serve [--quick] [--model smollm2|PATH] [--device cpu|cuda]

For each of the four configurations (context encoding + on-device sampling, context encoding + CPU
sampling, chunked + CPU sampling, chunked + hybrid sampling) it exports the model (export cache reused),
serves it on 127.0.0.1 and runs the main workload (8 users, prompts 1500 +- 10 % tokens, 128 +- 10 % new
tokens; ``--quick`` scales it down). Context encoding + ODS and chunked + hybrid also run the mixed
workload: short chats alone (idle), then the same chats while long prompts arrive. transformers
``generate`` and llama.cpp (on the GGUF, when the model has one) run the main workload as peers. The
copy bandwidth measured first gives the decode-step floor (weight bytes / bandwidth).
Results: ``benchmark/results/<machine>/serving[-quick]/`` (serving.md, serving.json, PNG plots).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from benchmark.machine import check_device, copy_bandwidth, describe
from benchmark.serving.configs import CONFIGS, FULL, MIXED_CONFIGS, QUICK, ServeConfig, Workload, export_config
from benchmark.serving.loadgen import run_idle, run_load, run_mixed
from benchmark.serving.peers import run_peer
from benchmark.serving.report import write_report
from benchmark.serving.server import SERVED_NAME, serving

RESULTS = Path(__file__).parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="S=512, C=64, 8 prompts of ~300 tokens, 32 new tokens")
    parser.add_argument("--model", default="smollm2", help="'smollm2' (the bundled model) or a transformers folder")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sequence-length", type=int, help="override the workload's sequence length")
    parser.add_argument("--configs", nargs="+", choices=[c.name for c in CONFIGS], help="a subset of configurations")
    parser.add_argument("--no-peers", action="store_true", help="skip transformers and llama.cpp")
    parser.add_argument("--port", type=int, default=0, help="Server port (default: a free one).")
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    parser.add_argument("--out", type=Path, help="results folder (default benchmark/results/<machine>/serving[-quick])")
    return parser.parse_args(argv)


def model_source(name: str, dtype: str) -> tuple[Path, Path | None]:
    """The transformers folder to export, and the GGUF llama.cpp reads (None when there is none)."""
    if name != "smollm2":
        return Path(name), None
    from optimum.neuron.config import DTYPES
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir, gguf_path

    torch_dtype = str(DTYPES[dtype]).removeprefix("torch.")
    return convert_smollm2(default_smollm2_dir(torch_dtype), dtype=torch_dtype), gguf_path()


def floor_ms(model_dir: Path, dtype: str, bandwidth: float) -> float:
    """The decode step's memory-bandwidth floor: weight bytes / measured copy bandwidth, in ms."""
    from benchmark.decode import weight_bytes

    return 1000 * weight_bytes(str(model_dir), dtype) / bandwidth


def serve_config(
    config: ServeConfig, artifact: Path, workload: Workload, port: int, work: Path
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Serve one artifact: the main workload, then (for `MIXED_CONFIGS`) idle chats and the mixed workload."""
    folder = work / config.name
    folder.mkdir(parents=True, exist_ok=True)
    flags = ("--served-model-name", SERVED_NAME, "--seed", "0")
    with serving(artifact, folder / "server.log", *flags, port=port) as server:
        port = server.port
        main = run_load(workload.main, port, artifact, folder / "main.json")
        if config.name not in MIXED_CONFIGS:
            return main, None
        idle, startup = run_idle(workload.chats, port, artifact, folder / "idle-chats.json", seed=1)
        interval = startup + workload.arrival_lead_s
        chats, arrivals = run_mixed(workload.chats, workload.arrivals, interval, port, artifact, folder)
    return main, {"idle": idle, "chats": chats, "arrivals": arrivals, "interval": {"arrival_interval_s": interval}}


def header(args: argparse.Namespace, workload: Workload, bandwidth: float, floor: float) -> list[str]:
    """The report's preamble: command, machine, versions, workload, the floor."""
    import vllm

    machine = describe()
    command = "python -m benchmark.serve " + shlex.join(sys.argv[1:])
    return [
        f"# Serving benchmark ({'quick' if args.quick else 'full'})",
        "",
        f"- command: `{command}` ({datetime.date.today().isoformat()})",
        f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}, {platform.system()}; "
        f"load at start {machine['load_avg_1m']}",
        f"- versions: torch {machine['torch']}, transformers {machine['transformers']}, vllm {vllm.__version__}",
        f"- model: {args.model} ({args.dtype}, backend {args.backend}, device {args.device})",
        f"- artifacts: batch {workload.batch_size}, sequence length {workload.sequence_length}, "
        f"chunk {workload.chunk} for chunked configurations",
        f"- main workload: {asdict(workload.main)}",
        f"- mixed workload: chats {asdict(workload.chats)}; long prompts {asdict(workload.arrivals)} "
        "from a second client started first, one every (chat client start-up + "
        f"{workload.arrival_lead_s} s): the first about {workload.arrival_lead_s} s after the chats start",
        "- load generator: `vllm bench serve` (random dataset, fixed seeds, ignore_eos, temperature 0)",
        f"- bandwidth floor: copy bandwidth {bandwidth / 1e9:.1f} GB/s -> {floor:.3g} ms per decode step",
    ]


def run_peers(args: argparse.Namespace, model_dir: Path, gguf: Path | None, workload: Workload) -> dict[str, Any]:
    spec = {"model_dir": str(model_dir), "dtype": args.dtype, "load": asdict(workload.main)}
    peers = {"transformers generate (eager)": run_peer({**spec, "peer": "transformers"})}
    if gguf is None:
        peers["llama.cpp"] = {"error": "the model has no GGUF file"}
    else:
        llama = {**spec, "peer": "llama.cpp", "gguf": str(gguf), "sequence_length": workload.sequence_length}
        peers[f"llama.cpp ({gguf.name.split('.')[-2]}, one sequence at a time)"] = run_peer(llama)
    return peers


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_device(args.device)
    workload = QUICK if args.quick else FULL
    if args.sequence_length:
        from dataclasses import replace

        workload = replace(workload, sequence_length=args.sequence_length)
    configs = [c for c in CONFIGS if not args.configs or c.name in args.configs]
    out = args.out or RESULTS / args.machine / ("serving-quick" if args.quick else "serving")
    model_dir, gguf = model_source(args.model, args.dtype)
    bandwidth = copy_bandwidth()
    floor = floor_ms(model_dir, args.dtype, bandwidth)
    results: dict[str, dict[str, Any]] = {}
    mixed: dict[str, dict[str, Any]] = {}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp, Progress(*columns) as progress:
        task = progress.add_task("serving benchmark", total=len(configs) + (0 if args.no_peers else 1))
        for config in configs:
            progress.update(task, description=f"{config.name}: export")
            artifact = export_config(model_dir, config, workload, args.dtype, args.backend, args.device)
            progress.update(task, description=f"{config.name}: serve + load")
            results[config.name], mix = serve_config(config, artifact, workload, args.port, Path(tmp))
            if mix:
                mixed[config.name] = mix
            progress.advance(task)
        if not args.no_peers:
            progress.update(task, description="peers: transformers, llama.cpp")
            results.update(run_peers(args, model_dir, gguf, workload))
            progress.advance(task)
    report = write_report(out, header(args, workload, bandwidth, floor), results, mixed, floor)
    print(report.read_text())
    print(f"written: {report}")


if __name__ == "__main__":
    main()
