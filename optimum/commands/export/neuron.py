"""``optimum-cli export neuron``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

if TYPE_CHECKING:
    from argparse import ArgumentParser


class NeuronExportCommand(BaseOptimumCLICommand):
    """Compile a transformers checkpoint into static graphs (token generation + prefill)."""

    COMMAND = CommandInfo(name="neuron", help="Export a causal LM to static compiled graphs (optimum-neuronx).")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        from optimum.exporters.neuron.__main__ import add_export_arguments

        add_export_arguments(parser)

    def run(self) -> None:
        from optimum.exporters.neuron.__main__ import run_export
        from optimum.neuron.errors import NeuronError
        from optimum.neuron.fast_exit import exit_now

        try:
            out = run_export(self.args)
        except NeuronError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        print(f"exported to {out}")
        exit_now(0)  # the command is done: skip the interpreter's teardown of the compiler's objects (2-3 s)
