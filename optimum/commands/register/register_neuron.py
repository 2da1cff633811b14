"""Registers ``optimum-cli export neuron`` (loaded by optimum-cli from this PEP 420 namespace)."""

from optimum.commands.export.base import ExportCommand

from optimum.commands.export.neuron import NeuronExportCommand

REGISTER_COMMANDS = [(NeuronExportCommand, ExportCommand)]
