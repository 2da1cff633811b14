"""Test helpers: `subprocess_test` runs a test alone in a fresh interpreter; `HAS_TORCH_XLA`; `tile_one_arena`."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

_CHILD = "OPTIMUM_NEURON_IN_SUBPROCESS"
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
"""True in .venv-xla (make install-xla), where the tests marked ``xla`` run."""


def subprocess_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Re-run the decorated test alone in a fresh ``pytest`` process (vLLM engines, compiled runners
    and distributed groups hold process-global state). The parent fails with the child's output."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(_CHILD) == "1":
            return fn(*args, **kwargs)
        node = _without_xdist_group(os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0])
        env = {**os.environ, _CHILD: "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", node]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise AssertionError(
                f"subprocess test {node} failed:\n{_failure_report(done.stdout)}\n{done.stderr[-3000:]}"
            )
        assert " passed" in done.stdout, f"subprocess test {node} did not run:\n{done.stdout[-2000:]}"
        return None

    return wrapper


def _without_xdist_group(node: str) -> str:
    """The node id pytest can select: under ``--dist loadgroup`` xdist appends ``@<group>`` to the ids of
    grouped tests (after any parametrization brackets)."""
    return node[: node.rfind("@")] if node.rfind("@") > node.rfind("]") else node


def _failure_report(stdout: str) -> str:
    """The child's failure section (where the assertion is), not the tail of the logs captured after it."""
    start = stdout.find("= FAILURES =")
    report = stdout[start:] if start >= 0 else stdout
    return report[:8000] + ("\n[...]\n" + report[-2000:] if len(report) > 10000 else report[8000:])


def settled(read: Callable[[], Any], want: Any, seconds: float = 10.0) -> Any:
    """``read()`` once it returns ``want``, or its last answer after ``seconds``: for state a server settles on by
    itself just after answering. Under vLLM's async scheduling, the step that releases the KV slots of the requests
    that finished last runs after their outputs were returned (a slot never released still fails the check)."""
    deadline = time.monotonic() + seconds
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def tile_one_arena(tensors: Sequence[Any]) -> bool:
    """Whether ``tensors`` lie one after the other in memory, in the order given, from a 2 MiB boundary: each starts at
    most one alignment step (`kernels.huge_pages.ALIGN`) after the previous one's end, as in one huge-pages arena."""
    from optimum.neuron.kernels.huge_pages import ALIGN, HUGE_PAGE

    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors]
    return spans[0][0] % HUGE_PAGE == 0 and all(
        end <= start < end + ALIGN for (_, end), (start, _) in itertools.pairwise(spans)
    )
