"""A heavy stage in a spawned child process (``isolated``), its logging, progress lines and peak
memory; the kill-test hook ``SELFPLAY_HOLD_BEFORE``.

A stage dies with the loop that started it. The child watches its parent (``_watch_parent``):
when the iterate process is gone (SIGKILL, a crash), the child stops its stage as SIGTERM would
(``finally`` blocks run: an engine server is shut down, the folder lock released) and exits
within ``PARENT_GRACE_S``. When the loop stops on purpose (Ctrl-C, SIGTERM, an error), it
terminates the child before it returns. So no stage outlives the run, holds its lock, or trains
into its folder beside a re-run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selfplay.generate.config import GenerateConfig

log = logging.getLogger(__name__)


# A testing aid for kill tests: with SELFPLAY_HOLD_BEFORE=convert (or train) the run touches
# data/RUN/holding_<stage> when that stage starts and waits there until it is killed.
HOLD_ENV = "SELFPLAY_HOLD_BEFORE"


def hold_if_asked(run_dir: Path, stage: str) -> None:
    if os.environ.get(HOLD_ENV) == stage:
        (run_dir / f"holding_{stage}").touch()
        log.warning("%s=%s: holding before %s until killed", HOLD_ENV, stage, stage)
        while True:
            time.sleep(1)


Generate = Callable[[GenerateConfig, Any], Any]


# The run's log file (data/RUN/run.log), set by the loop before its first stage: a stage child
# (not under -v) sends its stdout and stderr there, so verl's, torch's and transformers' prints,
# warnings and bars are kept in the file and the console shows this package's lines only.
STAGE_LOG_ENV = "SELFPLAY_STAGE_LOG"
_console = None  # the child's console stream (its stderr before it went to the log file)


def stage_progress(label: str):
    """A stage's progress: a bar on the console when it is a terminal, else log lines."""
    from selfplay.generate.runner import progress_for

    return progress_for(_console or sys.stderr, label)


def default_generate(gen_cfg: GenerateConfig, engine_cfg) -> None:
    from selfplay.generate.runner import run_generate

    run_generate(gen_cfg, engine_cfg, stage_progress(f"round {gen_cfg.round} generate"))


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _quiet_to(path: str) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2: prints, warnings, C++
    notes, progress bars of every library) to ``path``, and this package's log records to the
    console as well (a handler on the ``selfplay`` logger over a copy of the old stderr)."""
    import sys

    from selfplay.fileio import open_output

    global _console
    _console = os.fdopen(os.dup(2), "w", buffering=1)
    with open_output(path, "ab") as f:
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    ours = logging.StreamHandler(_console)
    ours.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger("selfplay").addHandler(ours)


def _child_logging(level: int) -> None:
    path = os.environ.get(STAGE_LOG_ENV)
    if path and level > logging.DEBUG:
        _quiet_to(path)
    logging.basicConfig(level=level, format=LOG_FORMAT)
    if level > logging.DEBUG:  # as the CLI does: verl's notes on engines it lacks are noise
        import warnings

        warnings.filterwarnings("ignore", message=r".* engine is not available")
        warnings.filterwarnings("ignore", category=DeprecationWarning)


PARENT_GRACE_S = 20.0  # from the parent's death to the child's exit, at most (plus one poll)


def _watch_parent(parent: int, poll_s: float = 0.5) -> None:
    """In a stage's child: SIGTERM raises SystemExit (so the stage's cleanup runs), and a daemon
    thread sends it when the parent ``parent`` is gone, then exits after ``PARENT_GRACE_S``."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("the iterate process (pid %d) is gone: stopping this stage", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _child_start(level: int, parent: int) -> None:
    _child_logging(level)
    _watch_parent(parent)
    from selfplay.engines import KEEP_MODEL_ENV

    os.environ[KEEP_MODEL_ENV] = "1"  # a held-out evaluation and generate share one model load


def _measured(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the peak resident memory (MiB) of this call: the process's high-water
    mark is reset first where Linux allows it, so a child that runs several stages reports each
    stage's own peak (elsewhere: the process's peak so far)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM
    result = fn(*args)
    peak = _status_mb("VmHWM")
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return result, peak


class StageChild:
    """A fresh (spawned) child process for one stage or a few consecutive ones.

    A stage's memory (models, KV caches, allocator arenas) is returned to the system when the
    child exits, so a run's memory does not grow round by round, and process-wide settings a
    stage makes (torch's thread count, the process group) end with it. Consecutive stages that
    play with the same model (a held-out evaluation, then the next round's generate) may share a
    child: the imports and the model load (the hf engine keeps the last model it loaded in a
    stage child) are paid once. The process starts at the first ``run`` and ends at ``close``, or
    at once when a stage fails or is interrupted.
    """

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``fn(*args)`` in the child; its result (or its exception, re-raised here) and the
        call's peak resident memory in MiB."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_child_start,
                initargs=(logging.getLogger().getEffectiveLevel(), os.getpid()),
            )
        try:
            return self._pool.submit(_measured, fn, *args).result()
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM) or failed: the child must not finish the stage alone
            for process in list(getattr(self._pool, "_processes", {}).values()):
                if process.is_alive():
                    process.terminate()
            self.close()
            raise

    def close(self) -> None:
        """End the child (a no-op when none runs); the next ``run`` starts a fresh one."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> StageChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def isolated(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` in a child process of its own (``StageChild``); its result and the child's
    peak resident memory in MiB."""
    with StageChild() as child:
        return child.run(fn, *args)


def _status_mb(key: str) -> float | None:
    """A memory figure of this process (``VmRSS``: now, ``VmHWM``: its peak) in MiB, from
    /proc/self/status (Linux; None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def resident_mb() -> float | None:
    """This process's resident memory now, in MiB (Linux; None elsewhere)."""
    return _status_mb("VmRSS")
