"""The export starts inductor's check of the CPU's vector ISAs in a thread before its own imports
(`InductorBackend.prepare_compiler`): on a fresh inductor cache the check compiles a test program per ISA (~5 s on
a 2-core VM), which the exporter's imports and checkpoint hash now overlap instead of waiting for it when the first
graph key is computed. Each check runs in a fresh interpreter: the started thread and inductor's answers live for
the process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_STARTED_ONCE = """
from torch._inductor.cpu_vec_isa import pick_vec_isa
from optimum.neuron.backends import get_backend
from optimum.neuron.backends.inductor import _vector_isa_check

backend = get_backend("inductor")
backend.prepare_compiler("cpu")
thread = _vector_isa_check()
backend.prepare_compiler("cpu")
assert _vector_isa_check() is thread, "a second check was started"
fingerprint = backend.compiler_fingerprint("cpu")
assert not thread.is_alive(), "the fingerprint did not wait for the check"
assert fingerprint.startswith(f"cpu:{pick_vec_isa()}:"), fingerprint
print("ok")
"""

_BEFORE_THE_EXPORTER = """
import sys
from optimum.exporters.neuron.__main__ import add_export_arguments, run_export
from optimum.neuron.backends.inductor import InductorBackend
import argparse

class Started(Exception):
    pass

def prepare(self, device):
    raise Started("optimum.exporters.neuron.export" in sys.modules, device)

InductorBackend.prepare_compiler = prepare
parser = argparse.ArgumentParser()
add_export_arguments(parser)
try:
    run_export(parser.parse_args(["--model", sys.argv[1], sys.argv[2]]))
except Started as started:
    print(started.args)
"""


def _run(script: str, *args: str) -> str:
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1]


def test_the_check_starts_once_and_the_fingerprint_waits_for_it() -> None:
    assert _run(_STARTED_ONCE) == "ok"


def test_the_cli_starts_the_check_before_importing_the_exporter(tmp_path: Path) -> None:
    assert _run(_BEFORE_THE_EXPORTER, str(tmp_path / "model"), str(tmp_path / "out")) == "(False, 'cpu')"
