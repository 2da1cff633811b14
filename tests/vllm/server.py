"""A real ``vllm serve`` process on 127.0.0.1 for tests: started on a free port, waited for with a
bounded timeout, stopped (terminate, then kill) whatever the test does; a clean stop leaves no
process of its tree behind (checked)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

STARTUP_SECONDS = 300
REQUEST_SECONDS = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A running server: JSON and streaming POSTs to its OpenAI-compatible API."""

    def __init__(self, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log = log

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=REQUEST_SECONDS) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        with urllib.request.urlopen(self._request(path, body), timeout=REQUEST_SECONDS) as response:
            return json.loads(response.read())

    def post_error(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """Status and body of a request that must fail."""
        try:
            with urllib.request.urlopen(self._request(path, body), timeout=REQUEST_SECONDS) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The server-sent events of a ``stream: true`` request, ``[DONE]`` excluded."""
        events = []
        with urllib.request.urlopen(self._request(path, {**body, "stream": True}), timeout=REQUEST_SECONDS) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
        return events

    def _request(self, path: str, body: dict[str, Any]) -> urllib.request.Request:
        data = json.dumps(body).encode()
        return urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})


@contextmanager
def vllm_serve(artifact: Path, log: Path, *flags: str) -> Iterator[Server]:
    """``vllm serve artifact`` on 127.0.0.1; yields once ``/health`` answers, stops the server after."""
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", str(artifact), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *flags]
    with log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    server = Server(port, log)
    try:
        _wait_healthy(server, process)
        yield server
    finally:
        children = psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _, alive = psutil.wait_procs(children, timeout=30)
        for stray in alive:
            stray.kill()
    assert not alive, f"vllm serve left processes behind: {[p.pid for p in alive]}"


def _wait_healthy(server: Server, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vllm serve exited with {process.returncode}:\n{server.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(server.base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"vllm serve not healthy after {STARTUP_SECONDS}s:\n{server.log.read_text()[-4000:]}")
