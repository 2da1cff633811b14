"""The benchmark's `vllm serve` launcher stops a process tree: SIGTERM to the group, what outlives it is named, its
Python stacks are taken, then it is killed; an ended child its parent has not collected yet (a zombie) counts as
ended."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmark.serving import server

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
KEEPS_A_ZOMBIE = (  # the child starts before SIGTERM is ignored (an ignored signal stays ignored in children)
    "import signal, subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(child.pid, flush=True); time.sleep(60)"
)


def _start(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)


def test_a_tree_that_ends_on_sigterm_leaves_nothing() -> None:
    proc = _start("import time; print(flush=True); time.sleep(60)")
    assert proc.stdout is not None
    proc.stdout.readline()  # started
    assert server._stop(proc) == ([], "")
    assert proc.returncode == -15


def test_what_outlives_sigterm_is_named_then_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "GRACE_S", 1.0)
    proc = _start(IGNORES_TERM)
    assert proc.stdout is not None
    proc.stdout.readline()  # SIGTERM is ignored from here on
    (left,), stacks = server._stop(proc)
    assert left.startswith(f"{proc.pid} python") and "parent" in left, left
    # where it waited, read before the kill: the process's own stack (its `time.sleep` at <string> line 1)
    assert f"Process {proc.pid}:" in stacks and "<module> (<string>:1)" in stacks, stacks
    assert proc.returncode == -9


def test_without_py_spy_the_stacks_say_how_to_get_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "_py_spy", lambda: None)
    assert "py-spy is not installed" in server._stacks([1])


def test_a_zombie_child_counts_as_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child ends on SIGTERM; its parent ignores SIGTERM and never collects it: only the parent is left."""
    monkeypatch.setattr(server, "GRACE_S", 2.0)
    proc = _start(KEEPS_A_ZOMBIE)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    left, stacks = server._stop(proc)
    assert [entry.split()[0] for entry in left] == [str(proc.pid)], (left, child)
    assert f"Process {proc.pid}:" in stacks and f"Process {child}:" not in stacks, stacks
    assert proc.returncode == -9
