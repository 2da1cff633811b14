"""The KV slot table: which sequence owns which row of the shared KV cache."""

from __future__ import annotations

from collections.abc import Hashable

from ..errors import SlotError


class SlotTable:
    """Hands out the ``batch_size`` KV slots; the lowest free slot first."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._owner: dict[int, Hashable] = {}

    def acquire(self, owner: Hashable) -> int:
        """A free slot for ``owner``; `SlotError` when all are taken or the owner already has one."""
        if owner in self._owner.values():
            raise SlotError(f"{owner!r} already holds a KV slot.")
        for slot in range(self.batch_size):
            if slot not in self._owner:
                self._owner[slot] = owner
                return slot
        raise SlotError(
            f"all {self.batch_size} KV slots are in use: wait for a sequence to finish, or re-export "
            "with a larger --batch_size."
        )

    def release(self, slot: int) -> None:
        """Give ``slot`` back; `SlotError` if it is not held."""
        if slot not in self._owner:
            raise SlotError(f"KV slot {slot} is not in use.")
        del self._owner[slot]

    def slot_of(self, owner: Hashable) -> int | None:
        """The slot held by ``owner``, if any."""
        return next((s for s, o in self._owner.items() if o == owner), None)

    @property
    def used(self) -> dict[int, Hashable]:
        """Held slots and their owners."""
        return dict(self._owner)

    @property
    def free_count(self) -> int:
        """How many slots are free."""
        return self.batch_size - len(self._owner)
