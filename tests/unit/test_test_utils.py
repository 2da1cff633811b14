"""The suite's own helpers: `subprocess_test` re-runs a test by a node id pytest can select, also for tests
that pytest-xdist groups (``--dist loadgroup`` appends ``@<group>`` to their ids)."""

from __future__ import annotations

import pytest

from tests.utils import _without_xdist_group


@pytest.mark.parametrize(
    ("node", "selectable"),
    [
        ("tests/a.py::test_x", "tests/a.py::test_x"),
        ("tests/a.py::test_x@smollm2", "tests/a.py::test_x"),
        ("tests/a.py::test_x[inductor]@smollm2", "tests/a.py::test_x[inductor]"),
        ("tests/a.py::test_x[user@host]", "tests/a.py::test_x[user@host]"),
    ],
)
def test_node_id_without_the_xdist_group(node: str, selectable: str) -> None:
    assert _without_xdist_group(node) == selectable
