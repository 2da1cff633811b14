"""``optimum-cli neuron cache list | clear | prune``: thin commands over `optimum.neuron.cache_cli` (arguments, output)
and `optimum.neuron.cache_admin` (the cache's entries, sizes and removal)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

from optimum.neuron import cache_cli

if TYPE_CHECKING:
    from argparse import ArgumentParser


class CacheListCommand(BaseOptimumCLICommand):
    """``optimum-cli neuron cache list [--json]``."""

    COMMAND = CommandInfo(name="list", help=cache_cli.LIST_HELP)

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        cache_cli.add_list_arguments(parser)

    def run(self) -> None:
        sys.exit(cache_cli.run_list(self.args))


class CacheClearCommand(BaseOptimumCLICommand):
    """``optimum-cli neuron cache clear [--all]``."""

    COMMAND = CommandInfo(name="clear", help=cache_cli.CLEAR_HELP)

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        cache_cli.add_clear_arguments(parser)

    def run(self) -> None:
        sys.exit(cache_cli.run_clear(self.args))


class CachePruneCommand(BaseOptimumCLICommand):
    """``optimum-cli neuron cache prune --max-size SIZE [--dry-run]``."""

    COMMAND = CommandInfo(name="prune", help=cache_cli.PRUNE_HELP)

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        cache_cli.add_prune_arguments(parser)

    def run(self) -> None:
        sys.exit(cache_cli.run_prune(self.args))


class NeuronCacheCommand(BaseOptimumCLICommand):
    """``optimum-cli neuron cache``: the compile cache under ``$OPTIMUM_NEURON_CACHE``."""

    COMMAND = CommandInfo(name="cache", help="List, clear or prune the compile cache ($OPTIMUM_NEURON_CACHE).")
    SUBCOMMANDS = (
        CommandInfo(CacheListCommand.COMMAND.name, CacheListCommand.COMMAND.help, CacheListCommand),
        CommandInfo(CacheClearCommand.COMMAND.name, CacheClearCommand.COMMAND.help, CacheClearCommand),
        CommandInfo(CachePruneCommand.COMMAND.name, CachePruneCommand.COMMAND.help, CachePruneCommand),
    )


class NeuronCommand(BaseOptimumCLICommand):
    """``optimum-cli neuron``: optimum-neuronx's tools besides the export (``optimum-cli export neuron``)."""

    COMMAND = CommandInfo(name="neuron", help="optimum-neuronx tools: `cache` (list, clear, prune the compile cache).")
    SUBCOMMANDS = (CommandInfo(NeuronCacheCommand.COMMAND.name, NeuronCacheCommand.COMMAND.help, NeuronCacheCommand),)
