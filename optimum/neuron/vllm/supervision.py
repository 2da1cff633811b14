"""Crash supervision: ``vllm serve`` exits non-zero when its engine core died, so a supervisor restarts it.

vLLM 0.32 notices an engine-core process that died (killed, out of memory, crashed), fails the requests in flight
(a stream ends with an error event) and shuts its HTTP server down, but with one API server (the default) the
``vllm serve`` process then exits with status 0: a supervisor that restarts on failure only (systemd
``Restart=on-failure``, most process managers) would leave the service down. vLLM itself records which engine core
died before any shutdown was asked (its process manager's ``failed_proc_name``, `compat.engine_failure`; a normal
stop, even one that ends with killing an engine core, records none). `watch_engine_cores`, started by the platform
in the ``vllm serve`` process, keeps those managers and, when the process exits after such a death, makes its status
`ENGINE_DIED_EXIT_CODE` (an ``atexit`` hook, after vLLM has shut down). docs/vllm.md gives the restart recipes.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import compat

ENGINE_DIED_EXIT_CODE = 3
"""The exit status of ``vllm serve`` after its engine core died."""
_POLL_S = 1.0

logger = compat.logger(__name__)


class EngineWatch:
    """Finds this process's engine-core managers once the engine cores run; at exit, says whether one died."""

    def __init__(self) -> None:
        self.managers: list[Any] = []

    def run(self) -> None:
        """The watching thread's body: once engine-core processes run, find vLLM's managers of them."""
        while not self.managers:
            time.sleep(_POLL_S)
            if any(p.name.startswith(compat.ENGINE_PROCESS_PREFIX) for p in multiprocessing.active_children()):
                self.managers = compat.engine_managers()

    def died(self) -> str | None:
        """The engine-core process that died before any shutdown was asked, or None."""
        return next((name for m in self.managers if (name := compat.engine_failure(m)) is not None), None)

    def exit_status(self) -> None:
        """At interpreter exit: end the process with `ENGINE_DIED_EXIT_CODE` if an engine core died."""
        name = self.died()
        if name is None:
            return
        status = ENGINE_DIED_EXIT_CODE
        logger.error("engine core %s died: vllm serve exits with status %d (restart it: docs/vllm.md)", name, status)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        logging.shutdown()
        os._exit(status)


_started: EngineWatch | None = None


def is_vllm_serve(argv: list[str]) -> bool:
    """True in the process of the ``vllm serve`` command, not in the engine core or worker processes it spawns (they
    get its ``sys.argv`` too: ``multiprocessing`` spawn copies it)."""
    main = multiprocessing.parent_process() is None
    return main and len(argv) > 1 and Path(argv[0]).name == "vllm" and argv[1] == "serve"


def watch_engine_cores() -> EngineWatch | None:
    """Start watching this process's engine cores (once per process, only in ``vllm serve``); the watch, or None."""
    global _started
    if _started is None and is_vllm_serve(sys.argv):
        _started = EngineWatch()
        threading.Thread(target=_started.run, name="optimum-neuronx-engine-watch", daemon=True).start()
        atexit.register(_started.exit_status)
    return _started
