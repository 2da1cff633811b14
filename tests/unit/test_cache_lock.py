"""`cache_dir.cache_lock`: exclusive across holders, and safe when its holder deletes the lock file (a cache clear or
prune removing an entry): whoever waited on the deleted file locks the file now at the path instead."""

from __future__ import annotations

import threading
from pathlib import Path

from optimum.neuron.cache_dir import cache_lock


def test_a_held_lock_is_refused_without_waiting(tmp_path: Path) -> None:
    lock = tmp_path / "entry.lock"
    with cache_lock(lock) as held:
        assert held
        with cache_lock(lock, wait=False) as other:
            assert not other
    with cache_lock(lock, wait=False) as after:
        assert after


def test_a_waiter_on_a_deleted_lock_file_locks_the_new_one(tmp_path: Path) -> None:
    """The holder deletes the lock file while another holder waits on it: once released, the waiter must hold the
    lock of the file at the path, so that a third process cannot take that lock beside it."""
    lock = tmp_path / "entry.lock"
    waiting, inside, release = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def waiter() -> None:
        waiting.set()
        with cache_lock(lock) as held:
            seen.append(held)
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=waiter)
    with cache_lock(lock) as held:
        assert held
        thread.start()
        waiting.wait(10)
        threading.Event().wait(0.2)  # let the waiter open the file and block on it
        lock.unlink()
    assert inside.wait(10), "the waiter never got the lock"
    try:
        assert lock.is_file(), "the waiter did not lock a file at the path"
        with cache_lock(lock, wait=False) as third:
            assert not third, "two holders: the waiter locked the deleted file"
    finally:
        release.set()
        thread.join(10)
    assert seen == [True]
