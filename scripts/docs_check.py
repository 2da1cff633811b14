"""Run the shell blocks of README.md and docs/*.md that are marked runnable, so the docs cannot rot.

A block is runnable when the line right before its opening fence is ``<!-- docs-check -->``, with
optional attributes: ``expect="TEXT"`` (its output must contain TEXT) and ``venv="DIR"`` (it needs
the project's environment DIR instead of ``.venv``, e.g. ``.venv-xla``). One run checks the blocks of
one environment (``--venv``, default ``.venv``) and says how many blocks it leaves to the others.
The blocks of one file run in order, in one fresh temporary directory that links the environment
under its own name (so the docs' ``.venv/bin/...`` commands work as written), with
``bash -euo pipefail``, its ``bin`` first on PATH and the project's cache. Files run side by side,
`JOBS` at a time (a block mostly waits on one process: a server starting, a model loading), so two files'
blocks must not claim the same port. A block that fails, prints
no TEXT, or outlives `BLOCK_TIMEOUT` fails the check; whatever a block started in the background is
killed when it ends.

    .venv/bin/python scripts/docs_check.py [--venv DIR] [FILE ...]
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r'^<!-- docs-check((?: \w+="[^"]*")*) -->$')
ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')
FENCE = re.compile(r"^```(\w*)\s*$")
BLOCK_TIMEOUT = 1200
DEFAULT_VENV = ".venv"
JOBS = 2
"""Files checked at the same time."""
_PRINT = threading.Lock()


@dataclass(frozen=True)
class Block:
    """One runnable block: its text, the text its output must contain, the environment it needs."""

    text: str
    expect: str = ""
    venv: str = DEFAULT_VENV


def runnable_blocks(text: str) -> list[Block]:
    """The marked fenced blocks of a markdown text, in order; `ValueError` on an unknown attribute."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker and i + 1 < len(lines) and FENCE.match(lines[i + 1]):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            attributes = dict(ATTRIBUTE.findall(marker.group(1)))
            unknown = set(attributes) - {"expect", "venv"}
            if unknown:
                raise ValueError(f"line {i + 1}: unknown docs-check attribute(s) {sorted(unknown)}: use expect, venv")
            blocks.append(Block("\n".join(lines[i + 2 : end]), **attributes))
            i = end
        i += 1
    return blocks


def environment(venv: str = DEFAULT_VENV) -> dict[str, str]:
    """The environment the blocks run in: the project venv first on PATH, offline hubs, shared cache."""
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OPTIMUM_NEURON_CACHE", str(ROOT / ".cache" / "optimum-neuron"))
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("OMP_WAIT_POLICY", "passive")  # two files run at once on two cores: idle threads sleep, not spin
    env["DOCS_CHECK_ROOT"] = str(ROOT)
    return env


def run_block(block: str, work: str, venv: str = DEFAULT_VENV) -> tuple[int, str, str]:
    """Run one block in ``work`` as its own process group; kill the group (servers left running) after."""
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=work,
        env=environment(venv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return 124, out, err + f"\ntimed out after {BLOCK_TIMEOUT} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def verdict(code: int, out: str, expect: str) -> str:
    """``ok``, or why a block failed."""
    if code != 0:
        return f"FAILED (exit {code})"
    if expect not in out:
        return f"FAILED (output lacks {expect!r})"
    return "ok"


def check_file(path: Path, venv: str = DEFAULT_VENV) -> int:
    """Run the file's blocks that need ``venv``; the number of failures."""
    blocks = [b for b in runnable_blocks(path.read_text()) if b.venv == venv]
    if not blocks:
        return 0
    if not (ROOT / venv / "bin" / "python").is_file():
        with _PRINT:
            print(f"{path.name}: {ROOT / venv} does not exist: make it first (make install / make install-xla)")
        return len(blocks)
    with tempfile.TemporaryDirectory(prefix="docs-check-") as work:
        (Path(work) / venv).symlink_to(ROOT / venv)
        for index, block in enumerate(blocks, 1):
            start = time.perf_counter()
            code, out, err = run_block(block.text, work, venv)
            status = verdict(code, out, block.expect)
            name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            report = f"{name} block {index}: {status} in {time.perf_counter() - start:.1f}s"
            if status != "ok":
                report += f"\n--- block ---\n{block.text}\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}"
            with _PRINT:
                print(report, flush=True)
            if status != "ok":
                return 1
    return 0


def main(argv: list[str]) -> int:
    venv = DEFAULT_VENV
    if argv[:1] == ["--venv"] and len(argv) > 1:
        venv, argv = argv[1], argv[2:]
    files = [Path(a).resolve() for a in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [b for f in files for b in runnable_blocks(f.read_text())]
    mine = sum(b.venv == venv for b in blocks)
    with ThreadPoolExecutor(JOBS) as pool:
        failures = sum(pool.map(lambda f: check_file(f, venv), files))
    others = sorted({b.venv for b in blocks} - {venv})
    elsewhere = f"; {len(blocks) - mine} left to {', '.join(others)} (--venv)" if others else ""
    print(f"docs-check ({venv}): {mine} runnable blocks, {failures} failed{elsewhere}")
    return 1 if failures or not mine else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
