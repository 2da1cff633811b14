"""llama.cpp's own benchmark tool on the run's GGUF (F32, or the Q8_0 / Q4_0 that ``llama-quantize`` made of it):
``llama-bench -t 2 -p 256,1024 -n 128``, one fresh process per round. Its prompt-processing tests (pp256, pp1024) are
prefills of that many tokens from an empty context (no sampling); its token-generation test (tg128) decodes 128 tokens
one at a time from an empty context. `perplexity` runs ``llama-perplexity`` (`benchmark.peer_quality`)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmark.peerbench.layout import Layout

THREADS = 2


def command(layout: Layout, prompt_lengths: list[int], new_tokens: int, repetitions: int) -> list[str]:
    """The ``llama-bench`` command line: 2 threads, JSON output. Its K/V cache stays at its default, f16:
    llama-bench accepts no f32 cache type (``-ctk`` takes f16, bf16 and quantized types only)."""
    return [
        str(layout.llama_bench),
        "-m",
        str(layout.gguf),
        "-t",
        str(THREADS),
        "-p",
        ",".join(map(str, prompt_lengths)),
        "-n",
        str(new_tokens),
        "-r",
        str(repetitions),
        "-o",
        "json",
    ]


def parse(tests: list[dict[str, Any]]) -> dict[str, Any]:
    """Our figures from llama-bench's JSON: ms per generated token and ms per prefill of each length (the median
    of its repetitions), and the build it reports."""
    out: dict[str, Any] = {"prefill_ms": {}}
    for test in tests:
        ms = 1e-6 * statistics.median(test["samples_ns"])
        if test["n_gen"] > 0 and test["n_prompt"] == 0:
            out["decode_ms"] = ms / test["n_gen"]
        elif test["n_prompt"] > 0 and test["n_gen"] == 0:
            out["prefill_ms"][str(test["n_prompt"])] = ms
    first = tests[0]
    out["build"] = f"b{first.get('build_number')} ({first.get('build_commit')})"
    out["backend"] = f"{first.get('backends')}, {first.get('type_k')}/{first.get('type_v')} KV, {first.get('cpu_info')}"
    return out


def run(layout: Layout, prompt_lengths: list[int], new_tokens: int, repetitions: int) -> dict[str, Any]:
    """One round: ``llama-bench`` in a fresh process; its parsed figures."""
    for path in (layout.llama_bench, layout.gguf):
        if not Path(path).is_file():
            raise layout.missing(f"llama.cpp ({path})")
    done = subprocess.run(command(layout, prompt_lengths, new_tokens, repetitions), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return parse(json.loads(done.stdout))


def perplexity(layout: Layout, text: Path, context: int) -> dict[str, Any]:
    """llama.cpp's own perplexity of ``text`` (``llama-perplexity -c context``, 2 threads): its protocol, not ours
    (each window of ``context`` tokens scores only its second half), so compare its formats with each other."""
    for path in (layout.llama_perplexity, layout.gguf):
        if not Path(path).is_file():
            raise layout.missing(f"llama.cpp ({path})")
    cmd = [str(layout.llama_perplexity), "-m", str(layout.gguf), "-f", str(text), "-c", str(context)]
    done = subprocess.run([*cmd, "-t", str(THREADS)], capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed (exit {done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return {"perplexity": float(found.group(1))}
