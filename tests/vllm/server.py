"""A real ``vllm serve`` process on 127.0.0.1 for tests (started by the benchmark's launcher on a free port,
waited for with a bounded timeout, stopped whatever the test does; a clean stop must leave no process of
its tree behind), and a small client of its OpenAI-compatible API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmark.serving.server import serving

STARTUP_SECONDS = 300
REQUEST_SECONDS = 120


class Server:
    """A running server: JSON and streaming POSTs to its OpenAI-compatible API."""

    def __init__(self, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log = log

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
    """``vllm serve artifact`` on 127.0.0.1 (the benchmark's launcher, `benchmark.serving.server.serving`);
    yields once ``/health`` answers. After the block, a graceful stop must have left no process behind."""
    with serving(artifact, log, *flags, timeout_s=STARTUP_SECONDS) as process:
        yield Server(process.port, log)
    assert not process.left_behind, f"vllm serve left processes behind: {process.left_behind}"
