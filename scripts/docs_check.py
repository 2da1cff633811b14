"""Run the shell blocks of README.md and docs/*.md that are marked runnable, so the docs cannot rot.

A block is runnable when the line right before its opening fence is ``<!-- docs-check -->``.
The blocks of one file run in order, in one fresh temporary directory, with ``bash -euo pipefail``,
the project's ``.venv/bin`` first on PATH and the project's cache; a failing block fails the check.

    .venv/bin/python scripts/docs_check.py [FILE ...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- docs-check -->"
FENCE = re.compile(r"^```(\w*)\s*$")


def runnable_blocks(text: str) -> list[str]:
    """The marked fenced blocks of a markdown text, in order."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == MARKER and i + 1 < len(lines) and FENCE.match(lines[i + 1]):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            blocks.append("\n".join(lines[i + 2 : end]))
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


def check_file(path: Path) -> int:
    """Run the file's blocks; the number of failures."""
    blocks = runnable_blocks(path.read_text())
    if not blocks:
        return 0
    failures = 0
    with tempfile.TemporaryDirectory(prefix="docs-check-") as work:
        for index, block in enumerate(blocks, 1):
            start = time.perf_counter()
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block], cwd=work, env=environment(), capture_output=True, text=True
            )
            status = "ok" if done.returncode == 0 else f"FAILED ({done.returncode})"
            print(f"{path.relative_to(ROOT)} block {index}: {status} in {time.perf_counter() - start:.1f}s")
            if done.returncode != 0:
                failures += 1
                print(f"--- block ---\n{block}\n--- stdout ---\n{done.stdout[-3000:]}")
                print(f"--- stderr ---\n{done.stderr[-3000:]}")
                break
    return failures


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    counted = sum(len(runnable_blocks(f.read_text())) for f in files)
    failures = sum(check_file(f) for f in files)
    print(f"docs-check: {counted} runnable blocks, {failures} failed")
    return 1 if failures or not counted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
