"""The generate stage's output folder: generate.json (the options its games were planned with),
games.jsonl appended game by game (a failed write stops the run at once), resume, and the
final rewrite in plan order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson

from selfplay.errors import UserError
from selfplay.fileio import atomic_write, refuse_link
from selfplay.generate.config import ADDED_LATER, GenerateConfig
from selfplay.generate.rollout import GameSpec, training_plan
from selfplay.records import GameRecord, append_records, line_game_id, repair_jsonl_tail

log = logging.getLogger(__name__)


def plan_games(config: GenerateConfig) -> Iterator[GameSpec]:
    """The run's games in order: scenario 0's K games, scenario 1's, ... (lazy)."""
    return training_plan(config.seed, config.round, config.num_games, config.games_per_scenario)


class OutputMismatch(UserError, ValueError):
    """OUT already holds games planned with other options."""


def prepare_output(config: GenerateConfig, *, record: bool = True) -> dict[str, float]:
    """Create OUT, check generate.json (and write it, with ``record``), repair a torn tail;
    return {game_id: reward}. ``run_generate`` records the options only once the engine has
    started, so a typo (a model that does not load) does not tie the folder to its options."""
    config.out.mkdir(parents=True, exist_ok=True)
    for path in (config.games_path, config.snapshot_path):
        refuse_link(path)  # before a game is played: its appends would go wherever a link points
    snap = config.snapshot_path
    identity = config.identity()
    if snap.exists():
        try:
            old = json.loads(snap.read_text())["identity"]
        except (ValueError, KeyError, TypeError) as e:
            raise OutputMismatch(
                f"{snap} is not a generate.json this selfplay can read ({e}); it names the "
                "options the folder's games were planned with: restore it, or choose another --out"
            ) from None

        # a key either side lacks has the value runs had before it existed (ADDED_LATER); a key
        # this selfplay does not know at all is a difference too, never ignored
        def value(ident: dict, key: str):
            return ident.get(key, ADDED_LATER.get(key, "(not an option of this selfplay)"))

        keys = [*identity, *(k for k in old if k not in identity)]
        diff = {k: (value(old, k), value(identity, k)) for k in keys}
        diff = {k: (a, b) for k, (a, b) in diff.items() if a != b}
        if diff:
            detail = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise OutputMismatch(
                f"{config.out} holds games generated with other options ({detail}). Re-run with "
                "the same options to resume, or choose another --out"
            )
    elif config.games_path.exists() and config.games_path.stat().st_size:
        raise OutputMismatch(
            f"{config.out} holds games but no generate.json (the options they were planned "
            "with), so they cannot be told apart from games of other options: restore it, move "
            "the games away, or choose another --out"
        )
    elif record:
        record_options(config)
    repair_jsonl_tail(config.games_path)  # logs a warning when it drops a torn line
    return scan_games(config.games_path)


def record_options(config: GenerateConfig) -> None:
    """Write OUT/generate.json: the options that decide which games the folder holds."""
    snap = config.snapshot_path
    if not snap.exists():
        atomic_write(snap, json.dumps({"identity": config.identity()}, indent=2) + "\n")


def write_in_plan_order(config: GenerateConfig) -> bool:
    """Rewrite OUT/games.jsonl with its games in plan order (each line byte for byte; lines of
    no planned game after them, in file order), so that the file does not depend on when games
    finished: a resumed run and an uninterrupted one give the same file, rows and model. Replaced
    atomically (fsync, rename); returns whether the order changed."""
    path = config.games_path
    position = {spec.game_id: i for i, spec in enumerate(plan_games(config))}
    lines = [line for line in path.read_bytes().splitlines(keepends=True) if line.strip()]

    def key(item: tuple[int, bytes]) -> tuple[int, int]:
        index, line = item
        return (position.get(line_game_id(line), len(position)), index)

    ordered = [line for _, line in sorted(enumerate(lines), key=key)]
    if ordered == lines:
        return False
    atomic_write(path, b"".join(ordered))
    log.info("%s: %d games written in plan order", path, len(ordered))
    return True


def scan_games(path: Path) -> dict[str, float]:
    """{game_id: reward} of the complete records in a games.jsonl (corrupt lines are skipped)."""
    found: dict[str, float] = {}
    if not path.exists():
        return found
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
                found[obj["game_id"]] = float(obj["reward"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning(
                    "%s:%d: skipping a corrupt line (the game will be played again)", path, lineno
                )
    return found


class GamesWriteError(UserError, OSError):
    """A finished game could not be written (a full disk, a file-size limit): generation stops
    at once instead of playing games that cannot be kept."""


class GamesWriter:
    """Appends finished records; games that finish together share one write and fsync. A write
    that fails stops the writer and calls ``on_error`` (the run cancels its games)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error: OSError | None = None
        self.on_error: Callable[[], object] = lambda: None
        self._buffer: list[GameRecord] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="games-writer")

    def put(self, record: GameRecord) -> None:
        self._buffer.append(record)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._buffer:
                batch, self._buffer = self._buffer, []
                try:
                    await asyncio.to_thread(append_records, self.path, batch)
                except OSError as e:
                    self.error = e
                    self.on_error()
                    return
            if self._closing:
                return

    async def close(self) -> None:
        """Write everything buffered, even while the caller is being cancelled."""
        self._closing = True
        self._wake.set()
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            await self._task  # finish the write in progress before leaving
            raise
        finally:
            if self._buffer and self.error is None:  # the writer died; never lose a finished game
                append_records(self.path, self._buffer)
                self._buffer = []

    def failure(self) -> GamesWriteError:
        """The error to stop the run with: the file, the cause, the free space, what is kept."""
        assert self.error is not None
        try:
            free = f"{shutil.disk_usage(self.path.parent).free / 2**20:.0f} MiB are free there"
        except OSError:
            free = "its free space is unknown"
        kept = len(scan_games(self.path))
        return GamesWriteError(
            f"writing {self.path} failed ({self.error.strerror or self.error}); {free}. "
            f"Generation stopped at once; {kept} finished games are kept in it. Free space (or "
            "raise the file-size limit) and re-run the same command to play the rest"
        )
