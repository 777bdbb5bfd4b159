"""gockpt.core.paths: the one rule by which a string names a directory (the kernel's)."""

from __future__ import annotations

import os
import pathlib

import pytest

from gockpt.core.errors import CheckpointNotFoundError
from gockpt.core.paths import directory_to_read, real_directory


def test_an_existing_directory_is_absolute_and_free_of_links(tmp_path, monkeypatch):
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    real = os.path.realpath(tmp_path)
    assert real_directory("link") == os.path.join(real, "real", "sub")
    assert real_directory("./real//sub/.") == os.path.join(real, "real", "sub")
    assert real_directory(pathlib.Path("real")) == os.path.join(real, "real")
    assert real_directory(b"real") == os.path.join(real, "real")


def test_dotdot_after_a_link_is_the_parent_of_its_target(tmp_path, monkeypatch):
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    # as the kernel reads it (ls, open, cd -P), not as text (which would give ./run)
    assert real_directory("link/../run") == os.path.join(os.path.realpath(tmp_path), "real", "run")


def test_what_does_not_exist_yet_is_appended_as_plain_names(tmp_path):
    got = real_directory(str(tmp_path / "a" / "." / "b"))
    assert got == os.path.join(os.path.realpath(tmp_path), "a", "b")
    assert not (tmp_path / "a").exists()  # nothing is created


def test_dotdot_after_a_missing_name_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'x' does not exist, so 'x/\.\.'"):
        real_directory("./x/../ckpt")
    assert os.listdir(tmp_path) == []


def test_a_file_in_the_path_or_an_empty_path_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        real_directory(str(tmp_path / "f" / "run"))
    with pytest.raises(FileNotFoundError, match="an empty path names no directory"):
        real_directory("")
    with pytest.raises(TypeError):
        real_directory(3)


def test_the_path_is_fixed_when_resolved(tmp_path, monkeypatch):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    monkeypatch.chdir(tmp_path / "one")
    got = real_directory("run")
    monkeypatch.chdir(tmp_path / "two")  # a later chdir does not move it
    assert got == os.path.join(os.path.realpath(tmp_path), "one", "run")


def test_directory_to_read_says_why_where_it_names_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert directory_to_read(".") == os.path.realpath(tmp_path)
    assert directory_to_read("later") == os.path.join(os.path.realpath(tmp_path), "later")
    with pytest.raises(CheckpointNotFoundError, match=r"'x/\.\./ck' does not exist") as err:
        directory_to_read("x/../ck")
    assert isinstance(err.value.__cause__, FileNotFoundError)
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="'f/ck' does not exist"):
        directory_to_read("f/ck")
