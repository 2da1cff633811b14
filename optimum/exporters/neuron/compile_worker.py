"""A process compiling graphs for an export (`compile.WorkerProcess`), started as
``python -m optimum.exporters.neuron.compile_worker``.

It reads pickled messages on stdin: first ``(model_dir, config, threads)`` (the worker is started, and loads the
checkpoint, while the export still looks its graphs up), then ``(spec, folder)`` per graph, and
answers each graph with ``(True, seconds)`` or ``(False, error)`` on its stdout, kept for the answers alone (what
the process prints goes to stderr). It exits when stdin closes, and on Linux with the process that started it (a
worker whose exporter was killed mid-compile would otherwise finish its graph first, minutes of two cores for nobody).
The exporter closes stdin as soon as no graph is left for this worker, and the worker ends without its interpreter's
teardown (`fast_exit`), so that neither delays the exporter's last graph.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from typing import Any, BinaryIO

import torch

from ...neuron.errors import ExportError
from ...neuron.fast_exit import exit_now
from .compile import PARENT_ENV, GraphBuilder
from .parallel import tracing_group


def main() -> None:
    """Serve compile jobs until stdin closes."""
    _die_with_parent()
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints, warnings and compiler output stay off the answers
    setup = _next_job(sys.stdin.buffer)
    if setup is None:  # released before any job: every graph was cached, or fewer to compile than workers
        return
    model_dir, config, threads = setup
    torch.set_num_threads(threads)  # inductor's CPU code is generated for it: the exporting process's count
    with tracing_group(config.tp_degree):
        try:
            builder: GraphBuilder | Exception = GraphBuilder.load(model_dir, config)[0]
        except Exception as err:  # answered to every job: the exporting process raises it
            builder = err
        while (job := _next_job(sys.stdin.buffer)) is not None:
            try:
                if isinstance(builder, Exception):
                    raise builder
                _answer(answers, (True, builder.compile(*job)))
            except Exception as err:
                _answer(answers, (False, err))


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the exporting process exits (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), and
    exit at once if it is already gone (it died while this one started: ``PARENT_ENV`` names it); elsewhere the worker
    exits when stdin closes, after its current graph."""
    if not sys.platform.startswith("linux"):
        return
    asked = ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if asked and str(os.getppid()) != os.environ.get(PARENT_ENV, str(os.getppid())):
        sys.exit(1)


_PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``: the signal a process receives when the thread that created it exits."""


def _next_job(stream: BinaryIO) -> Any:
    try:
        return pickle.load(stream)
    except EOFError:
        return None


def _answer(stream: BinaryIO, message: tuple[bool, Any]) -> None:
    try:
        data = pickle.dumps(message)
    except Exception:  # an error that does not pickle: its text
        data = pickle.dumps((False, ExportError(f"compile failed in a worker process: {message[1]!r}")))
    stream.write(data)
    stream.flush()


if __name__ == "__main__":
    main()
    exit_now(0)  # its interpreter's teardown would compete with the graphs the exporter still compiles
