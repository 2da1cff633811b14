"""Soak and load test: `vllm serve` of one artifact driven by N concurrent clients for T minutes.

    .venv/bin/python -m benchmark.soak [--quick] [--clients N] [--minutes T] [--model smollm2|PATH]

Defaults: 64 clients for 10 minutes on SmolLM2-135M (fp32, inductor, batch 8, S=1024, C=256, exported with the
token-generation graph returning logits, the default, so logprobs, penalties and JSON output are served). Each client
mixes streaming and non-streaming completions and chats, aborts (it closes a stream after a few events), logprobs,
``n > 1``, JSON output (``--quick``: a ``choice`` constraint, the tiny model's word tokenizer cannot write JSON),
penalties, long prompts and greedy checks (`benchmark.serving.soak_clients`). The report: requests ok / errored per
kind, p50 / p99 latency, what is left after the load (vLLM's ``vllm:num_requests_running`` / ``waiting`` gauges and
the worker's KV slot table, through ``/collective_rpc``: the server runs with ``VLLM_SERVER_DEV_MODE=1``), the engine
core's RSS after warm-up vs at the end, and whether the greedy checks sent under load equal the same requests sent
alone before it. ``--quick`` (a tiny model in CI): 8 clients for 18 s. Results: ``benchmark/results/<machine>/
soak[-quick].md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmark.machine import describe, machine_line
from benchmark.serving.server import SERVED_NAME, ServerProcess, serving
from benchmark.serving.soak_clients import KINDS, Client, Outcome, Shape, greedy_body

RESULTS = Path(__file__).parent / "results"
GREEDY_PROMPTS = 4
SAMPLE_EVERY_S = 30.0


@dataclass(frozen=True)
class Setup:
    """One soak: the artifact's shape and the load."""

    clients: int
    minutes: float
    batch_size: int
    sequence_length: int
    chunk: int
    max_tokens: int
    long_words: int
    json_output: bool = True
    """Structured output as JSON; False for a tokenizer that cannot write it (`soak_clients.Shape.json_output`)."""


FULL = Setup(clients=64, minutes=10.0, batch_size=8, sequence_length=1024, chunk=256, max_tokens=48, long_words=500)
QUICK = Setup(8, 0.3, 4, sequence_length=256, chunk=32, max_tokens=16, long_words=120, json_output=False)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 clients for 18 s on a small artifact (CI)")
    parser.add_argument("--clients", type=int, help="concurrent clients (default 64, quick 8)")
    parser.add_argument("--minutes", type=float, help="load duration (default 10, quick 0.3)")
    parser.add_argument("--model", default="smollm2", help="'smollm2' (the bundled model) or a transformers folder")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    parser.add_argument("--out", type=Path, help="results folder (default benchmark/results/<machine>)")
    return parser.parse_args(argv)


def model_dir(name: str) -> Path:
    """The transformers folder to export."""
    if name != "smollm2":
        return Path(name)
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    return convert_smollm2(default_smollm2_dir("float32"), dtype="float32")


def export_for(model: Path, setup: Setup, backend: str) -> Path:
    """The served artifact (cached export): chunked, on-device sampling plus the logits graph."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=setup.batch_size,
        sequence_length=setup.sequence_length,
        prefill_chunk_size=setup.chunk,
        decode_logits=True,
        backend=backend,
    )
    return cached_export(model, config)


def corpus() -> list[str]:
    """English prose for prompts, offline: the Python documentation's topics (stdlib ``pydoc_data``)."""
    from pydoc_data.topics import topics

    return " ".join(topics.values()).split()


class Probe:
    """What the soak reads from the server besides the clients' requests."""

    def __init__(self, server: ServerProcess) -> None:
        self.base = f"http://127.0.0.1:{server.port}"
        self.server = server

    def post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=900) as reply:
            return json.loads(reply.read())

    def gauges(self) -> dict[str, float]:
        """vLLM's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (summed over engines)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=60) as reply:
            text = reply.read().decode()
        out = {}
        for name in ("running", "waiting"):
            values = re.findall(rf"^vllm:num_requests_{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
            out[name] = sum(float(v) for v in values)
        return out

    def slots(self) -> list[Any]:
        """Each worker's held KV slots (the plugin worker's ``slot_usage``)."""
        return list(self.post("/collective_rpc", {"method": "slot_usage"})["results"])

    def engine_rss(self) -> int:
        """Resident bytes of the engine core and its children (tensor-parallel workers)."""
        root = psutil.Process(self.server.pid)
        cores = [p for p in root.children() if "EngineCore" in " ".join(p.cmdline())]
        return sum(p.memory_info().rss for core in cores for p in [core, *core.children(recursive=True)])

    def settle(self, timeout_s: float = 120) -> dict[str, float]:
        """The gauges once nothing runs or waits (or after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while (gauges := self.gauges()) and any(gauges.values()) and time.monotonic() < deadline:
            time.sleep(1)
        return gauges


def greedy_prompts(probe: Probe, words: list[str], count: int) -> list[list[int]]:
    """``count`` prompts as token ids (the server's ``/tokenize``), of 8 to 40 words."""
    prompts = []
    for i in range(count):
        text = " ".join(words[500 * i : 500 * i + 8 + 10 * i])
        prompts.append(probe.post("/tokenize", {"model": SERVED_NAME, "prompt": text})["tokens"])
    return prompts


def warm_up(base: str, shape: Shape, words: list[str], greedy: list[list[int]]) -> Client:
    """One request of every kind, one at a time (grammar compiled, caches filled) before RSS is first read."""
    client = Client(base, -1, shape, words, greedy)
    for kind in KINDS:
        client.send(kind)
    return client


def run_load(base: str, setup: Setup, shape: Shape, words: list[str], greedy: list[list[int]], probe: Probe) -> Any:
    """The clients, for ``setup.minutes``; the samples taken meanwhile (time, engine RSS, gauges)."""
    clients = [Client(base, i, shape, words, greedy) for i in range(setup.clients)]
    deadline = time.monotonic() + 60 * setup.minutes
    threads = [threading.Thread(target=c.run, args=(deadline,), daemon=True) for c in clients]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    samples, next_sample = [], start
    while any(t.is_alive() for t in threads):
        if time.monotonic() >= next_sample:
            samples.append({"t_s": round(time.monotonic() - start, 1), "rss": probe.engine_rss(), **probe.gauges()})
            next_sample += SAMPLE_EVERY_S
        time.sleep(0.5)
    return clients, samples, time.monotonic() - start


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values`` (NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts and latencies, overall and per kind (aborted streams count as ok, without a latency)."""

    def stats(items: list[Outcome]) -> dict[str, Any]:
        timed = [o.latency_s for o in items if o.ok and o.kind != "abort"]
        return {
            "requests": len(items),
            "ok": sum(o.ok for o in items),
            "errored": sum(not o.ok for o in items),
            "p50_s": round(percentile(timed, 50), 2),
            "p99_s": round(percentile(timed, 99), 2),
            "tokens": sum(o.tokens for o in items),
        }

    kinds = {kind: stats([o for o in outcomes if o.kind == kind]) for kind in KINDS}
    errors = [f"{o.kind}: {o.detail}" for o in outcomes if not o.ok][:20]
    return {"all": stats(outcomes), "kinds": kinds, "error_samples": errors}


def soak(args: argparse.Namespace, setup: Setup, work: Path) -> dict[str, Any]:
    """Export, serve, warm up, load, settle; everything the report needs."""
    from optimum.neuron.artifact import read_config

    artifact = export_for(model_dir(args.model), setup, args.backend)
    neuron = read_config(artifact)
    shape = Shape(neuron.sequence_length, neuron.max_topk, setup.max_tokens, setup.long_words, setup.json_output)
    words = corpus()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc: the worker's slot table
    flags = ("--served-model-name", SERVED_NAME, "--seed", "0")
    with serving(artifact, work / "server.log", *flags) as server:
        probe = Probe(server)
        greedy = greedy_prompts(probe, words, GREEDY_PROMPTS)
        alone = [probe.post("/v1/completions", greedy_body(p, shape))["choices"][0]["token_ids"] for p in greedy]
        warm = warm_up(probe.base, shape, words, greedy)
        rss_start = probe.engine_rss()
        clients, samples, seconds = run_load(probe.base, setup, shape, words, greedy, probe)
        left = probe.settle()
        slots, rss_end = probe.slots(), probe.engine_rss()
        health = urllib.request.urlopen(probe.base + "/health", timeout=60).status
    seen = [(i, t) for c in [warm, *clients] for i, t in c.greedy_seen]
    log = (work / "server.log").read_text(errors="replace").splitlines()
    server_errors = [line for line in log if " ERROR " in line]
    return {
        "setup": asdict(setup),
        "artifact": {"path": str(artifact), "model": args.model, "backend": args.backend, "max_topk": neuron.max_topk},
        "warm_up": summarize(warm.outcomes),
        "load": {**summarize([o for c in clients for o in c.outcomes]), "seconds": round(seconds, 1)},
        "left": {**left, "slots_held": sum(len(s) for s in slots), "health": health},
        "rss": {"start": rss_start, "end": rss_end, "growth_pct": round(100 * (rss_end / rss_start - 1), 2)},
        "greedy": {"checks": len(seen), "mismatches": sum(alone[i] != t for i, t in seen)},
        "server_errors": server_errors[:20],
        "samples": samples,
        "exit_status": server.returncode,
    }


def goals(result: dict[str, Any]) -> dict[str, bool]:
    """The soak's goals: no error, nothing left, RSS growth <= 5 %, greedy outputs equal."""
    left = result["left"]
    return {
        "0 errors": result["load"]["all"]["errored"] == 0 and result["warm_up"]["all"]["errored"] == 0,
        "nothing left running": left["running"] == 0 and left["waiting"] == 0 and left["slots_held"] == 0,
        "RSS growth <= 5 %": result["rss"]["growth_pct"] <= 5,
        "greedy outputs equal": result["greedy"]["mismatches"] == 0 and result["greedy"]["checks"] > 0,
    }


def write_report(out: Path, name: str, result: dict[str, Any]) -> Path:
    """``<name>.md`` and ``<name>.json`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    setup, load, left, rss = result["setup"], result["load"], result["left"], result["rss"]
    artifact = result["artifact"]
    lines = [
        f"# Soak: {setup['clients']} clients for {setup['minutes']:g} min",
        "",
        f"- command: `{result['command']}` ({result['date']})",
        "- machine: " + machine_line(result["machine"]) + " (load at the start)",
        f"- artifact: {artifact['model']}, {artifact['backend']}, fp32, batch {setup['batch_size']}, "
        f"S={setup['sequence_length']}, C={setup['chunk']}, decode_logits, max_topk {artifact['max_topk']}",
        f"- load: {load['seconds']} s; up to {setup['max_tokens']} new tokens per request; long prompts of "
        f"{setup['long_words']} words; request kinds and weights {dict(KINDS)}",
        "",
        "| goal | met |",
        "|---|---|",
        *(f"| {goal} | {'yes' if met else '**no**'} |" for goal, met in goals(result).items()),
        "",
        "| kind | requests | ok | errored | p50 s | p99 s | completion tokens |",
        "|---|---|---|---|---|---|---|",
        *(_row(kind, row) for kind, row in [*load["kinds"].items(), ("all", load["all"])]),
        "",
        f"After the load: {left['running']:g} requests running, {left['waiting']:g} waiting (vLLM's gauges), "
        f"{left['slots_held']} KV slots held (the worker's slot table), /health {left['health']}; vllm serve exited "
        f"with status {result['exit_status']} after the graceful stop.",
        "",
        f"Engine core RSS: {rss['start'] / 2**20:.0f} MiB after the warm-up (one request of each kind), "
        f"{rss['end'] / 2**20:.0f} MiB at the end: {rss['growth_pct']:+.2f} %. Greedy checks under load: "
        f"{result['greedy']['checks']}, {result['greedy']['mismatches']} differing from the same request sent alone.",
        "",
        "Aborted streams count as ok (the client closed them) and have no latency. Latency is the whole request, "
        "queueing for a KV slot included.",
    ]
    if load["error_samples"]:
        lines += ["", "Errors (first 20):", "", *(f"- {e}" for e in load["error_samples"])]
    if result["server_errors"]:
        lines += ["", "Server log ERROR lines (first 20):", "", "```", *result["server_errors"], "```"]
    report = out / f"{name}.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _row(kind: str, row: dict[str, Any]) -> str:
    return (
        f"| {kind} | {row['requests']} | {row['ok']} | {row['errored']} | {row['p50_s']} | {row['p99_s']} | "
        f"{row['tokens']} |"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base = QUICK if args.quick else FULL
    setup = Setup(**{**asdict(base), **{k: v for k, v in (("clients", args.clients), ("minutes", args.minutes)) if v}})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    machine = describe()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        result = soak(args, setup, Path(tmp))
    result.update(
        command="python -m benchmark.soak " + shlex.join(sys.argv[1:] if argv is None else argv),
        date=datetime.date.today().isoformat(),
        machine=machine,
        goals=goals(result),
    )
    report = write_report(args.out or RESULTS / args.machine, "soak-quick" if args.quick else "soak", result)
    print(report.read_text())
    print(f"written: {report}")


if __name__ == "__main__":
    main()
