"""`vllm serve` on 127.0.0.1 for one artifact: started, awaited until healthy, stopped with its whole
process group (the engine core included) so nothing outlives a configuration."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

SERVED_NAME = "bench"
"""The model name the load generator asks for, whatever the artifact's path."""


class ServerError(RuntimeError):
    """`vllm serve` exited or never became healthy; the message names its log."""


def vllm_cli() -> str:
    """The `vllm` command of this interpreter's environment."""
    return str(Path(sys.executable).with_name("vllm"))


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(port):
        if proc.poll() is not None:
            raise ServerError(f"vllm serve exited with status {proc.returncode} before it was ready: see {log}")
        if time.monotonic() > deadline:
            raise ServerError(f"vllm serve not healthy after {timeout_s:.0f} s: see {log}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (engine core)
    proc.wait()


@contextlib.contextmanager
def serving(artifact: Path, port: int, log: Path, timeout_s: float = 900) -> Iterator[None]:
    """Serve ``artifact`` on 127.0.0.1:``port`` for the duration of the block; server output goes to ``log``."""
    cmd = [vllm_cli(), "serve", str(artifact), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--seed", "0"]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(proc, port, log, timeout_s)
        yield
    finally:
        _stop(proc)
