"""The run's manifest on disk (``Run``): created, read back, replaced atomically; which rows of
the run's table (``Row``) are done, and where each row's record is kept."""

from __future__ import annotations

import logging
import platform
import shutil
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import orjson
from pydantic import BaseModel

from selfplay.fileio import atomic_write
from selfplay.iterate.config import ADDED_LATER, IterateConfig, IterateError, config_identity
from selfplay.manifest import (
    HeldoutInfo,
    Manifest,
    RoundRecord,
    RoundStats,
    StageRecord,
    TestInfo,
    read_manifest,
)
from selfplay.metrics import RoundMetrics
from selfplay.train.model_card import git_commit

log = logging.getLogger(__name__)


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("selfplay", "torch", "transformers", "verl", "numpy", "pyarrow", "sglang"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return out


def _shown(identity: dict, key: str) -> str:
    """A setting as a changed-configuration error shows it: config_identity leaves out a setting
    added later while it has its old default, so a missing one shows that default."""
    if key in identity:
        return repr(identity[key])
    return f"{ADDED_LATER[key]!r} (default)" if key in ADDED_LATER else "(none)"


ROUND_STAGES = ("generate", "convert", "train")  # a round's stages, in order


@dataclass(frozen=True)
class Row:
    """One row of the run's table (``loop.table``): a stage at its placement. ``at`` is the round
    of a round's stage; of the held-out stage, the rounds behind the model it evaluates (None:
    the initial model, before the warm start); unused by the warm start and the test split."""

    stage: str  # heldout, warm_start, generate, convert, train, test
    at: int | None = None
    beside: bool = False  # the held-out stage: played beside its round's generate when it can

    def __str__(self) -> str:
        if self.stage == "heldout":
            return "held-out evaluation of the " + (
                "initial model" if self.at is None else f"model after {self.at} round(s)"
            )
        return self.stage if self.at is None else f"round {self.at} {self.stage}"


class Run:
    """A run on disk: its manifest, loaded or created, and the loop that advances it."""

    def __init__(self, config: IterateConfig, *, force: bool = False) -> None:
        self.config = config
        self.path = config.run_dir / "manifest.json"
        config.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self.manifest = read_manifest(self.path)
            self._check_same(force)
        else:
            self.manifest = Manifest(
                name=config.name,
                config=config.model_dump(mode="json"),
                created_at=time.time(),
                versions=package_versions(),
                git_commit=git_commit(),
            )
            self.save()

    def _check_same(self, force: bool) -> None:
        old = config_identity(self.manifest.config)
        new = self.config.identity()
        diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        if diff and not self.started():
            log.info(
                "run %s had not produced anything yet: taking the new options", self.config.name
            )
            self.manifest.rounds = {}
        elif diff and not force:
            details = "; ".join(f"{k}: {_shown(old, k)} -> {_shown(new, k)}" for k in diff)
            raise IterateError(
                f"run {self.config.name!r} was started with another configuration ({details}). "
                "Use the same options to resume, another --name for a new run, or --force to "
                "continue with the new options."
            )
        if diff:
            log.warning("--force: continuing run %s with changed %s", self.config.name, diff)
        self.manifest.config = self.config.model_dump(mode="json")
        self.save()

    def started(self) -> bool:
        """Whether the run has produced anything: a finished stage or a played game (until then
        a corrected command may change the options)."""
        m = self.manifest
        if m.warm_start or m.heldout or m.heldout_initial:
            return True
        for k, r in m.rounds.items():
            games = self.config.round_dir(k) / "games.jsonl"
            if r.stages or (games.exists() and games.stat().st_size > 0):
                return True
        return False

    def save(self) -> None:
        atomic_write(self.path, orjson.dumps(self.manifest.model_dump(mode="json")))

    # What the loop records, each saved at once (the manifest is replaced atomically, so a kill
    # anywhere leaves either the state before or after the record).

    def start_round(self, k: int, model: str) -> RoundRecord:
        """Round ``k``'s record (created for ``model``, or resumed: then it must match)."""
        rnd = self.manifest.rounds.setdefault(k, RoundRecord(model=model))
        if rnd.model != model:
            raise IterateError(
                f"round {k} was generated with {rnd.model}, but the previous round now gives "
                f"{model}"
            )
        self.save()
        return rnd

    def claim(self, out: Path, what: str) -> None:
        """Clear the way for a stage about to write the folder ``out``: remove what this run's
        own unfinished stage left there (the manifest says so), refuse anything else (another
        run's finished model, a user's files), and note ``out`` as begun, before any write."""
        key = str(out.resolve())
        if out.exists() or out.is_symlink():
            if key not in self.manifest.unfinished:
                raise IterateError(
                    f"{out} is in the way of run {self.config.name!r}'s {what}: it exists, but "
                    "this run's manifest does not say this run made it (it may be an earlier "
                    "run's finished model, or files of yours), so it is left alone. Move it "
                    "away or delete it yourself, or choose another --name or --checkpoint-root"
                )
            log.warning("removing %s, left unfinished by this run's %s", out, what)
            shutil.rmtree(out)
        if key not in self.manifest.unfinished:
            self.manifest.unfinished.append(key)
            self.save()

    def done(self, row: Row) -> bool:
        """Whether ``row``'s stage finished (its record is in the manifest)."""
        m = self.manifest
        if row.stage == "heldout":
            return m.heldout_initial is not None if row.at is None else row.at in m.heldout
        if row.stage == "warm_start":
            return m.warm_start is not None
        if row.stage == "test":
            return bool(m.test)
        return row.at in m.rounds and row.stage in m.rounds[row.at].stages

    def record(self, row: Row, rec: StageRecord, made: Path | None = None) -> None:
        """Record ``row``'s finished stage; ``made``: the folder it claimed, now finished. A
        round's stage goes into its round; the warm start into ``warm_start``; a held-out result
        into ``heldout`` (``heldout_initial`` for the initial model) with the baselines when they
        were played; the test split's rows into ``test``: where every reader looks for them."""
        m = self.manifest
        if row.stage == "heldout":
            assert isinstance(rec.info, HeldoutInfo)
            if row.at is None:
                m.heldout_initial = rec.info.result
            else:
                m.heldout[row.at] = rec.info.result
            if rec.info.baselines:
                m.baselines = rec.info.baselines
        elif row.stage == "warm_start":
            m.warm_start = rec
        elif row.stage == "test":
            assert isinstance(rec.info, TestInfo)
            m.test = rec.info.rows
        else:
            assert row.at is not None and row.stage in ROUND_STAGES, row
            m.rounds[row.at].stages[row.stage] = rec
        self._finished(made)
        self.save()
        if row.stage == "heldout":
            self.write_metrics()

    def _finished(self, made: Path | None) -> None:
        if made is not None:
            key = str(made.resolve())
            self.manifest.unfinished = [p for p in self.manifest.unfinished if p != key]

    def record_round_metrics(self, k: int, metrics: RoundStats) -> None:
        self.manifest.rounds[k].metrics = metrics
        self.save()
        self.write_metrics()

    def write_metrics(self) -> None:
        """metrics.jsonl: per finished round its games' statistics, its training, and the
        held-out results of the model it started from (``heldout``) and of the one it produced
        (``heldout_after``, once evaluated)."""
        held = self.manifest.heldout
        lines = [
            orjson.dumps(
                RoundMetrics(
                    round=k,
                    **r.metrics.model_dump(),
                    heldout=held.get(k),
                    heldout_after=held.get(k + 1),
                ).model_dump(mode="json")
            )
            for k, r in sorted(self.manifest.rounds.items())
            if r.metrics is not None
        ]
        atomic_write(self.config.run_dir / "metrics.jsonl", b"".join(x + b"\n" for x in lines))


def _dump(model: BaseModel | None) -> dict | None:
    return None if model is None else model.model_dump(mode="json")
