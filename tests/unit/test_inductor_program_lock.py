"""The inductor backend compiles each program under a lock of that program in the inductor cache
(`backends.inductor._same_program_lock`): AOTInductor packages a graph's generated files after releasing its own lock,
and a second process compiling the same program meanwhile rewrote them (an empty JSON file in the first package,
seen once in four runs of the export tests on two workers). Checked without compiling: the packaging step is
replaced by a probe of the lock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from optimum.neuron.backends.inductor import InductorBackend, _same_program_lock
from optimum.neuron.cache_dir import cache_lock


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + 1.0


def _program(*shape: int) -> torch.export.ExportedProgram:
    return torch.export.export(Scale(), (torch.ones(*shape),), strict=False)


def test_one_program_one_lock_another_program_another() -> None:
    assert _same_program_lock(_program(2, 3)) == _same_program_lock(_program(2, 3))
    assert _same_program_lock(_program(2, 3)) != _same_program_lock(_program(4, 3))  # another input shape


def test_the_compile_and_its_packaging_run_under_the_program_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[bool] = []

    def probe(program: torch.export.ExportedProgram, package_path: str, inductor_configs: dict) -> str:
        with cache_lock(_same_program_lock(program), wait=False) as free:
            held.append(not free)
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", probe)
    InductorBackend().compile(Scale(), (torch.ones(2, 3),), tmp_path / "graph.pt2")
    assert held == [True]
    with cache_lock(_same_program_lock(_program(2, 3)), wait=False) as free:
        assert free, "the lock is released once the compile returns"
