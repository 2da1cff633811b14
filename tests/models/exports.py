"""Export fixtures of the tiny models in any dtype, named like `tests.fixtures.llm.models`' fp32 ones.

``dtype_fixture("llama", "inductor", "bf16")`` is ``llama-2x4x8-inductor`` exported with
``auto_cast_type=bf16`` (an export cache entry); fp32 returns the named fixture.
"""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.llm.models import ExportFixture, export_fixture, tiny_model

CHUNK = 8
"""Chunk size of the chunked fixtures (sequence length 4 * CHUNK)."""
SEQUENCE_LENGTH = 4 * CHUNK
WINDOWS = (16, SEQUENCE_LENGTH)
"""The KV windows of every tiny fixture (`tests.fixtures.llm.models.FIXTURE_KV_BUCKETS`)."""


def fixture_of(family: str, backend: str, chunked: bool = True) -> ExportFixture:
    """The named fp32 fixture: ``<family>-2x4x8-<backend>`` or ``<family>-2x1x32-ce-<backend>``."""
    if chunked:
        return ExportFixture(family, 2, 4, CHUNK, True, backend)
    return ExportFixture(family, 2, 1, SEQUENCE_LENGTH, False, backend)


def dtype_fixture(family: str, backend: str, dtype: str, chunked: bool = True) -> Path:
    """The artifact directory of ``fixture_of(family, backend, chunked)`` exported in ``dtype``."""
    from optimum.exporters.neuron.export import cached_export

    fixture = fixture_of(family, backend, chunked)
    if dtype == "fp32":
        return export_fixture(fixture.name)
    return cached_export(tiny_model(family), fixture.neuron_config().derive(auto_cast_type=dtype))
