"""Peers on the same machine and workload, each in a fresh process: transformers ``generate`` (eager, one
padded batch per round of users: what a user would pick first) and llama.cpp through ``llama-cpp-python``
on the model's GGUF (one sequence at a time: its Python API decodes one sequence per context).

    python -m benchmark.serving.peers '{"peer": "transformers", ...}'    # prints one JSON summary
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy
import torch

from benchmark.serving.configs import Load
from optimum.neuron.config import DTYPES


def random_prompts(vocab_size: int, load: Load, seed: int = 0) -> list[list[int]]:
    """``load.prompts`` fixed-seed random token-id prompts with lengths in ``input_len`` +- ``range_ratio``."""
    generator = torch.Generator().manual_seed(seed)
    low, high = int(load.input_len * (1 - load.range_ratio)), int(load.input_len * (1 + load.range_ratio))
    first = 3 if vocab_size < 1000 else 100
    lengths = torch.randint(low, high + 1, (load.prompts,), generator=generator).tolist()
    return [torch.randint(first, vocab_size - 1, (n,), generator=generator).tolist() for n in lengths]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), numpy's linear interpolation (as `vllm bench serve` computes them)."""
    return float(numpy.percentile(values, q))


def summary(
    tokens: int, wall_s: float, ttfts_s: list[float], itls_s: list[float], e2els_s: list[float]
) -> dict[str, Any]:
    """The metrics the report reads, named like `vllm bench serve`'s."""
    ms = [1000 * t for t in ttfts_s], [1000 * t for t in itls_s]
    out: dict[str, Any] = {"output_throughput": tokens / wall_s, "duration": wall_s, "total_output_tokens": tokens}
    for q in (50, 90, 99):
        out[f"p{q}_ttft_ms"] = percentile(ms[0], q)
        out[f"p{q}_itl_ms"] = percentile(ms[1], q) if ms[1] else float("nan")
    out["mean_e2el_ms"] = 1000 * statistics.mean(e2els_s)
    return out


def transformers_peer(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers eager ``generate``: each round of ``users`` prompts as one left-padded batch, greedy,
    exactly ``output_len`` new tokens. Every token of a batch arrives at once, so a request's TTFT is its
    batch's prefill + first step (measured on the first round) and its ITL the batch's mean step time."""
    from transformers import AutoModelForCausalLM

    load = Load(**spec["load"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=DTYPES[spec["dtype"]]).eval()
    prompts = random_prompts(model.config.vocab_size, load)
    rounds = [prompts[i : i + load.users] for i in range(0, len(prompts), load.users)]

    def generate(batch: list[list[int]], new: int) -> float:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - start

    ttft = generate(rounds[0], 1)
    walls = [generate(batch, load.output_len) for batch in rounds]
    itl = [(w - ttft) / (load.output_len - 1) for w in walls]
    n = load.prompts
    return summary(n * load.output_len, sum(walls), [ttft] * n, [i for i in itl for _ in range(n)], walls)


def llama_cpp_peer(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp (``llama-cpp-python``) on the GGUF, greedy, prompts served one after another."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(
            "llama-cpp-python is not installed: `make bench` installs it (pip builds it from source, several minutes)"
        ) from None
    load = Load(**spec["load"])
    threads = os.cpu_count() or 1
    llm = Llama(
        model_path=spec["gguf"], n_ctx=spec["sequence_length"], n_threads=threads, n_batch=512, seed=0, verbose=False
    )
    prompts = random_prompts(llm.n_vocab(), load)
    ttfts, itls, e2els = [], [], []
    start_all = time.perf_counter()
    for prompt in prompts:
        start, stamps = time.perf_counter(), []
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == load.output_len:
                break
        ttfts.append(stamps[0] - start)
        itls += [b - a for a, b in itertools.pairwise(stamps)]
        e2els.append(stamps[-1] - start)
    return summary(len(prompts) * load.output_len, time.perf_counter() - start_all, ttfts, itls, e2els)


def run_peer(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one peer in a fresh interpreter; its summary, or ``{"error": why}`` when it cannot run here."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmark.serving.peers", json.dumps(spec)], capture_output=True, text=True
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": last}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    peer = {"transformers": transformers_peer, "llama.cpp": llama_cpp_peer}[spec["peer"]]
    print(json.dumps(peer(spec)))


if __name__ == "__main__":
    main()
