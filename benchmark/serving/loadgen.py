"""The load generator: vLLM's own `vllm bench serve` (random dataset, fixed seed) against a running server,
alone or two at once (the mixed workload: short chats while long prompts arrive)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmark.serving.configs import Load
from benchmark.serving.server import SERVED_NAME, vllm_cli

PERCENTILES = "50,90,99"
RUNNING_GAUGE = "vllm:num_requests_running{"


class LoadError(RuntimeError):
    """`vllm bench serve` failed or reported failed requests; the message names its log."""


def bench_command(load: Load, port: int, tokenizer: Path, result: Path, seed: int) -> list[str]:
    """The `vllm bench serve` command line for ``load``; per-request details are saved in ``result``."""
    return [
        vllm_cli(), "bench", "serve",
        "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
        "--model", SERVED_NAME, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--seed", str(seed),
        "--num-prompts", str(load.prompts), "--max-concurrency", str(load.users),
        "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
        "--random-range-ratio", str(load.range_ratio),
        "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
        "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip


def _start(load: Load, port: int, tokenizer: Path, result: Path, seed: int) -> subprocess.Popen[bytes]:
    log = result.with_suffix(".log").open("wb")
    return subprocess.Popen(bench_command(load, port, tokenizer, result, seed), stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[bytes], result: Path, expected: int) -> dict[str, Any]:
    if proc.wait() != 0 or not result.is_file():
        raise LoadError(f"vllm bench serve failed (status {proc.returncode}): see {result.with_suffix('.log')}")
    data: dict[str, Any] = json.loads(result.read_text())
    if data.get("completed") != expected:
        raise LoadError(f"{data.get('completed')} of {expected} requests completed: see {result.with_suffix('.log')}")
    return data


def run_load(load: Load, port: int, tokenizer: Path, result: Path, seed: int = 0) -> dict[str, Any]:
    """Drive ``load`` against the server on ``port``; `vllm bench serve`'s result (summary + per request)."""
    return _finish(_start(load, port, tokenizer, result, seed), result, load.prompts)


def running_requests(port: int) -> float:
    """The server's ``vllm:num_requests_running`` gauge (its Prometheus ``/metrics``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(RUNNING_GAUGE))


def wait_running(port: int, count: int, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    """Block until ``count`` requests run on the server (the chats are decoding), or fail if ``proc`` ended."""
    deadline = time.monotonic() + timeout_s
    while running_requests(port) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise LoadError(f"the chats never had {count} requests running on the server")
        time.sleep(0.05)


def run_mixed(
    chats: Load, arrivals: Load, delay_s: float, port: int, tokenizer: Path, folder: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Short chats, and ``delay_s`` after all of them run on the server, long prompts, at once against one
    server: both results. (The long prompts' client is started then; its own start-up adds a few seconds.)"""
    chat_proc = _start(chats, port, tokenizer, folder / "mixed-chats.json", seed=1)
    wait_running(port, chats.users, chat_proc)
    time.sleep(delay_s)
    long_proc = _start(arrivals, port, tokenizer, folder / "mixed-arrivals.json", seed=2)
    return (
        _finish(chat_proc, folder / "mixed-chats.json", chats.prompts),
        _finish(long_proc, folder / "mixed-arrivals.json", arrivals.prompts),
    )
