"""selfplay.fileio: files replaced whole or not at all."""

from __future__ import annotations

import os

import pytest

from selfplay import fileio


def test_atomic_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "manifest.json"
    fileio.atomic_write(path, "old\n")
    fileio.atomic_write(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary left


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    fileio.atomic_write(path, "old\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        fileio.atomic_write(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
