"""`fast_exit.exit_now`: the process ends with the given status, its ``atexit`` handlers run and what it printed
(buffered: stdout is a pipe) reaches the reader, without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import atexit, sys
from pathlib import Path
from optimum.neuron.fast_exit import exit_now

atexit.register(lambda: Path(sys.argv[1]).write_text("atexit ran"))
print("exported to somewhere")
print("a warning", file=sys.stderr)
exit_now(3)
print("never printed")
"""


def test_exit_now_runs_atexit_flushes_and_ends_with_its_status(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(marker)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert run.stdout == "exported to somewhere\n" and run.stderr == "a warning\n"
    assert marker.read_text() == "atexit ran"
