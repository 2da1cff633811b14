"""Where torch-xla is absent (the main environment), the xla backend fails with a typed error that
says where it runs, and nothing imports torch-xla (it is only imported by `backends/xla_compat.py`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from optimum.neuron.backends import get_backend
from optimum.neuron.errors import BackendUnavailableError
from tests.utils import HAS_TORCH_XLA


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch-xla is installed here: the xla backend works (tests/xla)")
@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_xla_backend_without_torch_xla(device: str) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        get_backend("xla").placement(device)
    message = str(info.value)
    assert "torch-xla is not installed" in message and "make install-xla" in message, message
    if device == "neuron":
        for fragment in ("torch-neuronx", "no Neuron device", "not verified"):
            assert fragment in message, message


def test_importing_the_toolkit_does_not_import_torch_xla() -> None:
    code = (
        "import sys; import optimum.neuron, optimum.neuron.runtime.engine, optimum.exporters.neuron.export; "
        "import optimum.neuron.backends.xla; print('torch_xla' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
