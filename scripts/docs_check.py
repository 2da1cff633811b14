"""Run the shell blocks of README.md and docs/*.md that are marked runnable, so the docs cannot rot.

A block is runnable when the line right before its opening fence is ``<!-- docs-check -->``, or
``<!-- docs-check expect="TEXT" -->`` when its output must also contain TEXT. The blocks of one file
run in order, in one fresh temporary directory that links the project's ``.venv`` (so the docs'
``.venv/bin/...`` commands work as written), with ``bash -euo pipefail``, ``.venv/bin`` first on PATH
and the project's cache. A block that fails, prints no TEXT, or outlives `BLOCK_TIMEOUT` fails the
check; whatever a block started in the background is killed when it ends.

    .venv/bin/python scripts/docs_check.py [FILE ...]
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r'^<!-- docs-check(?: expect="([^"]+)")? -->$')
FENCE = re.compile(r"^```(\w*)\s*$")
BLOCK_TIMEOUT = 1200


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """The marked fenced blocks of a markdown text, in order, each with the text its output must contain."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker and i + 1 < len(lines) and FENCE.match(lines[i + 1]):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            blocks.append(("\n".join(lines[i + 2 : end]), marker.group(1) or ""))
            i = end
        i += 1
    return blocks


def environment() -> dict[str, str]:
    """The environment the blocks run in: the project venv first on PATH, offline hubs, shared cache."""
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OPTIMUM_NEURON_CACHE", str(ROOT / ".cache" / "optimum-neuron"))
    env["HF_HUB_OFFLINE"] = "1"
    env["DOCS_CHECK_ROOT"] = str(ROOT)
    return env


def run_block(block: str, work: str) -> tuple[int, str, str]:
    """Run one block in ``work`` as its own process group; kill the group (servers left running) after."""
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=work,
        env=environment(),
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


def check_file(path: Path) -> int:
    """Run the file's blocks; the number of failures."""
    blocks = runnable_blocks(path.read_text())
    if not blocks:
        return 0
    with tempfile.TemporaryDirectory(prefix="docs-check-") as work:
        (Path(work) / ".venv").symlink_to(ROOT / ".venv")
        for index, (block, expect) in enumerate(blocks, 1):
            start = time.perf_counter()
            code, out, err = run_block(block, work)
            status = verdict(code, out, expect)
            name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            print(f"{name} block {index}: {status} in {time.perf_counter() - start:.1f}s")
            if status != "ok":
                print(f"--- block ---\n{block}\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
                return 1
    return 0


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    counted = sum(len(runnable_blocks(f.read_text())) for f in files)
    failures = sum(check_file(f) for f in files)
    print(f"docs-check: {counted} runnable blocks, {failures} failed")
    return 1 if failures or not counted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
