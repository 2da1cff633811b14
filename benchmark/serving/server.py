"""`vllm serve` on 127.0.0.1 for one artifact, the one launcher of the benchmark and the tests: started in
its own process group on a free port (unless one is given), awaited until healthy, then stopped
(SIGTERM to the group, SIGKILL to whatever is left) so nothing outlives it. What a graceful stop left
running is recorded, with where each such process was waiting (its Python stacks), for the tests that check a clean
shutdown."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SERVED_NAME = "bench"
"""The model name the benchmark's load generator asks for, whatever the artifact's path."""


class ServerError(RuntimeError):
    """`vllm serve` exited or never became healthy; the message names its log and quotes its end."""


@dataclass
class ServerProcess:
    """A `vllm serve` started by `serving`."""

    port: int
    log: Path
    pid: int = 0
    """The `vllm serve` process (its process group's leader)."""
    left_behind: list[str] = field(default_factory=list)
    """The processes still running after the graceful stop (then killed), each as ``pid name (status, parent
    ppid)``; filled when `serving` exits."""
    stacks: str = ""
    """The Python stacks of those processes just before they were killed (`_stacks`); empty when none was left."""
    returncode: int | None = None
    """The exit status of `vllm serve`; filled when `serving` exits (0 after a graceful stop)."""
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def wait(self, timeout_s: float) -> int:
        """Wait for `vllm serve` to exit on its own (``subprocess.TimeoutExpired`` after ``timeout_s``); its status."""
        assert self.popen is not None, "the server is started by `serving`"
        return self.popen.wait(timeout_s)


def vllm_cli() -> str:
    """The `vllm` command of this interpreter's environment."""
    return str(Path(sys.executable).with_name("vllm"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.is_file() else ""


def _wait_healthy(proc: subprocess.Popen[bytes], server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(server.port):
        if proc.poll() is not None:
            raise ServerError(
                f"vllm serve exited with status {proc.returncode} before it was ready ({server.log}):\n"
                f"{_log_tail(server.log)}"
            )
        if time.monotonic() > deadline:
            tail = _log_tail(server.log)
            raise ServerError(f"vllm serve not healthy after {timeout_s:.0f} s ({server.log}):\n{tail}")
        time.sleep(0.5)


GRACE_S = 60.0
"""How long a graceful stop may take before what is left is killed."""


def _exited(process: psutil.Process) -> bool:
    """Whether ``process`` has ended: gone, or a zombie (ended, its status not yet collected by its parent)."""
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _describe(process: psutil.Process) -> str:
    """``pid name (status, parent ppid)`` of a process that outlived the graceful stop, for the failure message."""
    try:
        with process.oneshot():
            return f"{process.pid} {process.name()} ({process.status()}, parent {process.ppid()})"
    except psutil.NoSuchProcess:
        return f"{process.pid} (ended while described)"


STACK_DUMP_S = 30.0
"""How long `_stacks` waits for one process's stacks."""


def _py_spy() -> str | None:
    """The ``py-spy`` beside this interpreter (the dev extra installs it in .venv), else on PATH, else None."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _stacks(pids: list[int]) -> str:
    """The Python stacks of ``pids`` (``py-spy dump``, every thread): where each process that outlived the graceful
    stop was waiting. A process whose stacks could not be read says why instead."""
    tool = _py_spy()
    if tool is None:
        return "(no stacks: py-spy is not installed; `make install` installs it with the dev extra)"
    dumps = []
    for pid in pids:
        try:
            done = subprocess.run(
                [tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=STACK_DUMP_S
            )
            dumps.append(done.stdout.strip() or f"{pid}: py-spy exit {done.returncode}: {done.stderr.strip()}")
        except subprocess.TimeoutExpired:
            dumps.append(f"{pid}: py-spy dump took more than {STACK_DUMP_S:.0f} s")
    return "\n\n".join(dumps)


def _stop(proc: subprocess.Popen[bytes]) -> tuple[list[str], str]:
    """SIGTERM the process group, wait up to `GRACE_S` for every process of the tree to end, SIGKILL what is left;
    the processes that outlived the SIGTERM, described, and their stacks (`_stacks`: taken before the SIGKILL).
    `proc` itself is waited for by ``Popen`` (its ``returncode`` is the real exit status: psutil must not collect it
    first), its descendants by psutil."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(GRACE_S)
    alive = [p for p in descendants if not _exited(p)]
    while alive and time.monotonic() < deadline:
        psutil.wait_procs(alive, timeout=0.5)
        alive = [p for p in alive if not _exited(p)]
    outlived = ([] if proc.returncode is not None else [psutil.Process(proc.pid)]) + alive
    left = [_describe(p) for p in outlived]
    stacks = _stacks([p.pid for p in outlived]) if outlived else ""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (the engine core)
    for stray in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            stray.kill()
    proc.wait()
    return left, stacks


@contextlib.contextmanager
def serving(artifact: Path, log: Path, *flags: str, port: int = 0, timeout_s: float = 900) -> Iterator[ServerProcess]:
    """Serve ``artifact`` on 127.0.0.1 (``port``, or a free one) with extra ``flags`` for the duration of
    the block; server output goes to ``log``."""
    server = ServerProcess(port or free_port(), log)
    cmd = [vllm_cli(), "serve", str(artifact), "--host", "127.0.0.1", "--port", str(server.port), *flags]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    server.pid, server.popen = proc.pid, proc
    try:
        _wait_healthy(proc, server, timeout_s)
        yield server
    finally:
        server.left_behind, server.stacks = _stop(proc)
        server.returncode = proc.returncode
