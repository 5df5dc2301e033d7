"""Writing files safely: one writer per output folder, and files replaced whole or not at all.

``atomic_write(path, data)`` writes a sibling temporary file, fsyncs it and renames it over
``path``, so a reader (or a resume after a crash) sees the old file or the new one, never half of
one; a failed write leaves no temporary file behind. Every single-file writer of the project
(manifest, metrics, eval.json, generate.json, model cards, config.json) goes through it.

``check_name(name)``: a run's name (``--name``, ``EXP_NAME``) is one folder under data/ and
checkpoints/, never a path out of them.

``folder_lock(folder, what)`` holds ``FOLDER/.selfplay.lock`` (``fcntl.flock``) while a command
writes there (``output_lock(out, what)``: ``.NAME.lock`` beside an output folder that is made
only at the end, a trained model's), and writes the holder's pid, command and start time into
it. A second writer is refused at once with ``FolderBusy`` naming the holder. The kernel drops
the lock when its holder exits, however it exits (``kill -9`` included), so the lock of a dead
process is taken over without any clean-up: the file may stay behind, its lock does not.

No output is written through a symbolic link: a link planted where an output goes (dangling, or
to a file elsewhere) would send the run's writes to its target, or be replaced by them.
``open_output(path, mode)`` opens with ``O_NOFOLLOW`` and ``refuse_link(path)`` checks before a
rename; both raise ``LinkRefused`` naming the path. A link to the output *folder* is followed:
that is how users put data on another disk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from selfplay.errors import UserError

LOCK_NAME = ".selfplay.lock"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(name: str) -> str:
    """``name`` when it is a run name (one folder's name), else ``ValueError`` saying in words
    what a name may contain."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a run name: a name is letters, digits, '.', '_' and '-', starting "
            "with a letter or digit (no '/', no spaces), since it names one folder under data/ "
            "and checkpoints/"
        )
    return name


class FolderBusy(UserError, RuntimeError):
    """Another live process is writing to the folder; says which one."""


class LinkRefused(UserError, OSError):
    """An output's path is a symbolic link: writing would go wherever it points."""


def _link_error(path: Path) -> LinkRefused:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return LinkRefused(
        f"{path} is a symbolic link{target}; selfplay writes its outputs only to plain files, "
        "never through a link: remove the link, or choose another output folder"
    )


def refuse_link(path: str | Path) -> Path:
    """``path``, unless it is a symbolic link (then ``LinkRefused``): check before a rename."""
    path = Path(path)
    if path.is_symlink():
        raise _link_error(path)
    return path


_MODES = {
    "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "wb": os.O_WRONLY | os.O_TRUNC | os.O_CREAT,
    "rb+": os.O_RDWR,
}


def open_output(path: str | Path, mode: str = "ab") -> IO[bytes]:
    """Open an output file (``ab``, ``wb`` or ``rb+``) without following a symbolic link."""
    path = Path(path)
    try:
        fd = os.open(path, _MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise
    return os.fdopen(fd, mode)


@contextlib.contextmanager
def folder_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold the folder's lock for the duration of the block (creates the folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / LOCK_NAME, str(folder), what):
        yield


@contextlib.contextmanager
def output_lock(out: Path, what: str) -> Iterator[None]:
    """Hold the lock of an output that is only created at the end (a trained model's folder):
    ``.NAME.lock`` beside it, so that a second writer into the same ``out`` is refused at once."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock", str(out), what):
        yield


@contextlib.contextmanager
def _locked(path: Path, name: str, what: str) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 1024, 0).decode(errors="replace").strip() or "another process"
            raise FolderBusy(
                f"{name} is in use by {holder}; wait for it to finish or stop it (two writers "
                "would write the same games or checkpoints twice), or choose another output"
            ) from None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({what}, since {stamp})".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Replace ``path`` by ``data`` atomically (temporary sibling, fsync, rename); a link at
    ``path`` is refused, not replaced."""
    path = refuse_link(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_output(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
