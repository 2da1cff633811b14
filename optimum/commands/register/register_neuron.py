"""Registers ``optimum-cli export neuron`` and ``optimum-cli neuron`` (loaded by optimum-cli from this PEP 420
namespace)."""

from optimum.commands.export.base import ExportCommand

from optimum.commands.export.neuron import NeuronExportCommand
from optimum.commands.neuron.cache import NeuronCommand

REGISTER_COMMANDS = [(NeuronExportCommand, ExportCommand), NeuronCommand]
