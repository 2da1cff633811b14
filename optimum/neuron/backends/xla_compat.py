"""Every torch-xla call the toolkit makes, pinned to torch-xla 2.9.0 (``tests/xla/test_xla_compat.py``
tests each one). Nothing else imports ``torch_xla``; this module imports it only when first asked.

torch-xla is ABI-locked to its torch (2.9.0), so it lives in its own environment (``make install-xla``
-> ``.venv-xla``), never in the main one where vLLM pins torch 2.13. Several calls below are torch-xla
internals (``torch_xla._XLAC``): they are the ones torch-xla's own StableHLO export, ``scan`` and
gradient accumulation use to capture a traced graph as an HLO module and to call a loaded one.
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata
import importlib.util
import os
from types import ModuleType
from typing import Any

import torch

from ..errors import BackendUnavailableError

TORCH_XLA_VERSION = "2.9.0"
"""The torch-xla release these calls were written and tested against."""
PJRT_DEVICES = {"cpu": "CPU", "neuron": "NEURON"}
"""``NeuronConfig.device`` -> the ``PJRT_DEVICE`` torch-xla runs on."""
_INSTALL_HINT = (
    "torch-xla {version} (with torch {version}) lives in its own environment: run `make install-xla` and use "
    ".venv-xla/bin/python (or .venv-xla/bin/optimum-cli)."
)


def installed_version() -> str | None:
    """The installed torch-xla distribution's version, without importing it; None when absent."""
    try:
        return importlib.metadata.version("torch-xla")
    except importlib.metadata.PackageNotFoundError:
        return None


def neuron_missing() -> list[str]:
    """What the Neuron PJRT device needs and this machine lacks (empty on a working trn1/inf2/trn2 host)."""
    missing = []
    for package, role in (("torch_neuronx", "torch-neuronx"), ("libneuronxla", "libneuronxla (Neuron PJRT plugin)")):
        if importlib.util.find_spec(package) is None:
            missing.append(f"{role} is not installed")
    if not glob.glob("/dev/neuron[0-9]*"):
        missing.append("no Neuron device (/dev/neuron*) is present")
    return missing


def load(device: str) -> ModuleType:
    """Import torch-xla for ``device`` (``cpu`` or ``neuron``), selecting the PJRT device first.

    Raises `BackendUnavailableError` naming what is missing: torch-xla itself, its pinned version, or
    for ``neuron`` the Neuron SDK packages and device."""
    assert device in PJRT_DEVICES, f"NeuronConfig refuses --device {device} for the xla backend"
    problems = _missing(device)
    if problems:
        raise BackendUnavailableError(_explain(device, problems))
    wanted = PJRT_DEVICES[device]
    current = os.environ.setdefault("PJRT_DEVICE", wanted)
    if current != wanted:
        raise BackendUnavailableError(
            f"PJRT_DEVICE={current} is set but --device {device} needs PJRT_DEVICE={wanted}: unset it or run "
            f"with PJRT_DEVICE={wanted}."
        )
    return importlib.import_module("torch_xla")


def _missing(device: str) -> list[str]:
    problems = []
    found = installed_version()
    if found is None:
        problems.append("torch-xla is not installed in this environment")
    elif found.split("+")[0] != TORCH_XLA_VERSION:
        problems.append(f"torch-xla {found} is installed but this toolkit is pinned to {TORCH_XLA_VERSION}")
    if device == "neuron":
        problems.extend(neuron_missing())
    return problems


def _explain(device: str, problems: list[str]) -> str:
    text = f"the xla backend on --device {device} cannot run here: {'; '.join(problems)}. "
    if device == "neuron":
        text += (
            "The Neuron path needs a trn1/inf2/trn2 instance with the AWS Neuron SDK (torch-neuronx, libneuronxla); "
            "it is written for, but not verified on, real Neuron hardware. Use --device cpu to run the same HLO "
            "graphs on XLA:CPU. "
        )
    return text + _INSTALL_HINT.format(version=TORCH_XLA_VERSION)


def _xlac() -> Any:
    return importlib.import_module("torch_xla")._XLAC


def device(kind: str) -> torch.device:
    """The XLA device that graphs for ``kind`` (``cpu``/``neuron``) run on."""
    return load(kind).device()


def sync() -> None:
    """Run every pending XLA operation (``torch_xla.sync``); tensors updated in place get their new data."""
    importlib.import_module("torch_xla").sync()


def device_data(tensors: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """The device data the graph rooted at ``tensors`` reads: per HLO parameter (in order), the id of the
    tensor that created the data and the data itself (``_XLAC._get_tensors_xla_device_data_node``)."""
    ids, values = _xlac()._get_tensors_xla_device_data_node(tensors)
    return list(ids), list(values)


def hlo_proto(tensors: list[torch.Tensor]) -> bytes:
    """The serialized ``HloModuleProto`` computing ``tensors`` (a tuple, in order) from their device data."""
    return bytes(_xlac()._get_xla_tensors_hlo_proto(tensors))


def computation(name: str, proto: bytes) -> Any:
    """An XLA computation built from a serialized HLO module (``xla_builder.computation_from_module_proto``)."""
    builder = importlib.import_module("torch_xla.core.xla_builder")
    return builder.computation_from_module_proto(name, proto)


def hlo_text(proto: bytes) -> str:
    """The HLO text of a serialized HLO module (``_XLAC._xla_computation_text``), e.g. to find its collectives."""
    return str(_xlac()._xla_computation_text(computation("hlo_text", proto)))


def call(name: str, inputs: list[torch.Tensor], built: Any) -> list[torch.Tensor]:
    """Lazily call the computation ``built`` on ``inputs`` (``_XLAC._xla_user_computation``): one IR node per
    call, so every call of one computation with inputs of the same shapes is the same graph (compiled once)."""
    return list(_xlac()._xla_user_computation(name, inputs, built))


def compile_count() -> int:
    """How many XLA graphs this process has compiled (the ``CompileTime`` metric's sample count)."""
    metrics = importlib.import_module("torch_xla.debug.metrics")
    data = metrics.metric_data("CompileTime")
    return int(data[0]) if data else 0


def fallback_ops() -> dict[str, int]:
    """Ops that ran on the CPU instead of XLA, with their counts (the ``aten::*`` counters)."""
    metrics = importlib.import_module("torch_xla.debug.metrics")
    return {n: int(metrics.counter_value(n)) for n in metrics.counter_names() if n.startswith("aten::")}


def alias_count() -> int:
    """Input buffers aliased to outputs, summed over the graphs compiled so far (the ``InputOutputAliasCount``
    metric, recorded per compile): tensors updated in place whose buffer is donated, so nothing is copied."""
    metrics = importlib.import_module("torch_xla.debug.metrics")
    data = metrics.metric_data("InputOutputAliasCount")
    return int(data[1]) if data else 0
