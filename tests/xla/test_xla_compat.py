"""One test per call of `optimum.neuron.backends.xla_compat`, the only module that touches torch-xla
(pinned 2.9.0). A torch-xla upgrade that changes one of these internals fails here first, by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from optimum.neuron.backends import xla_compat
from optimum.neuron.errors import BackendUnavailableError

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def device() -> torch.device:
    return xla_compat.device("cpu")


def traced(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w, x @ w + 1.5)`` with ``x`` and ``w`` plain device data and the result pending."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(device)
    w = torch.ones(3, 2).to(device)
    xla_compat.sync()
    return x, w, x @ w + 1.5


def test_installed_version_is_the_pinned_one() -> None:
    assert xla_compat.installed_version() == xla_compat.TORCH_XLA_VERSION


def test_neuron_missing_names_the_sdk_and_the_device() -> None:
    missing = " ".join(xla_compat.neuron_missing())
    assert "torch-neuronx is not installed" in missing and "no Neuron device" in missing


def test_load_selects_the_cpu_pjrt_device() -> None:
    module = xla_compat.load("cpu")
    assert module.__name__ == "torch_xla" and os.environ["PJRT_DEVICE"] == "CPU"


def test_load_refuses_a_conflicting_pjrt_device() -> None:
    code = "from optimum.neuron.backends import xla_compat; xla_compat.load('cpu')"
    env = {**os.environ, "PJRT_DEVICE": "TPU"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and "PJRT_DEVICE=TPU is set but --device cpu needs PJRT_DEVICE=CPU" in done.stderr


def test_load_neuron_says_what_is_missing() -> None:
    with pytest.raises(BackendUnavailableError) as info:
        xla_compat.load("neuron")
    message = str(info.value)
    for fragment in ("torch-neuronx", "no Neuron device", "not verified", "--device cpu"):
        assert fragment in message, message


def test_device_is_an_xla_device(device: torch.device) -> None:
    assert device.type == "xla"


def test_sync_materializes_pending_tensors(device: torch.device) -> None:
    x, _, y = traced(device)
    xla_compat.sync()
    ids, _ = xla_compat.device_data([y])
    assert len(ids) == 1 and ids != xla_compat.device_data([x])[0], "after sync y is device data of its own"


def test_device_data_lists_each_input_once(device: torch.device) -> None:
    x, w, y = traced(device)
    ids, values = xla_compat.device_data([y, y])
    x_id, w_id = xla_compat.device_data([x])[0][0], xla_compat.device_data([w])[0][0]
    assert {x_id, w_id} <= set(ids)
    by_id = dict(zip(ids, values, strict=True))
    assert torch.equal(by_id[x_id].cpu(), x.cpu()) and torch.equal(by_id[w_id].cpu(), w.cpu())


def test_hlo_proto_and_computation_round_trip(device: torch.device) -> None:
    x, w, y = traced(device)
    _ids, values = xla_compat.device_data([y])
    proto = xla_compat.hlo_proto([y])
    assert isinstance(proto, bytes) and len(proto) > 100
    built = xla_compat.computation("compat_test", proto)
    (out,) = xla_compat.call("xla::compat_test", values, built)
    xla_compat.sync()
    assert torch.equal(out.cpu(), x.cpu() @ w.cpu() + 1.5)


def test_hlo_text_shows_the_module(device: torch.device) -> None:
    _x, _w, y = traced(device)
    text = xla_compat.hlo_text(xla_compat.hlo_proto([y]))
    assert text.startswith("HloModule") and " dot(" in text and "f32[2,3]" in text and "f32[3,2]" in text


def test_call_compiles_once_for_same_shapes(device: torch.device) -> None:
    _, _, y = traced(device)
    _, values = xla_compat.device_data([y])
    built = xla_compat.computation("compat_once", xla_compat.hlo_proto([y]))
    xla_compat.sync()  # y itself is pending: run it now, not inside the loop
    before = xla_compat.compile_count()
    for scale in (1.0, 2.0, 3.0):
        host = [v.cpu() * scale for v in values]
        (out,) = xla_compat.call("xla::compat_once", [h.to(device) for h in host], built)
        xla_compat.sync()
        by_shape = {tuple(h.shape): h for h in host}  # x [2, 3], w [3, 2], maybe the scalar 1.5
        assert torch.equal(out.cpu(), by_shape[(2, 3)] @ by_shape[(3, 2)] + by_shape.get((), torch.tensor(1.5)))
    assert xla_compat.compile_count() - before == 1


def test_compile_count_counts_new_graphs(device: torch.device) -> None:
    before = xla_compat.compile_count()
    z = torch.full((5, 7), 3.25).to(device)
    (z.sin() * 2.5).cpu()
    assert xla_compat.compile_count() == before + 1


def test_fallback_ops_reports_cpu_fallbacks(device: torch.device) -> None:
    before = xla_compat.fallback_ops()
    a = torch.rand(4, 4).to(device)
    torch.linalg.eigvals(a).cpu()  # not lowered to XLA: runs on the CPU
    after = xla_compat.fallback_ops()
    assert any(after[n] > before.get(n, 0) for n in after), after


def test_alias_count_counts_in_place_updates(device: torch.device) -> None:
    buffer = torch.zeros(64, 64).to(device)
    xla_compat.sync()
    before = xla_compat.alias_count()
    buffer.add_(1.0)
    xla_compat.sync()
    assert xla_compat.alias_count() > before
    assert torch.equal(buffer.cpu(), torch.ones(64, 64))
