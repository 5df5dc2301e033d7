"""Evaluation on held-out scenarios: models, scripted baselines, humans and cross-play side by side.

Held-out scenarios. Evaluation scenario ``i`` under eval seed ``s`` has seed
``eval_scenario_seed(s, i)``, always odd; training scenario seeds are always even, so an
evaluation never replays a training scenario (both spaces, and why they are disjoint:
``selfplay.seeds``). Every row plays the same plan (``rollout.eval_plan``) through the same loop
and seating as ``selfplay generate`` (``rollout.play_many``, ``rollout.seating``).

``run_eval(config)`` plays, on the same ``num_scenarios`` held-out scenarios:

- every model of ``config.models`` (an HF directory or id, or ``embedded``) in self-play, or in
  seat 1 against a scripted ``partner`` in seat 2; greedy (temperature 0) by default, or sampled
  with ``games_per_scenario`` games per scenario;
- every scripted baseline (cooperative, no-talk, random) the same way (in self-play, or against
  the partner);
- with ``cross_play``, every ordered pair of distinct models (model A in seat 1, model B in seat 2)
  for a matrix of rewards and, per model, the gap between its self-play reward and its mean
  cross-play reward (a gap that widens across rounds means private conventions).

For a game with recorded human games (``DialogueGame.human``; matching: the 134 DialOp games) it
adds the human reference row, named with the size of the humans' tables (``humans (8x8)``) and
only when the evaluation plays that size (computed from the file when found, else the stored mean
with its source), and returns an ``EvalResult`` whose ``rows`` are the table.
Each row is built from ``metrics.summarize`` key by key (``summary_fields``): a summary key the row
neither has nor leaves out on purpose (``NOT_IN_ROW``) is an error, never a silent drop.

Engines. Each model is loaded once, on its own engine: ``config.engine`` is a template (any
``EngineConfig``: hf, SGLang or vLLM) whose ``model`` is replaced by the model's path; without
one, the hf engine on ``device`` with ``max_batch_size``. With ``cross_play`` all models are held
at once. A launched server serves model ``j`` (its position in ``models``) on port ``port + j``,
so that cross-play can hold them side by side. An attached server (``engine.url``: one server,
several models) is given each model's weights with ``load_weights(path)`` before that model's
rows (the path must be readable by the server; the server keeps the last model's weights
afterwards); it holds one model at a time, so cross-play refuses it. A model that cannot be
loaded, or whose engine dies, becomes a row with an ``error`` and the rest are still evaluated;
``run_eval`` raises ``EvalError`` only when every model failed, after the other rows are done
(``EvalError.result`` holds them).

``play_scripted`` / ``evaluate_scripted`` are the quick scripted-pair evaluation (one summary of
two scripted policies), used by ``selfplay eval --players`` and the run report.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfplay.engines import (
    Engine,
    EngineFailure,
    LentEngine,
    ServerEngineConfig,
    open_engine,
)
from selfplay.evaluate.config import (
    CrossPlay,
    EvalConfig,
    EvalError,
    EvalResult,
    EvalRow,
    Kind,
    ModelSpec,
    summary_fields,
)
from selfplay.evaluate.human import comparable, human_reference
from selfplay.generate.rollout import (
    GameSpec,
    Scenarios,
    SeatFactory,
    Seating,
    eval_plan,
    llm_seat,
    play_plan,
    scripted_seat,
    seating,
)
from selfplay.manifest import read_manifest
from selfplay.metrics import summarize
from selfplay.players.llm import ChatFormat, load_chat_format
from selfplay.players.partners import stored_partner
from selfplay.records import GameRecord, append_records
from selfplay.seeds import EVAL_SPACE as EVAL_SPACE  # re-exports: the held-out seed space
from selfplay.seeds import eval_game_seed as eval_game_seed  # lived here before selfplay.seeds
from selfplay.seeds import heldout_scenario_seed

log = logging.getLogger(__name__)


def run_models(run: str, data_root: str | Path = "data") -> list[ModelSpec]:
    """The models of a `selfplay iterate` run: the initial model, then each trained checkpoint
    (labelled ``initial``, ``round_0``, ``round_1``, ... after checkpoints/RUN/round_K)."""
    path = Path(data_root) / run / "manifest.json"
    if not path.is_file():
        raise EvalError(
            f"{path} does not exist: name a run started with `selfplay iterate` "
            "(and pass --data-root when it is not under data/)"
        )
    manifest = read_manifest(path)
    initial = (
        manifest.rounds[min(manifest.rounds)].model if manifest.rounds else manifest.settings.model
    )
    if not initial:
        raise EvalError(f"{path} names no initial model; is it a selfplay run manifest?")
    specs = [ModelSpec(label="initial", model=str(initial))]
    for k in sorted(manifest.rounds):
        train = manifest.rounds[k].stages.get("train")
        if train is not None and "model" in train.artifacts:
            specs.append(ModelSpec(label=f"round_{k}", model=train.artifacts["model"]))
    return specs


@dataclass
class _Loaded:
    spec: ModelSpec
    path: str
    engine: Engine
    chat: ChatFormat


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


class _Evaluation:
    """One evaluation in progress: the plan and its scenarios, the partner, loading models."""

    def __init__(self, config: EvalConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.lent = engine  # an engine the caller started and closes, for the one model
        self.seeds = [
            heldout_scenario_seed(config.split, config.seed, i) for i in range(config.num_scenarios)
        ]
        self.plan = eval_plan(
            config.seed, config.num_scenarios, config.games_per_scenario, config.split
        )
        self.game = config.game
        self.scenarios = Scenarios(config.table_size, keep=True, game=self.game)  # every row
        self.games_dir = config.out / "games" if config.out is not None else None
        self.partner_client = None  # an API partner's client, shared by every row

    async def prepare(self) -> None:
        from selfplay.players.api import api_partner_config, open_partner_client

        cfg = self.config
        await self.scenarios.warm(self.plan)
        if self.games_dir is not None:
            self.games_dir.mkdir(parents=True, exist_ok=True)
        api = api_partner_config(cfg, cfg.out)
        if api is not None:
            self.partner_client = open_partner_client(api)

    async def aclose(self) -> None:
        self.scenarios.close()
        if self.partner_client is not None:
            await self.partner_client.aclose()

    def seating(self, policy: SeatFactory) -> Seating:
        """``policy`` in ``policy_seat`` across the configured partner (or in both seats)."""
        cfg = self.config
        return seating(
            policy,
            cfg.partner,
            policy_seat=cfg.policy_seat,
            partner_client=self.partner_client,
            game=self.game,
        )

    def llm(self, lm: _Loaded) -> SeatFactory:
        return llm_seat(lm.engine, lm.chat, self.config.sampling, name=lm.path, trained=False)

    async def play(self, file: str, seats: Seating, *, quiet: bool = False) -> list[GameRecord]:
        """Every game of one row (all scenarios x games_per_scenario), in plan order."""
        cfg = self.config
        total = len(self.plan)
        every = max(1, total // 10)
        done = 0

        def finished(spec: GameSpec, record: GameRecord) -> None:
            nonlocal done
            done += 1
            if done % every == 0 or done == total:
                level = logging.DEBUG if quiet else logging.INFO
                log.log(level, "eval %s: %d/%d games", file, done, total)

        records = await play_plan(
            self.plan,
            seats,
            self.scenarios,
            concurrency=cfg.concurrency,
            max_actions=cfg.max_actions,
            max_invalid=cfg.max_invalid,
            on_game=finished,
        )
        if self.games_dir is not None:
            path = self.games_dir / f"{_slug(file)}.jsonl"
            path.unlink(missing_ok=True)
            await asyncio.to_thread(append_records, path, records)
        return records

    async def load(self, spec: ModelSpec) -> _Loaded:
        """Start ``spec``'s engine (an attached server is given its weights)."""
        from selfplay.models import resolve_model

        path = await asyncio.to_thread(resolve_model, spec.model)
        chat = await asyncio.to_thread(load_chat_format, path)
        if self.lent is not None:
            return _Loaded(spec, path, LentEngine(self.lent), chat)
        engine_cfg = self.config.engine_for(path, self.config.models.index(spec))
        engine = await asyncio.to_thread(open_engine, engine_cfg)
        try:
            await engine.start()
            if isinstance(engine_cfg, ServerEngineConfig) and engine_cfg.url:
                await engine.load_weights(path)  # type: ignore[attr-defined]
        except BaseException:
            await engine.aclose()
            raise
        return _Loaded(spec, path, engine, chat)


def _row(name: str, kind: Kind, seat0: str, seat1: str, records, started: float, **extra):
    return EvalRow(
        name=name,
        kind=kind,
        seat0=seat0,
        seat1=seat1,
        seconds=time.perf_counter() - started,
        **extra,
        **summary_fields(summarize(records)),
    )


def _ordered(names: tuple[str, str], config: EvalConfig) -> tuple[str, str]:
    """(policy, partner) names in seat order: the policy takes seat ``config.policy_seat``."""
    return names if config.policy_seat == 1 else (names[1], names[0])


async def run_eval_async(config: EvalConfig, *, engine: Engine | None = None) -> EvalResult:
    """Evaluate every model, baseline and (optionally) model pair; see the module docstring.
    ``engine``: for a config of one model, an engine serving it that the caller started and
    closes (the model then plays on it, beside whatever else the caller runs there)."""
    if engine is not None and len(config.models) != 1:
        raise ValueError("a lent engine serves one model; this evaluation has several")
    started = time.perf_counter()
    ev = _Evaluation(config, engine)
    rows: list[EvalRow] = []
    errors: dict[str, str] = {}
    kept: list[_Loaded] = []  # engines open now: the models held for cross-play, or the current
    partner = stored_partner(config.partner)  # a row's name for it (None: self-play)

    def failed(label: str, names: tuple[str, str], model: str, msg: str) -> None:
        """A model's row when it could not be evaluated; the others still are."""
        log.error("%s", msg)
        errors[label] = msg
        seat0, seat1 = names
        rows.append(
            EvalRow(name=label, kind="model", seat0=seat0, seat1=seat1, model=model, error=msg)
        )

    try:
        await ev.prepare()
        for spec in config.models:
            t0 = time.perf_counter()
            names = _ordered((spec.label, partner or spec.label), config)

            try:
                lm = await ev.load(spec)
            except Exception as e:  # any loading failure is this model's, not the evaluation's
                msg = f"model {spec.label!r} ({spec.model}) could not be loaded: "
                failed(spec.label, names, spec.model, msg + f"{type(e).__name__}: {e}")
                continue
            kept.append(lm)  # closed below whatever happens (Ctrl-C included)
            try:
                log.info("eval: %s (%d games)", spec.label, len(ev.plan))
                records = await ev.play(f"model-{spec.label}", ev.seating(ev.llm(lm)))
            except EngineFailure as e:
                msg = f"model {spec.label!r} ({lm.path}) failed while playing: {e}"
                failed(spec.label, names, lm.path, msg)
                kept.remove(lm)
                await lm.engine.aclose()
                continue
            rows.append(_row(spec.label, "model", *names, records, t0, model=lm.path))
            log.info("eval: %s reward %.3f", spec.label, rows[-1].reward_mean or 0.0)
            if not config.cross_play:
                kept.remove(lm)
                await lm.engine.aclose()
        cross = await _cross_play(ev, kept, rows, errors) if len(kept) >= 2 else None
        for name in config.baselines:
            t0 = time.perf_counter()
            seats = ev.seating(scripted_seat(name, ev.game))
            records = await ev.play(f"baseline-{name}", seats, quiet=True)
            names = _ordered((name, partner or name), config)
            rows.append(_row(name, "baseline", *names, records, t0))
    finally:
        for lm in kept:
            await lm.engine.aclose()
        await ev.aclose()
    game = config.game
    if comparable(game, config.table_size):  # humans played this size: their row compares
        rows.append(human_reference(game, config.human_data))
    elif game.human is not None:
        log.info(
            "eval: no human row: humans played %sx%s tables, this evaluation %sx%s",
            *(game.human.table_size,) * 2,
            *(config.table_size,) * 2,
        )
    result = EvalResult(
        config=config,
        scenario_seeds=ev.seeds,
        rows=rows,
        cross_play=cross,
        errors=errors,
        seconds=time.perf_counter() - started,
    )
    if all(r.error for r in rows if r.kind == "model"):
        raise EvalError(
            "no model could be evaluated:\n" + "\n".join(f"- {m}" for m in errors.values()),
            result,
        )
    return result


async def _cross_play(
    ev: _Evaluation, kept: Sequence[_Loaded], rows: list[EvalRow], errors: dict[str, str]
) -> CrossPlay | None:
    labels = [lm.spec.label for lm in kept]
    self_play = {r.name: r for r in rows if r.kind == "model" and r.error is None}
    n = len(kept)
    reward: list[list[float | None]] = [[None] * n for _ in range(n)]
    games = [[0] * n for _ in range(n)]
    for i, a in enumerate(kept):
        reward[i][i] = self_play[a.spec.label].reward_mean
        games[i][i] = self_play[a.spec.label].games
        for j, b in enumerate(kept):
            if i == j:
                continue
            t0 = time.perf_counter()
            name = f"{a.spec.label} + {b.spec.label}"
            log.info("eval: cross-play %s", name)
            try:
                records = await ev.play(f"cross-{name}", Seating(ev.llm(a), ev.llm(b)))
            except EngineFailure as e:
                errors[name] = f"cross-play {name} failed: {e}"
                rows.append(
                    EvalRow(
                        name=name,
                        kind="cross",
                        seat0=a.spec.label,
                        seat1=b.spec.label,
                        error=errors[name],
                    )
                )
                continue
            row = _row(name, "cross", a.spec.label, b.spec.label, records, t0)
            rows.append(row)
            reward[i][j], games[i][j] = row.reward_mean, row.games
    cross_mean, gap = {}, {}
    for i, label in enumerate(labels):
        others = [v for j in range(n) if j != i for v in (reward[i][j], reward[j][i])]
        others = [v for v in others if v is not None]
        own = reward[i][i]
        cross_mean[label] = float(np.mean(others)) if others else None
        gap[label] = own - cross_mean[label] if own is not None and others else None
    return CrossPlay(
        models=labels,
        reward=reward,
        games=games,
        self_play={label: reward[i][i] for i, label in enumerate(labels)},
        cross_play_mean=cross_mean,
        gap=gap,
    )


def run_eval(config: EvalConfig) -> EvalResult:
    return asyncio.run(run_eval_async(config))
