"""Ending a command-line process that compiled graphs without tearing its interpreter down.

After an export, the interpreter's own shutdown (a final garbage collection over the compiler's ~300,000 objects,
then freeing every module) takes 2-3 s on a 2-core VM: the measured gap between a finished export's last ``atexit``
handler and the process's exit. `exit_now` runs the ``atexit`` handlers (temporary folders removed, logging flushed,
inductor's compile pools shut down), flushes the standard streams and ends the process there. Only entry points call
it (``optimum-cli export neuron``, ``python -m optimum.exporters.neuron``, the compile worker), never a function a
caller's process may run in-process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys


def exit_now(code: int) -> None:
    """End this process with status ``code`` once its ``atexit`` handlers ran and its standard streams are flushed,
    skipping the interpreter's teardown."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader is gone: nothing left to write
            stream.flush()
    os._exit(code)
