"""A real ``vllm serve`` process on 127.0.0.1 for tests (started by the benchmark's launcher on a free port,
waited for with a bounded timeout, stopped whatever the test does; a clean stop must leave no process of
its tree behind), and a small client of its OpenAI-compatible API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from benchmark.serving.server import ServerProcess, serving

STARTUP_SECONDS = 300
REQUEST_SECONDS = 120


class Server:
    """A running server: JSON and streaming POSTs to its OpenAI-compatible API."""

    def __init__(self, process: ServerProcess) -> None:
        self.base = f"http://127.0.0.1:{process.port}"
        self.log = process.log
        self.process = process
        """The `vllm serve` process (its pid; its exit status once the ``vllm_serve`` block has ended)."""

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=REQUEST_SECONDS) as response:
            return json.loads(response.read())

    def get_status(self, path: str) -> int:
        """HTTP status of a GET (an unreachable server: 0)."""
        try:
            with urllib.request.urlopen(self.base + path, timeout=REQUEST_SECONDS) as response:
                return int(response.status)
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

    def post(self, path: str, body: dict[str, Any]) -> Any:
        with urllib.request.urlopen(self._request(path, body), timeout=REQUEST_SECONDS) as response:
            return json.loads(response.read())

    def post_error(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """Status and body of a request that must fail."""
        return self.post_raw(path, json.dumps(body).encode())

    def post_raw(self, path: str, data: bytes) -> tuple[int, str]:
        """Status and body of a POST of ``data`` as it is (e.g. JSON that ``json.dumps`` would not write)."""
        request = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except TimeoutError as err:
            raise AssertionError(
                f"POST {path}: no answer in {REQUEST_SECONDS} s; the server log ends:\n{self.log_tail()}"
            ) from err

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server's log (what it was doing when a request went unanswered)."""
        return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-lines:])

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Each worker's answer to ``method`` (vLLM's ``/collective_rpc``: needs ``VLLM_SERVER_DEV_MODE=1``)."""
        return list(self.post("/collective_rpc", {"method": method, "args": list(args)})["results"])

    def stream(
        self, path: str, body: dict[str, Any], on_event: Callable[[int], object] | None = None
    ) -> list[dict[str, Any]]:
        """The server-sent events of a ``stream: true`` request, ``[DONE]`` excluded; ``on_event(n)`` is called
        after the n-th event arrived."""
        events = []
        with urllib.request.urlopen(self._request(path, {**body, "stream": True}), timeout=REQUEST_SECONDS) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
                    if on_event is not None:
                        on_event(len(events))
        return events

    def engine_core(self) -> psutil.Process:
        """The engine-core process of this server (vLLM titles it ``VLLM::EngineCore``)."""
        children = psutil.Process(self.process.pid).children()
        (core,) = [p for p in children if "EngineCore" in " ".join(p.cmdline())]
        return core

    def _request(self, path: str, body: dict[str, Any]) -> urllib.request.Request:
        data = json.dumps(body).encode()
        return urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})


@contextmanager
def vllm_serve(artifact: Path, log: Path, *flags: str, exit_status: int = 0) -> Iterator[Server]:
    """``vllm serve artifact`` on 127.0.0.1 (the benchmark's launcher, `benchmark.serving.server.serving`);
    yields once ``/health`` answers. After the block, a graceful stop must have left no process behind and
    ``vllm serve`` must have exited with ``exit_status`` (0 for a graceful stop; a test that kills the engine core
    expects `supervision.ENGINE_DIED_EXIT_CODE`)."""
    with serving(artifact, log, *flags, timeout_s=STARTUP_SECONDS) as process:
        yield Server(process)
    assert not process.left_behind, (
        f"vllm serve left processes behind: {process.left_behind}; its shutdown log:\n{_shutdown_lines(log)}\n"
        f"their Python stacks before the kill:\n{process.stacks}"
    )
    assert process.returncode == exit_status, f"vllm serve exited with {process.returncode}, not {exit_status}"


def _shutdown_lines(log: Path, lines: int = 40) -> str:
    """``lines`` lines of a server log from its first ``[shutdown]`` line on (what each process did while
    the server stopped)."""
    text = log.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(text) if "[shutdown]" in line), max(0, len(text) - lines))
    return "\n".join(text[start : start + lines])
