"""The interleaved rounds: every measurement of every system in a fresh process, the machine's 1-minute load
recorded before and after each one, and how many cores' worth of multiply-adds it gave just before
(`probes.core_rates`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmark.peerbench import llamacpp, probes
from benchmark.peerbench.figures import LLAMA, OPENVINO, OURS, VLLM
from benchmark.peerbench.formats import OURS_FORMATS
from benchmark.peerbench.layout import Layout
from benchmark.peerbench.plan import CHUNK, SEQUENCE_LENGTH, Plan

THREADS = "2"
WORKER = Path(__file__).with_name("openvino_worker.py")
Figures = dict[str, dict[str, float]]
"""``{row: {column: value}}``: what one measurement contributes to the table."""


def child_env() -> dict[str, str]:
    """Every child sees 2 threads (OpenMP, MKL) and no hub."""
    return {**os.environ, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS, "HF_HUB_OFFLINE": "1"}


RESULT_MARKER = "PEERS_RESULT "
"""A worker prints its answer on one line after this marker (libraries may print to stdout after it)."""


def run_json(cmd: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``cmd SPEC_FILE`` in a fresh process; its `RESULT_MARKER` line as JSON (raise with the output's tail)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        done = subprocess.run([*cmd, handle.name], capture_output=True, text=True, env=child_env())
    finally:
        os.unlink(handle.name)
    answers = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if done.returncode != 0 or not answers:
        tail = " | ".join((done.stderr.strip() or done.stdout.strip()).splitlines()[-4:])
        raise RuntimeError(f"exit {done.returncode}, no result: {tail}")
    result: dict[str, Any] = json.loads(answers[-1].removeprefix(RESULT_MARKER))
    return result


@dataclass(frozen=True)
class Measure:
    """One measurement of one system: what its fresh process gets (``spec``) and how its answer fills the table."""

    system: str
    name: str
    spec: dict[str, Any]
    read: Callable[[dict[str, Any]], Figures]


def execute(layout: Layout, measure: Measure) -> dict[str, Any]:
    """Run ``measure`` in a fresh process of its system."""
    if measure.system == "ours":
        return run_json([sys.executable, "-m", "benchmark.peerbench.ours"], measure.spec)
    if measure.system == "openvino":
        cmd = [str(layout.openvino_python), str(WORKER)]
        return run_json(cmd, {"ir": str(layout.openvino_ir), "threads": int(THREADS), **measure.spec})
    return llamacpp.run(layout, **measure.spec)


def export_artifacts(layout: Layout, batch_rows: int = 8, linear_kernel: str = "auto") -> dict[str, str]:
    """Our batch-1 and batch-8 artifacts (fp32, inductor, S=2048, C=256, ``--linear_kernel linear_kernel``, the
    weights in ``layout``'s format: `formats.OURS_FORMATS`) from the export cache, each export in its own process (a
    cache hit when the code and the model are unchanged); their folders."""
    out = {}
    for batch in (1, batch_rows):
        spec = {"measure": "export", "model": str(layout.model), "batch": batch, "linear_kernel": linear_kernel}
        spec |= OURS_FORMATS[layout.weight_format]
        result = execute(
            layout, Measure("ours", "export", spec | {"sequence_length": SEQUENCE_LENGTH, "chunk": CHUNK}, dict)
        )
        out["b1" if batch == 1 else "b8"] = result["artifact"]
    return out


def _prefill_rows(column: str, values: dict[str, float]) -> Figures:
    return {f"prefill_{n}_ms": {column: ms} for n, ms in values.items()}


def ours_measures(plan: Plan, prompts: dict[str, Any], artifacts: dict[str, str]) -> list[Measure]:
    """Our engine's decode at batch 1 and 8, its prefills, and the workload through `generate()` and `vllm.LLM`."""
    work = {"prompts": prompts["workload"], "warmup": prompts["warmup"], "new_tokens": plan.workload_new_tokens}
    b1, b8 = {"artifact": artifacts["b1"]}, {"artifact": artifacts["b8"]}
    decode = {"measure": "decode", "steps": plan.decode_steps}
    return [
        Measure(
            "ours",
            "decode b1",
            decode | b1 | {"prompts": prompts["decode_b1"]},
            lambda r: {"decode_b1_ms": {OURS: r["mean_ms"]}},
        ),
        Measure(
            "ours",
            "decode b8",
            decode | b8 | {"prompts": prompts["decode_b8"]},
            lambda r: {"decode_b8_ms": {OURS: r["mean_ms"]}},
        ),
        Measure(
            "ours",
            "prefill",
            {"measure": "prefill", "prompts": prompts["prefill"]} | b1,
            lambda r: _prefill_rows(OURS, r),
        ),
        Measure(
            "ours", "generate", {"measure": "generate"} | work | b8, lambda r: {"workload_tok_s": {OURS: r["tok_s"]}}
        ),
        Measure("ours", "vllm.LLM", {"measure": "vllm"} | work | b8, lambda r: {"workload_tok_s": {VLLM: r["tok_s"]}}),
    ]


def openvino_measures(plan: Plan, prompts: dict[str, Any]) -> list[Measure]:
    """OpenVINO's LLMPipeline decode and TTFT, its ContinuousBatchingPipeline's batch-8 step and the workload."""
    work = {"prompts": prompts["workload"], "warmup": prompts["warmup"], "new_tokens": plan.workload_new_tokens}
    decode = {"measure": "decode", "steps": plan.decode_steps, "warmup": prompts["warmup"]}
    return [
        Measure(
            "openvino",
            "decode b1",
            decode | {"prompts": prompts["decode_b1"]},
            lambda r: {"decode_b1_ms": {OPENVINO: r["tpot_ms"]}},
        ),
        Measure(
            "openvino",
            "decode b8",
            decode | {"measure": "decode_batch", "prompts": prompts["decode_b8"]},
            lambda r: {"decode_b8_ms": {OPENVINO: r["step_ms"]}},
        ),
        Measure(
            "openvino",
            "prefill",
            {"measure": "prefill", "prompts": prompts["prefill"], "warmup": prompts["warmup"]},
            lambda r: _prefill_rows(OPENVINO, r),
        ),
        Measure(
            "openvino", "workload", {"measure": "workload"} | work, lambda r: {"workload_tok_s": {OPENVINO: r["tok_s"]}}
        ),
    ]


def llamacpp_measures(plan: Plan) -> list[Measure]:
    """One ``llama-bench`` process: tg (decode) and pp (prefill) of each length."""
    spec = {
        "prompt_lengths": list(plan.prefill_lengths),
        "new_tokens": plan.decode_steps,
        "repetitions": plan.llama_repetitions,
    }

    def read(r: dict[str, Any]) -> Figures:
        return {"decode_b1_ms": {LLAMA: r["decode_ms"]}} | _prefill_rows(LLAMA, r["prefill_ms"])

    return [Measure("llamacpp", "llama-bench", spec, read)]


def all_measures(
    plan: Plan, systems: list[str], prompts: dict[str, Any], artifacts: dict[str, str]
) -> dict[str, list[Measure]]:
    """Each system's measurements of one round."""
    build = {
        "ours": lambda: ours_measures(plan, prompts, artifacts),
        "openvino": lambda: openvino_measures(plan, prompts),
        "llamacpp": lambda: llamacpp_measures(plan),
    }
    return {system: build[system]() for system in systems}


def run_rounds(
    layout: Layout, count: int, per_system: dict[str, list[Measure]], progress: Any
) -> tuple[dict[str, dict[str, list[float]]], list[dict[str, Any]]]:
    """``count`` rounds; in each, every system's measurements (the first system rotates from round to round, so
    none always runs first). Returns the figures ``{row: {column: [one value per round]}}`` and the log of every
    measurement (load before and after, seconds, answer or error)."""
    systems = list(per_system)
    figures: dict[str, dict[str, list[float]]] = {}
    log = []
    for index in range(count):
        shift = index % len(systems)
        for system in systems[shift:] + systems[:shift]:
            for measure in per_system[system]:
                with progress.step(f"round {index + 1}: {system} {measure.name}"):
                    entry = run_one(layout, measure, figures)
                log.append({"round": index + 1, "system": system, "measure": measure.name} | entry)
    return figures, log


def run_one(layout: Layout, measure: Measure, figures: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Run one measurement, add its values to ``figures``; its log entry (a failure is logged, not raised)."""
    entry: dict[str, Any] = {"load_before": os.getloadavg()[0], "compute": probes.core_rates()}
    start = time.perf_counter()
    try:
        result = execute(layout, measure)
        for row, cells in measure.read(result).items():
            for column, value in cells.items():
                figures.setdefault(row, {}).setdefault(column, []).append(value)
        entry["result"] = result
    except (RuntimeError, KeyError, ValueError) as err:
        entry["error"] = str(err)
    return entry | {"load_after": os.getloadavg()[0], "seconds": time.perf_counter() - start}
