"""``scoped_env``: set environment variables for a block and put every one back afterwards.

The one place the process environment is saved and restored: the trackers get their folders as
variables for the time they start (``tracking``), and the in-process trainer undoes what process
group setup and verl write there (``train.workers``), so that nothing leaks into the subprocesses
started later (``selfplay iterate`` runs its stages as subprocesses).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping


@contextlib.contextmanager
def scoped_env(
    values: Mapping[str, str] | None = None, *, keys: Iterable[str] = ()
) -> Iterator[None]:
    """Set ``values`` for the block; on exit every variable of ``values`` and ``keys`` (those the
    block itself may write) has its value from before, or is unset where it was unset, whatever
    the block did and however it ended."""
    values = dict(values or {})
    saved = {k: os.environ.get(k) for k in (*values, *keys)}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
