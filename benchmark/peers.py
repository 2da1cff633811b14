"""Our engine vs OpenVINO GenAI vs llama.cpp on this CPU: SmolLM2-135M-Instruct, fp32, 2 threads, one HF folder.

    python -m benchmark.peers --setup                  # install the peers (idempotent; ~40 min the first time)
    python -m benchmark.peers [--rounds 3]             # interleaved rounds -> benchmark/results/<machine>/peers.md
    python -m benchmark.peers --quick                  # a short validation run (written under the cache, not results/)
    python -m benchmark.peers --only openvino          # rerun one system; the others' figures are kept from peers.json
    python -m benchmark.peers --only ours --linear-kernel aten --out DIR   # ours on torch's unpacked linears
    python -m benchmark.peers --setup --weight-format int8   # + the int8 IR and the Q8_0 GGUF (int4: g64 IR, Q4_0)
    python -m benchmark.peers --weight-format int8     # the same table at int8 weights -> .../peers-int8.md

``--weight-format int8|int4`` compares every system at that weight width (fp32 activations between layers): ours
exported with ``--weight_format int8`` (per output channel) / ``int4 --weight_group_size 64``, OpenVINO GenAI on an
int8 / int4 (group 64) IR from ``optimum-cli export openvino``, llama.cpp on the Q8_0 / Q4_0 GGUF that
``llama-quantize`` makes of the F32 one; the report says what each format is exactly, what each model file holds and
what OpenVINO's CPU plugin does with it (`peerbench.formats`).

Measured, each in a fresh process, in rounds of (ours, OpenVINO GenAI, llama.cpp) whose first system rotates:
decode ms/token at batch 1 (and our and OpenVINO's batch-8 step), prefill of 256 and 1,024 tokens, and 8 prompts of
~200 tokens -> 128 new tokens each (ours through `generate()` and `vllm.LLM`, OpenVINO's ContinuousBatchingPipeline
with split-fuse, budget 256). The probes (read bandwidth, fp32 GEMM peak) run at the start and the end of the run
and give the floors; before each measurement, the machine's in-cache multiply-add rate on one thread and on two is
recorded (`probes.core_rates`: whether the two vCPUs were two cores' worth then). See benchmark/README.md ("Peers on
this CPU").
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmark.peerbench import formats, install, plan, report, rounds, versions
from benchmark.peerbench.figures import LLAMA, OPENVINO, OURS, VLLM
from benchmark.peerbench.layout import WEIGHT_FORMATS, Layout

SYSTEMS = ("ours", "openvino", "llamacpp")
OWNS = {"ours": (OURS, VLLM), "openvino": (OPENVINO,), "llamacpp": (LLAMA,)}
"""The table's columns each system fills (what ``--only`` replaces)."""
RESULTS = Path(__file__).parent / "results"


def check_installed(layout: Layout, systems: list[str]) -> None:
    """Stop with the setup command when something a system needs is missing."""
    needs = {
        "ours": [layout.model],
        "openvino": [layout.ready("openvino-venv"), layout.openvino_ir],
        "llamacpp": [layout.llama_bench, layout.gguf],
    }
    for system in systems:
        for path in needs[system]:
            if not path.exists():
                raise layout.missing(f"{system} ({path})")


def settings(sizes: plan.Plan, weight_format: str = "fp32") -> list[str]:
    """How each row is measured (printed under the table)."""
    steps = sizes.decode_steps
    return [
        f"- Decode: ours = mean engine step after a {sizes.decode_context}-token prompt ({steps} steps after "
        f"{plan.DECODE_WARMUP} warm-up; batch 8 = 8 live rows); OpenVINO = `LLMPipeline` TPOT over {steps} tokens "
        f"(batch 8: mean step of `ContinuousBatchingPipeline` with 8 decoding rows); llama.cpp = `llama-bench -n "
        f"{steps}` (tg from an empty context).",
        f"- Prefill: time to first token, median of {sizes.prefill_repeats} fresh prompts after a warm-up one; ours "
        "= one engine step (chunks of 256 inside it, S=2048 artifact, batch 1); OpenVINO = `LLMPipeline` TTFT "
        "metric (its defaults: paged attention, prefix cache on but never hit); llama.cpp = `llama-bench -p` (pp).",
        f"- Batch workload: {sizes.workload_prompts} prompts of {sizes.workload_prompt_len} +- "
        f"{int(100 * sizes.workload_spread)} % tokens -> {sizes.workload_new_tokens} new tokens each, greedy, no "
        "EOS, output tokens / wall time; ours = one `generate()` call on the batch-8 artifact and one "
        "`vllm.LLM.generate` call (offline, our plugin); OpenVINO = `ContinuousBatchingPipeline` "
        "(dynamic_split_fuse, max_num_batched_tokens 256, no prefix caching), all requests added at once.",
        f"- Every system: 2 threads, {WEIGHTS[weight_format]}; fp32 KV cache for ours and OpenVINO "
        "(`INFERENCE_PRECISION_HINT=f32`, `KV_CACHE_PRECISION=f32`), f16 for llama.cpp (llama-bench offers no f32 "
        "cache; at these contexts the cache is a small part of the bytes read); prompts are token ids, identical "
        "for ours and OpenVINO (llama-bench draws its own).",
    ]


WEIGHTS = {
    "fp32": "fp32 weights and activations",
    "int8": "int8 weights (ours per output channel, OpenVINO int8, llama.cpp Q8_0), fp32 activations between layers "
    "(inside the matrix products: see Weight formats)",
    "int4": "int4 weights (ours and OpenVINO groups of 64, llama.cpp Q4_0), fp32 activations between layers (inside "
    "the matrix products: see Weight formats)",
}
"""The settings' words for each ``--weight-format``."""


def probe(layout: Layout) -> dict[str, Any]:
    """The probes in a fresh process."""
    return rounds.run_json([sys.executable, "-m", "benchmark.peerbench.probes", str(layout.model)], {})


def merge(previous: dict[str, Any], fresh: dict[str, Any], systems: list[str]) -> dict[str, Any]:
    """``fresh`` (a run of ``systems`` only) with the other systems' figures and log kept from ``previous``."""
    rerun = {c for s in systems for c in OWNS[s]}
    for row, cells in previous["figures"].items():
        for column, values in cells.items():
            if column not in rerun:
                fresh["figures"].setdefault(row, {})[column] = values
    fresh["log"] = [m for m in previous["log"] if m["system"] not in systems] + fresh["log"]
    fresh["probes"] = previous["probes"] + fresh["probes"]  # the floors then bound every kept figure too
    fresh["systems"] = [s for s in SYSTEMS if s in set(previous.get("systems", SYSTEMS)) | set(systems)]
    kept = {k: v for k, v in previous["versions"].items() if k not in systems}
    fresh["versions"] = kept | fresh["versions"]
    if "formats" in previous or "formats" in fresh:  # each system's file as it was read when it ran
        kept_formats = {k: v for k, v in previous.get("formats", {}).items() if k not in systems}
        fresh["formats"] = kept_formats | fresh.get("formats", {})
    when = measured(previous) | {s: fresh["started"] for s in systems}
    fresh["measured"] = {s: when[s] for s in fresh["systems"] if s in when}
    kept_from = ", ".join(f"{s} from the run of {fresh['measured'][s]}" for s in fresh["systems"] if s not in systems)
    fresh["merged"] = f"{', '.join(systems)} rerun; {kept_from}"
    return fresh


def measured(run: dict[str, Any]) -> dict[str, str]:
    """When each system of ``run`` was measured: the run's own record (a merged run), else the run's start."""
    return dict(run.get("measured") or {s: run["started"] for s in run.get("systems", SYSTEMS)})


def measure(
    layout: Layout, sizes: plan.Plan, systems: list[str], command: str, linear_kernel: str = "auto"
) -> dict[str, Any]:
    """The whole run, as the report reads it (our artifacts exported with ``linear_kernel``)."""
    from optimum.neuron.progress import StepProgress

    prompts = plan.inputs(sizes)
    per_round = {"ours": 5, "openvino": 4, "llamacpp": 1}
    total = 4 + ("ours" in systems) + sizes.rounds * sum(per_round[s] for s in systems)
    run: dict[str, Any] = {"command": command, "rounds": sizes.rounds, "systems": systems}
    run["weight_format"] = layout.weight_format
    run["started"] = time.strftime("%Y-%m-%d %H:%M")
    run["workload"] = {"prompt_lengths": [len(p) for p in prompts["workload"]], "new_tokens": sizes.workload_new_tokens}
    run["prefill_lengths"], run["batch"] = list(sizes.prefill_lengths), sizes.batch
    run["decode_positions"] = plan.decode_positions(sizes)
    with StepProgress("peers benchmark", total) as bar:
        with bar.step("machine, versions"):
            run["machine"], run["versions"] = versions.machine(), {}
            if "ours" in systems:
                run["versions"]["ours"] = versions.ours()
            if "openvino" in systems:
                answer = rounds.execute(layout, rounds.Measure("openvino", "versions", {"measure": "versions"}, dict))
                run["versions"]["openvino"] = versions.openvino(answer)
                try:  # what its CPU plugin does with the IR: reported, never fatal
                    plugin = rounds.execute(layout, rounds.Measure("openvino", "plugin", {"measure": "plugin"}, dict))
                except RuntimeError as err:
                    plugin = {"error": str(err)}
        with bar.step("probes (read bandwidth, GEMM peak)"):
            run["probes"] = [probe(layout)]
        artifacts: dict[str, str] = {}
        if "ours" in systems:
            with bar.step(f"our {layout.weight_format} artifacts (export cache)"):
                artifacts = rounds.export_artifacts(layout, sizes.batch, linear_kernel)
        run["formats"] = formats.describe(layout, systems, artifacts.get("b1"))
        if "openvino" in systems:
            run["formats"]["openvino"]["plugin"] = plugin
        per_system = rounds.all_measures(sizes, systems, prompts, artifacts)
        run["figures"], run["log"] = rounds.run_rounds(layout, sizes.rounds, per_system, bar)
        with bar.step("probes again"):
            run["probes"].append(probe(layout))
    if "llamacpp" in systems:
        first = next((m.get("result") for m in run["log"] if m["system"] == "llamacpp" and m.get("result")), None)
        run["versions"]["llamacpp"] = versions.llamacpp(first)
    run["finished"], run["settings"] = time.strftime("%Y-%m-%d %H:%M"), settings(sizes, layout.weight_format)
    return run


def main(argv: list[str] | None = None) -> None:
    """Set up the peers, or run the interleaved rounds and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="install what is missing, then exit")
    parser.add_argument("--only", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to set up / run")
    parser.add_argument("--quick", action="store_true", help="2 short rounds; report under the cache, not results/")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 2 with --quick)")
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder (benchmark/results/<machine>/)")
    parser.add_argument("--out", type=Path, help="report folder (overrides the default)")
    parser.add_argument(
        "--weight-format",
        default="fp32",
        choices=WEIGHT_FORMATS,
        help="every system's weights: fp32, int8 (ours per channel, OpenVINO int8, llama.cpp Q8_0) or int4 (ours and "
        "OpenVINO group 64, llama.cpp Q4_0); fp32 activations between layers. Reports peers.md / peers-int8.md / "
        "peers-int4.md",
    )
    parser.add_argument(
        "--linear-kernel",
        default="auto",
        choices=["auto", "aten"],
        help="our artifacts' --linear_kernel (aten: torch's unpacked linear; a before/after with --only ours --out)",
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="rewrite the markdown report beside a recorded run's JSON with this code's report (nothing is measured)",
    )
    args = parser.parse_args(argv)
    if args.render:
        print(report.rerender(args.render).read_text())
        return
    layout = Layout.default(args.weight_format)
    if args.setup:
        for name, seconds in install.setup(layout, args.only).items():
            print(f"{name}: {seconds:.0f} s")
        return
    check_installed(layout, args.only)
    sizes = plan.Plan.quick(args.rounds) if args.quick else plan.Plan(rounds=args.rounds or 3)
    out = args.out or (layout.root / "quick" if args.quick else RESULTS / args.machine)
    command = "python -m benchmark.peers " + shlex.join(argv if argv is not None else sys.argv[1:])
    run = measure(layout, sizes, args.only, command.strip(), args.linear_kernel)
    name = report.stem(args.weight_format)
    previous = out / f"{name}.json"
    if set(args.only) != set(SYSTEMS) and previous.is_file():
        run = merge(json.loads(previous.read_text()), run, args.only)
    path = report.write(run, out)
    print(path.read_text())
    print(f"written: {path} (+ {name}.json, {name}.png)", file=sys.stderr)


if __name__ == "__main__":
    main()
