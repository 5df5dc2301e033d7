"""One writer per output folder: an advisory lock file that names its holder.

``folder_lock(folder, what)`` holds ``FOLDER/.selfplay.lock`` (``fcntl.flock``) while a command
writes there, and writes the holder's pid, command and start time into it. A second writer is
refused at once with ``FolderBusy`` naming the holder. The kernel drops the lock when its holder
exits, however it exits (``kill -9`` included), so the lock of a dead process is taken over
without any clean-up: the file may stay behind, its lock does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from selfplay.errors import UserError

LOCK_NAME = ".selfplay.lock"


class FolderBusy(UserError, RuntimeError):
    """Another live process is writing to the folder; says which one."""


@contextlib.contextmanager
def folder_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold the folder's lock for the duration of the block (creates the folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 1024, 0).decode(errors="replace").strip() or "another process"
            raise FolderBusy(
                f"{folder} is in use by {holder}; wait for it to finish or stop it (two writers "
                "would write the same games or checkpoints twice), or choose another output"
            ) from None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({what}, since {stamp})".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the lock
