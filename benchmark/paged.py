"""Paged KV cache benchmark: what paging costs a decode step, what prefix caching buys a chat workload, what a pool
smaller than the slots lets a larger batch serve (SmolLM2-135M-Instruct, fp32, inductor).

    .venv/bin/python -m benchmark.paged [--quick] [--parts blocks price prefix chunks fit kvint8] [--baseline COMMIT]
        [--machine NAME]

* ``blocks``: per block size (8 to 128), the paged decode attention of a step (batch 8, window 2048, 30 layers) on
  an fp32 cache and on the same cache in int8 (``--kv_cache_dtype int8``), and a prefill chunk's gather of a
  2048-position window, timed alone: what the default block size is chosen from.
* ``price``: decode ms/step at batch 8, contexts 64 and 2000 (S 2048, C 256), this checkout's paged cache against
  the slot layout of ``--baseline`` (a commit before paging, checked out in a git worktree under the cache and run
  with its own cache folder), each point in a fresh process, interleaved rounds; and the share of the step the block
  gather takes (`read_blocks`, 30 layers x K and V, timed alone on the step's shapes).
* ``prefix``: ``vllm serve`` of the S 2048 artifact with prefix caching on and off (``--no-enable-prefix-caching``),
  driven by ``vllm bench serve --dataset-name prefix_repetition`` (a few 1,024-token prefixes, each request one of
  them + a 64-token suffix, 32 new tokens; 4 users): TTFT p50 / p90 and output tok/s.
* ``chunks``: milliseconds of one prefill call holding the last 16, 64, 128 or 256 tokens of a prompt, after 1,024
  prefilled ones (what a prefix-cache hit leaves to compute), on the S 2048 artifact with chunk-length buckets
  (``--chunk_buckets auto``) and without (``none``: every call runs 256 columns), each in a fresh process.
* ``fit``: 32 concurrent short chats (random 100 -> 100 tokens) on a batch-32 artifact (S 4096) whose pool is 8 x
  4096 tokens, against the batch-8 artifact of the same pool (vLLM admits by blocks): output tok/s.
* ``kvint8``: decode ms/step at batch 1 and 8 after a 1,000-token context (S 1024, C 256), the fp32 KV cache against
  ``--kv_cache_dtype int8``, each point in a fresh process, interleaved rounds; and each cache's bytes. ``--quick``
  runs it on eager artifacts (no compile) after a 64-token context: a smoke run, not a measurement.
* ``kvint8-long``: the same after a 4,000-token context (S 4096).

Run it on a quiet machine: the 1-minute load is recorded with each part. Results:
``benchmark/results/<machine>/paged.md`` and ``paged.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
BASELINE = "21479ae"
"""The last commit of main before the paged cache (slot layout: one row of S + 1 positions per slot)."""
SEQUENCE_LENGTH, CHUNK, BATCH = 2048, 256, 8
CONTEXTS = (64, 2000)
PREFIX, TAILS = 1024, (16, 64, 128, 256)
"""``chunks``: the prefilled prompt start, and the tails whose one prefill call is timed after it."""
PARTS = ("blocks", "price", "prefix", "chunks", "fit", "kvint8", "kvint8-long")
KV_CONTEXT, KV_SEQUENCE_LENGTH, KV_BATCHES = 1000, 1024, (1, 8)
"""``kvint8``: the live context, the artifacts' sequence length, the batches."""
KV_LONG_CONTEXT, KV_LONG_SEQUENCE_LENGTH = 4000, 4096
"""``kvint8-long``: the same at a long context, where the cache is a large part of what a step reads."""


def _env(cache: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cache is not None:
        env |= {"OPTIMUM_NEURON_CACHE": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    return env


def run_worker(spec: dict[str, Any], cwd: Path = ROOT, cache: Path | None = None) -> dict[str, Any]:
    """One measurement in a fresh interpreter of the checkout ``cwd`` (its `benchmark.kv_buckets` worker: export or
    decode, which both checkouts have)."""
    cmd = [sys.executable, "-m", "benchmark.kv_buckets", "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(cache))
    if done.returncode != 0:
        raise RuntimeError(f"{spec} in {cwd} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def baseline_checkout(commit: str, cache: Path) -> Path:
    """A git worktree of ``commit`` under ``cache`` (made once)."""
    tree = cache / f"baseline-{commit}"
    if not (tree / "optimum").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True)
    return tree


def attention_ms(window: int, block: int, steps: int = 20, int8: bool = True) -> dict[str, float]:
    """Milliseconds of a batch-8 decode step's attention over 30 layers with the paged kernel: SmolLM2's 9 query / 3
    KV heads of 64, a ``window``-position window of ``block``-position blocks spread over the pool; ``fp32`` on the
    float pool and, with ``int8``, ``int8`` on the same pool quantized (`kv_cache.quantize_kv`, the int8 kernel),
    interleaved."""
    import torch

    from optimum.neuron.kernels import library
    from optimum.neuron.kernels.attention import paged_attention, paged_attention_int8
    from optimum.neuron.models.layers.kv_cache import quantize_kv

    library.load()
    k, v, table = _pool(window, block)
    q, mask = torch.randn(BATCH, 9, 1, 64), torch.ones(BATCH, window, dtype=torch.bool)
    calls = {"fp32": partial(paged_attention, q, k, v, table, mask, 0.125)}
    if int8:
        (k8, k_scale), (v8, v_scale) = quantize_kv(k), quantize_kv(v)
        calls["int8"] = partial(paged_attention_int8, q, k8, v8, k_scale, v_scale, table, mask, 0.125)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(steps // 5):
        for name, call in calls.items():
            times[name].append(_median_ms(call, 30, 5))
    return {name: statistics.median(values) for name, values in times.items()}


def gather_ms(window: int, block: int, steps: int = 20) -> float:
    """Milliseconds a prefill chunk spends gathering its ``window``-position window (`read_blocks`, K and V of 30
    layers, one row), the blocks spread over the pool."""
    from optimum.neuron.models.layers.kv_cache import read_blocks

    k, _, table = _pool(window, block)
    return _median_ms(partial(read_blocks, k, table[:1]), 60, steps)


def _pool(window: int, block: int) -> tuple[Any, Any, Any]:
    """K and V pools of batch 8 x S positions (3 heads of 64) and a ``[8, window / block]`` table of shuffled blocks."""
    import torch

    pool = BATCH * SEQUENCE_LENGTH // block + 1
    k, v = torch.randn(pool, 3, block, 64), torch.randn(pool, 3, block, 64)
    table = torch.randperm(pool - 1)[: BATCH * (window // block)].reshape(BATCH, -1) + 1
    return k, v, table


def block_sizes() -> dict[str, Any]:
    """Per block size: a decode step's paged attention and a prefill chunk's gather, window 2048."""
    sizes = (8, 16, 32, 64, 128)
    rows = {}
    for block in sizes:
        attention = attention_ms(SEQUENCE_LENGTH, block)
        rows[str(block)] = {
            "decode_attention_ms": attention["fp32"],
            "decode_attention_int8_ms": attention["int8"],
            "prefill_gather_ms": gather_ms(SEQUENCE_LENGTH, block),
        }
    return rows


def _median_ms(call: Any, repeats: int, steps: int) -> float:
    """Median over ``steps`` of the milliseconds ``repeats`` calls of ``call`` take (a step's layers)."""
    call()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def price(model_dir: str, baseline: Path, cache: Path, rounds: int, steps: int) -> dict[str, Any]:
    """Decode ms/step of the paged artifact and the baseline's slot artifact, interleaved rounds."""
    from optimum.neuron.config import NeuronConfig

    artifacts = {"paged": cache / "paged-price", "slot": cache / "slot-price"}
    checkouts = {"paged": (ROOT, None), "slot": (baseline, cache / "baseline-cache")}
    for name, (cwd, own_cache) in checkouts.items():
        if not (artifacts[name] / "neuron_config.json").is_file():
            spec = {"task": "export", "model_dir": model_dir, "buckets": "auto", "batch": BATCH}
            run_worker({**spec, "out": str(artifacts[name])}, cwd, own_cache)
    runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for context in CONTEXTS:
            for name, (cwd, own_cache) in checkouts.items():
                spec = {"task": "ours", "artifact": str(artifacts[name]), "batch": BATCH, "context": context}
                result = run_worker({**spec, "steps": steps}, cwd, own_cache)
                runs.setdefault(f"{name}@{context}", []).append(result["median_ms"])
    block = NeuronConfig(batch_size=BATCH, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK).block_size
    windows = {context: 256 if context < 256 else SEQUENCE_LENGTH for context in CONTEXTS}
    attention = {context: attention_ms(window, block, int8=False)["fp32"] for context, window in windows.items()}
    gathers = {context: gather_ms(window, block) for context, window in windows.items()}
    load = os.getloadavg()[0]
    return {"runs": runs, "block_size": block, "attention_ms": attention, "gather_ms": gathers, "load": load}


def export_artifact(model_dir: str, **fields: Any) -> Path:
    """SmolLM2 exported with ``fields`` (inductor): its export cache entry, exported on first use."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    return cached_export(model_dir, NeuronConfig(**fields))


def bench(artifact: Path, model_dir: str, flags: list[str], load: list[str], prompts: int) -> dict[str, Any]:
    """``vllm serve artifact *flags`` on 127.0.0.1 driven by ``vllm bench serve *load``; its result (summary)."""
    from benchmark.serving.server import SERVED_NAME, serving, vllm_cli

    with tempfile.TemporaryDirectory() as folder:
        log, result = Path(folder) / "serve.log", Path(folder) / "result.json"
        with serving(artifact, log, "--served-model-name", SERVED_NAME, "--seed", "0", *flags) as server:
            cmd = [
                vllm_cli(), "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(server.port),
                "--model", SERVED_NAME, "--tokenizer", model_dir, "--seed", "0", "--num-prompts", str(prompts),
                "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", folder,
                "--result-filename", result.name, "--disable-tqdm", *load,
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
            if done.returncode != 0 or not result.is_file():
                raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        data = json.loads(result.read_text())
    if data.get("completed") != prompts:
        raise RuntimeError(f"{data.get('completed')} of {prompts} requests completed")
    keys = ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "median_itl_ms", "duration")
    return {key: data[key] for key in keys} | {"load": os.getloadavg()[0]}


def prefix(model_dir: str, rounds: int, quick: bool) -> dict[str, Any]:
    """Shared-prefix chat traffic with prefix caching on and off, interleaved rounds."""
    artifact = export_artifact(model_dir, batch_size=BATCH, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK)
    prompts = 16 if quick else 32
    load = [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
        "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "2",
        "--prefix-repetition-output-len", "32", "--max-concurrency", "4",
    ]  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for _ in range(rounds):
        for mode, flags in (("on", []), ("off", ["--no-enable-prefix-caching"])):
            runs[mode].append(bench(artifact, model_dir, flags, load, prompts))
    return runs


def chunk_worker(artifact: str, repeats: int) -> dict[str, float]:
    """Median ms of the prefill call holding each of `TAILS` last tokens of a prompt after `PREFIX` prefilled ones (a
    fresh prompt each time, so nothing comes from the prefix cache), the first sample of a tail a warm-up."""
    import torch

    from optimum.neuron import NeuronModelForCausalLM
    from optimum.neuron.runtime.sampling import SamplingParams

    engine = NeuronModelForCausalLM.from_pretrained(artifact).engine
    generator = torch.Generator().manual_seed(0)
    result = {}
    for tail in TAILS:
        times = []
        for _ in range(repeats + 1):
            prompt = torch.randint(100, 40000, (PREFIX + tail,), generator=generator).tolist()
            engine.admit("prompt", prompt, SamplingParams(), reuse=False)
            engine.step({"prompt": PREFIX})
            start = time.perf_counter()
            engine.step({"prompt": tail})
            times.append(time.perf_counter() - start)
            engine.release("prompt")
        result[str(tail)] = 1000 * statistics.median(times[1:])
    return result


def chunks(model_dir: str, rounds: int, quick: bool) -> dict[str, Any]:
    """A prompt tail's prefill call with and without chunk-length buckets, interleaved rounds of fresh processes."""
    shape = {"batch_size": BATCH, "sequence_length": SEQUENCE_LENGTH, "prefill_chunk_size": CHUNK}
    artifacts = {name: export_artifact(model_dir, **shape, chunk_buckets=name) for name in ("auto", "none")}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in artifacts}
    repeats = 3 if quick else 5
    for _ in range(rounds):
        for name, artifact in artifacts.items():
            cmd = [sys.executable, "-m", "benchmark.paged", "--chunk-worker", str(artifact), "--repeats", str(repeats)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
            if done.returncode != 0:
                raise RuntimeError(f"the chunk worker on {artifact} failed:\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"runs": runs, "repeats": repeats, "load": os.getloadavg()[0]}


def fit(model_dir: str, rounds: int, quick: bool) -> dict[str, Any]:
    """32 concurrent short chats: a batch-32 artifact whose pool is 8 x 4096 tokens vs the batch-8 one."""
    shape = {"sequence_length": 4096, "prefill_chunk_size": CHUNK, "kv_cache_tokens": 8 * 4096}
    artifacts = {
        "batch 32, pool 8 x 4096": export_artifact(model_dir, batch_size=32, **shape),
        "batch 8, pool 8 x 4096": export_artifact(model_dir, batch_size=8, **shape),
    }
    prompts = 32 if quick else 64
    load = ["--dataset-name", "random", "--random-input-len", "100", "--random-output-len", "100"]
    load += ["--max-concurrency", "32"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in artifacts}
    for _ in range(rounds):
        for name, artifact in artifacts.items():
            runs[name].append(bench(artifact, model_dir, [], load, prompts))
    return runs


def kv_int8(model_dir: str, rounds: int, steps: int, quick: bool, long: bool = False) -> dict[str, Any]:
    """Decode ms/step of fp32-KV and int8-KV artifacts at each of `KV_BATCHES` (all rows live), interleaved rounds of
    fresh processes, after `KV_CONTEXT` tokens (``long``: `KV_LONG_CONTEXT`); the bytes of each cache."""
    from optimum.neuron.artifact import Artifact, allocate_cache
    from optimum.neuron.models.layers.kv_cache import cache_bytes as kv_cache_bytes

    backend, context = ("eager", 64) if quick else ("inductor", KV_LONG_CONTEXT if long else KV_CONTEXT)
    sequence_length = KV_LONG_SEQUENCE_LENGTH if long else KV_SEQUENCE_LENGTH
    fields = {"sequence_length": sequence_length, "prefill_chunk_size": CHUNK, "backend": backend}
    artifacts = {
        (kv, batch): export_artifact(model_dir, **fields, batch_size=batch, kv_cache_dtype=kv, decode_logits=False)
        for kv in ("auto", "int8")
        for batch in KV_BATCHES
    }
    runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for batch in KV_BATCHES:
            for kv in ("auto", "int8"):
                spec = {"task": "ours", "artifact": str(artifacts[(kv, batch)]), "batch": batch, "context": context}
                runs.setdefault(f"{kv}@{batch}", []).append(run_worker({**spec, "steps": steps})["median_ms"])
    cache_bytes = {}
    for kv in ("auto", "int8"):
        artifact = Artifact.open(artifacts[(kv, KV_BATCHES[-1])])
        cache = allocate_cache(artifact.hf_config(), artifact.config, "cpu")
        cache_bytes[kv] = kv_cache_bytes(cache)
    load = os.getloadavg()[0]
    return {
        "runs": runs,
        "backend": backend,
        "context": context,
        "sequence_length": sequence_length,
        "cache_bytes": cache_bytes,
        "load": load,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, fewer steps and requests")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--baseline", default=BASELINE, help="the commit whose slot layout `price` compares with")
    parser.add_argument("--machine", default="epyc-2core", help="results subfolder name")
    parser.add_argument("--chunk-worker", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.chunk_worker:
        print(json.dumps(chunk_worker(args.chunk_worker, args.repeats)))
        return
    from rich.progress import Progress

    from benchmark.machine import describe
    from benchmark.paged_report import write_report
    from optimum.neuron.cache_dir import cache_root
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    model_dir = str(convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32"))
    cache = cache_root() / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    rounds = 1 if args.quick else 2
    results: dict[str, Any] = {"machine": describe(), "rounds": rounds, "baseline": args.baseline}
    with Progress() as progress:
        task = progress.add_task("paged KV benchmark", total=len(args.parts))
        for part in args.parts:
            progress.update(task, description=f"paged KV benchmark: {part}")
            if part == "blocks":
                results["blocks"] = block_sizes()
            elif part == "price":
                baseline = baseline_checkout(args.baseline, cache)
                results["price"] = price(model_dir, baseline, cache, rounds, 8 if args.quick else 16)
            elif part == "prefix":
                results["prefix"] = prefix(model_dir, rounds, args.quick)
            elif part == "chunks":
                results["chunks"] = chunks(model_dir, rounds, args.quick)
            elif part in ("kvint8", "kvint8-long"):
                results[part] = kv_int8(model_dir, rounds, 4 if args.quick else 16, args.quick, part == "kvint8-long")
            else:
                results["fit"] = fit(model_dir, rounds, args.quick)
            progress.advance(task)
    results["machines"] = dict.fromkeys(args.parts, results["machine"])
    earlier = earlier_parts(RESULTS / args.machine, args.parts)
    results["machines"] = earlier.pop("machines", {}) | results["machines"]
    write_report(RESULTS / args.machine, earlier | results)


def earlier_parts(folder: Path, run: list[str]) -> dict[str, Any]:
    """The parts of the committed ``paged.json`` this run did not measure, so parts may be run one at a time, and
    under ``machines`` the machine each was measured on (a file from before parts recorded theirs: its one machine)."""
    path = folder / "paged.json"
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    kept = {part: earlier[part] for part in PARTS if part in earlier and part not in run}
    machines = earlier.get("machines", {})
    return kept | {"machines": {part: machines.get(part, earlier["machine"]) for part in kept}}


if __name__ == "__main__":
    main()
