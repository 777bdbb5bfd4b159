"""gockpt.storage.lock: one writer per checkpoint directory, named when refused, released on
close or death."""

from __future__ import annotations

import os

import pytest

from gockpt.errors import DirectoryInUseError, StorageError
from gockpt.storage.lock import LOCK_FILE, DirectoryLock


def test_a_second_lock_is_refused_naming_the_holder_until_released(tmp_path):
    first = DirectoryLock(str(tmp_path))
    assert first.held and os.path.exists(tmp_path / LOCK_FILE)
    with pytest.raises(DirectoryInUseError, match=f"pid {os.getpid()} on host .*, since"):
        DirectoryLock(str(tmp_path))
    first.release()
    first.release()  # idempotent
    assert not first.held
    second = DirectoryLock(str(tmp_path))  # the file stays; the lock is free again
    second.release()


def test_an_unreadable_holder_is_still_refused(tmp_path):
    first = DirectoryLock(str(tmp_path))
    (tmp_path / LOCK_FILE).write_text("not json")
    with pytest.raises(DirectoryInUseError, match="holder unknown"):
        DirectoryLock(str(tmp_path))
    first.release()


def test_a_directory_that_cannot_hold_the_lock_file_is_a_storage_error(tmp_path):
    with pytest.raises(StorageError, match="cannot create the lock file"):
        DirectoryLock(str(tmp_path / "missing"))


def test_the_shared_lock_of_other_ranks_holds_nothing():
    shared = DirectoryLock.shared()
    assert not shared.held
    shared.release()
