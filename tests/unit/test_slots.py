"""The KV slot table: lowest free slot first, typed errors with the fix."""

from __future__ import annotations

import pytest

from optimum.neuron.errors import SlotError
from optimum.neuron.runtime.slots import SlotTable


def test_acquire_gives_lowest_free_slot() -> None:
    table = SlotTable(3)
    assert [table.acquire(name) for name in "abc"] == [0, 1, 2]
    table.release(1)
    assert table.acquire("d") == 1
    table.release(0)
    table.release(2)
    assert table.acquire("e") == 0


def test_overflow_raises_with_fix() -> None:
    table = SlotTable(2)
    table.acquire("a")
    table.acquire("b")
    with pytest.raises(SlotError, match="--batch_size") as info:
        table.acquire("c")
    assert "all 2 KV slots" in str(info.value)
    assert table.used == {0: "a", 1: "b"}


def test_double_acquire_by_same_owner_raises() -> None:
    table = SlotTable(4)
    table.acquire(("req", 1))
    with pytest.raises(SlotError, match="already holds"):
        table.acquire(("req", 1))
    assert table.free_count == 3


@pytest.mark.parametrize("slot", [0, 1, 5, -1])
def test_release_of_free_slot_raises(slot: int) -> None:
    table = SlotTable(2)
    table.acquire("a")
    table.release(0)
    with pytest.raises(SlotError, match="not in use"):
        table.release(slot)


def test_bookkeeping() -> None:
    table = SlotTable(3)
    assert table.free_count == 3 and table.used == {}
    table.acquire("x")
    table.acquire("y")
    assert table.slot_of("y") == 1 and table.slot_of("z") is None
    assert table.free_count == 1
    table.release(0)
    assert table.used == {1: "y"} and table.slot_of("x") is None
    table.used[5] = "mutation"
    assert 5 not in table.used, "used must be a copy"
