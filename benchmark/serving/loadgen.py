"""The load generator: vLLM's own `vllm bench serve` (random dataset, fixed seed) against a running server,
alone or two at once (the mixed workload: short chats while long prompts arrive)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmark.serving.configs import Load
from benchmark.serving.server import SERVED_NAME, vllm_cli

PERCENTILES = "50,90,99"


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


def _start(
    load: Load,
    port: int,
    tokenizer: Path,
    result: Path,
    seed: int,
    request_rate: float | None = None,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    cmd = bench_command(load, port, tokenizer, result, seed) + list(extra)
    if request_rate is not None:  # evenly spaced arrivals, the first one 1 / rate after the run starts
        cmd += ["--request-rate", str(request_rate), "--burstiness", "inf"]
    with result.with_suffix(".log").open("wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its log shows when it starts sending
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _finish(proc: subprocess.Popen[bytes], result: Path, expected: int) -> dict[str, Any]:
    if proc.wait() != 0 or not result.is_file():
        raise LoadError(f"vllm bench serve failed (status {proc.returncode}): see {result.with_suffix('.log')}")
    data: dict[str, Any] = json.loads(result.read_text())
    if data.get("completed") != expected:
        raise LoadError(f"{data.get('completed')} of {expected} requests completed: see {result.with_suffix('.log')}")
    return data


def run_load(
    load: Load, port: int, tokenizer: Path, result: Path, seed: int = 0, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Drive ``load`` against the server on ``port`` (``extra``: more `vllm bench serve` flags); its result (summary +
    per request)."""
    return _finish(_start(load, port, tokenizer, result, seed, extra=extra), result, load.prompts)


def wait_started(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> float:
    """Block until the `vllm bench serve` writing ``log`` has started up and sends its requests; the seconds
    that took (it imports vLLM and builds its prompts first: several seconds of CPU on a small machine)."""
    start = time.monotonic()
    while "Starting main benchmark run" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() - start > timeout_s:
            raise LoadError(f"vllm bench serve did not start its run: see {log}")
        time.sleep(0.1)
    return time.monotonic() - start


def run_idle(load: Load, port: int, tokenizer: Path, result: Path, seed: int) -> tuple[dict[str, Any], float]:
    """`run_load`, plus how long the client took to start sending."""
    proc = _start(load, port, tokenizer, result, seed)
    startup = wait_started(proc, result.with_suffix(".log"))
    return _finish(proc, result, load.prompts), startup


def run_mixed(
    chats: Load, arrivals: Load, interval_s: float, port: int, tokenizer: Path, folder: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Short chats while long prompts arrive every ``interval_s`` seconds, against one server: both results.

    The long prompts' client starts first and, once up, sleeps ``interval_s`` before its first arrival;
    the chats' client is started then. With ``interval_s`` longer than a client's start-up, the long
    prompts arrive while the chats decode and neither client's start-up competes with measured requests.
    """
    arrivals_result, chats_result = folder / "mixed-arrivals.json", folder / "mixed-chats.json"
    long_proc = _start(arrivals, port, tokenizer, arrivals_result, seed=2, request_rate=1 / interval_s)
    wait_started(long_proc, arrivals_result.with_suffix(".log"))
    chat_proc = _start(chats, port, tokenizer, chats_result, seed=1)
    return _finish(chat_proc, chats_result, chats.prompts), _finish(long_proc, arrivals_result, arrivals.prompts)
