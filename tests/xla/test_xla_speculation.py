"""The verification graph on the xla backend (`--speculation_length 3`): one graph per KV window, greedy tokens equal to
transformers' while each decode step keeps, partly keeps or rejects proposed tokens (`tests/models/speculation.py`)."""

from __future__ import annotations

import pytest

from tests.contract.engine_tools import Recorder, prompt
from tests.fixtures.llm.models import fixture_named
from tests.fixtures.llm.reference import hf_greedy
from tests.models.speculation import spec_engine, spec_name, speculate

pytestmark = pytest.mark.xla


def test_xla_verification_graphs_generate_transformers_tokens() -> None:
    engine = spec_engine("llama", "xla")
    recorder = Recorder(engine)
    ids = prompt(10, seed=60)
    reference = hf_greedy(fixture_named(spec_name("llama", "xla")).model(), ids, 20)
    assert speculate(engine, "s", ids, reference) == reference
    called = {name for name, _ in recorder.calls if name.startswith("verification")}
    assert called == {"verification_w16", "verification"}, called
