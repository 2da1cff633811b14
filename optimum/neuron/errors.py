"""Typed errors raised at the toolkit's boundaries. Each message says how to fix the problem."""

from __future__ import annotations


class NeuronError(Exception):
    """Base class of every error raised by optimum-neuronx."""


class IncompatibleConfigError(NeuronError, ValueError):
    """A `NeuronConfig` field, or a combination of fields, cannot be compiled or served."""


class UnsupportedModelError(NeuronError, ValueError):
    """The model's architecture (``model_type``) has no static-graph family here."""


class WeightLoadingError(NeuronError, ValueError):
    """A checkpoint does not map exactly (keys, shapes, dtypes) onto the static model."""


class QuantizedCheckpointError(NeuronError, ValueError):
    """A pre-quantized checkpoint (its config.json's ``quantization_config``) uses a method, scheme or layout that
    cannot be taken as it is (`optimum.neuron.prequantized`); nothing was exported."""


class ArtifactError(NeuronError, OSError):
    """An exported artifact is missing, corrupt, or was made by an incompatible toolkit version."""


class BackendUnavailableError(NeuronError, RuntimeError):
    """The requested compile backend or device is not installed or not present on this machine."""


class InputError(NeuronError, ValueError):
    """A runtime request does not fit the compiled graphs (too long, too many sequences, bad ids)."""


class SlotError(NeuronError, RuntimeError):
    """The KV slot table cannot satisfy a request (no free slot, unknown or double-freed slot)."""


class ExportError(NeuronError, RuntimeError):
    """An export could not finish for a reason outside its inputs (a compile worker died, a bad setting of the
    environment); nothing half-built is left in the cache."""


class CacheError(NeuronError, ValueError):
    """A cache command (``optimum-cli neuron cache``) was given a value it cannot use; nothing was removed."""
