"""Play many self-play games at once and append each finished game to ``OUT/games.jsonl``.

- Games are planned deterministically (``rollout.training_plan``): scenario ``i`` has seed
  ``scenario_seed(run seed, round, i)``, always even (``selfplay.seeds``: evaluation seeds are odd,
  so eval never replays a training scenario), and its ``K`` games (``games_per_scenario``, so GRPO
  can compare them) have ids ``r{round}-s{scenario seed}-g{k}`` and seeds
  ``game_seed(run seed, round, i, k)``. Every sampling seed of a game derives from its seed (see
  ``LLMPlayer``), which the record stores.
- Games are played by ``rollout.play_many``, the loop eval uses too: up to ``concurrency`` games
  in flight (default: all missing games), all sharing one engine that batches their requests. A
  finished game is appended and fsynced at once (a writer task groups games that finish together
  into one write).
- Re-running the same command resumes: a torn last line is dropped with a warning, finished games
  are kept, only missing ones are played. ``OUT/generate.json`` holds the options that decide which
  games the folder contains; a re-run with different ones is refused with the differences named.
- An ``EngineFailure`` (dead server) stops the run: games in flight are cancelled, every finished
  game is kept, and the error says how to resume. Ctrl-C does the same.
- With a partner (``selfplay.players.partners``) the model plays seat ``policy_seat`` (its only
  trained seat) and a scripted policy or an API chat model the other (``rollout.seating``);
  ``policy_seat`` 2 lets the partner move first. An API partner is one ``PartnerClient`` per run
  (concurrency, reply cache in ``OUT/partner_cache.jsonl``, call cap); its spend goes into the
  summary (``partner``) and one line per run in ``OUT/partner_usage.jsonl``. Its spent cap stops
  the run like an engine failure.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import orjson

from selfplay.engines import Engine, EngineConfig, EngineFailure, LentEngine, open_engine
from selfplay.fileio import folder_lock
from selfplay.generate.config import GenerateConfig
from selfplay.generate.output import (
    GamesWriter,
    plan_games,
    prepare_output,
    record_options,
    write_in_plan_order,
)
from selfplay.generate.rollout import (
    GameSpec,
    Scenarios,
    Seating,
    llm_seat,
    play_many,
    seating,
)
from selfplay.metrics import GameSummary, Summary
from selfplay.players.api import (
    ApiPartnerConfig,
    PartnerCallCap,
    PartnerClient,
    api_partner_config,
    open_partner_client,
)
from selfplay.players.llm import ChatFormat, load_chat_format
from selfplay.records import GameRecord

log = logging.getLogger(__name__)


@dataclass
class RunStats:
    total: int
    resumed: int = 0
    played: int = 0
    reward_sum: float = 0.0
    generated_tokens: int = 0
    outcomes: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0

    @property
    def done(self) -> int:
        return self.resumed + self.played

    @property
    def elapsed(self) -> float:
        return self.seconds or (time.perf_counter() - self.started)

    @property
    def games_per_s(self) -> float:
        return self.played / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.done if self.done else math.nan


class Progress(Protocol):
    """Where the runner reports progress (the CLI passes a rich progress bar)."""

    def start(self, stats: RunStats) -> None: ...

    def update(self, stats: RunStats) -> None: ...

    def stop(self, stats: RunStats) -> None: ...


class RichProgress:
    """A rich progress bar: games done, games/s, tokens/s and mean reward so far."""

    def __init__(self, console) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]games"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = None

    def _info(self, stats: RunStats) -> str:
        return (
            f"{stats.games_per_s:6.2f} games/s {stats.tokens_per_s:8.0f} tok/s "
            f"reward {stats.mean_reward:.3f}"
        )

    def start(self, stats: RunStats) -> None:
        self._bar.start()
        self._task = self._bar.add_task(
            "generate", total=stats.total, completed=stats.done, info=self._info(stats)
        )

    def update(self, stats: RunStats) -> None:
        self._bar.update(self._task, completed=stats.done, info=self._info(stats))

    def stop(self, stats: RunStats) -> None:
        self.update(stats)
        self._bar.stop()


@dataclass
class GenerateResult:
    path: Path
    stats: RunStats
    summary: dict


def generate_seating(
    config: GenerateConfig,
    engine: Engine,
    chat: ChatFormat,
    partner_client: PartnerClient | None = None,
) -> Seating:
    """Who plays: the model in both seats (self-play) or in ``policy_seat`` across the partner."""
    policy = llm_seat(engine, chat, config.sampling, name=config.model)
    return seating(
        policy,
        config.partner,
        policy_seat=config.policy_seat,
        partner_client=partner_client,
        game=config.game,
    )


def partner_config(config: GenerateConfig) -> ApiPartnerConfig | None:
    """The API partner of a generate config (None for self-play and scripted partners)."""
    return api_partner_config(config, config.out, concurrency=config.partner_concurrency)


async def generate_games(
    config: GenerateConfig,
    engine: Engine,
    chat: ChatFormat,
    *,
    existing: dict[str, float] | None = None,
    progress: Progress | None = None,
    partner_client: PartnerClient | None = None,
    deterministic: bool = False,
) -> GenerateResult:
    """Play every planned game not yet in OUT/games.jsonl; return the run's stats and summary.

    An ``openai:MODEL`` partner needs ``partner_client`` (``run_generate`` opens one); the caller
    closes it. Its usage goes into ``summary.partner``. ``deterministic`` (the engine's
    ``--deterministic``): records keep no wall-clock seconds, so that two runs write the same
    bytes (the run's own time is in generate.json's stats).
    """
    seats = generate_seating(config, engine, chat, partner_client)  # checks the partner client
    if existing is None:
        existing = prepare_output(config)
    planned_ids = {s.game_id for s in plan_games(config)}
    kept_ids = planned_ids & existing.keys()
    kept = [existing[g] for g in kept_ids]
    stats = RunStats(total=config.num_games, resumed=len(kept), reward_sum=float(sum(kept)))
    to_play = config.num_games - len(kept)
    if existing.keys() - planned_ids:
        log.warning(
            "%s holds %d games outside this plan (a larger --num-games earlier?); they are kept",
            config.games_path,
            len(existing.keys() - planned_ids),
        )
    if stats.resumed:
        log.info("resuming: %d games kept, %d to play", stats.resumed, to_play)
    tokens_at_start = getattr(engine, "generated_tokens", None)
    # Everything alive now (torch, transformers, the model) lives as long as the run: keep it out
    # of the cyclic collector's full passes, which otherwise cost ~20% of the games' CPU time.
    gc.freeze()
    if progress:
        progress.start(stats)
    summary = Summary()  # this run's games as they finish; kept ones are read back at the end
    scenarios = Scenarios(config.table_size, game=config.game)
    writer = GamesWriter(config.games_path)

    def finished(spec: GameSpec, record: GameRecord) -> None:
        if deterministic:
            record = record.model_copy(update={"timings": {}})
        writer.put(record)
        summary.add(record)
        stats.played += 1
        stats.reward_sum += record.reward
        stats.outcomes[str(record.outcome)] += 1
        if tokens_at_start is None:
            stats.generated_tokens += sum(
                v for k, v in record.counts.items() if k.startswith("generated_seat")
            )
        else:
            stats.generated_tokens = engine.generated_tokens - tokens_at_start  # type: ignore[attr-defined]
        if progress:
            progress.update(stats)

    play = asyncio.ensure_future(
        play_many(
            (s for s in plan_games(config) if s.game_id not in existing),
            seats,
            scenarios,
            count=to_play,
            concurrency=config.concurrency,
            round=config.round,
            max_actions=config.max_actions,
            max_invalid=config.max_invalid,
            on_game=finished,
        )
    )
    writer.on_error = play.cancel  # a game that cannot be written stops them all at once
    try:
        await play
    except asyncio.CancelledError:
        if writer.error is None:  # cancelled by a failed write: raised below, once closed
            raise
    except EngineFailure as e:
        fix = (
            "re-run with a higher --partner-max-calls"
            if isinstance(e, PartnerCallCap)
            else "fix the engine and re-run the same command"
        )
        spent = ""
        if partner_client is not None:
            u = partner_client.usage
            spent = f" (partner: {u.calls} calls, {u.cache_hits} cache hits this run)"
        raise type(e)(
            f"{e}\n{stats.done} finished games are kept in {config.games_path}{spent}; {fix} "
            "to play the missing ones"
        ) from e
    finally:
        scenarios.close()
        await writer.close()
        stats.seconds = time.perf_counter() - stats.started
        if progress:
            progress.stop(stats)
    if writer.error is not None:
        raise writer.failure()
    for record in _summary_records(config.games_path, kept_ids):
        summary.add(record)
    result = summary.result()
    if partner_client is not None:
        result = result.model_copy(update={"partner": partner_client.usage.as_dict()})
    return GenerateResult(config.games_path, stats, result)


def _summary_records(path: Path, ids: set[str]) -> Iterator[GameRecord]:
    """The records of ``ids``, once each, without their token lists (streamed: memory stays
    flat)."""
    seen: set[str] = set()
    if not path.exists():
        return
    with path.open("rb") as f:
        for line in f:
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(obj, dict):  # a foreign line ([1, 2]): scan_games warned of it
                continue
            gid = obj.get("game_id")
            if gid in ids and gid not in seen:
                seen.add(gid)
                obj["tokens"] = [None, None]
                yield GameRecord.model_validate(obj)


async def run_generate_async(
    config: GenerateConfig,
    engine_config: EngineConfig,
    progress: Progress | None = None,
    *,
    engine: Engine | None = None,
) -> GenerateResult:
    """Check the output and the chat template, start the engine, play, always stop the engine.
    ``engine``: one the caller started (for ``engine_config``) and closes, used instead.

    Holds OUT's lock throughout: a second generate into the same folder is refused at once."""
    with folder_lock(config.out, "selfplay generate"):
        return await _run_generate_locked(config, engine_config, progress, engine)


async def _run_generate_locked(
    config: GenerateConfig,
    engine_config: EngineConfig,
    progress: Progress | None,
    lent: Engine | None,
) -> GenerateResult:
    existing = prepare_output(config, record=False)
    chat = await asyncio.to_thread(load_chat_format, engine_config.model)
    api = partner_config(config)
    partner_client = open_partner_client(api) if api is not None else None
    engine = open_engine(engine_config) if lent is None else LentEngine(lent)
    try:
        await engine.start()
        record_options(config)  # the run has really started: the folder now holds its games
        result = await generate_games(
            config,
            engine,
            chat,
            existing=existing,
            progress=progress,
            partner_client=partner_client,
            deterministic=getattr(engine_config, "deterministic", False),
        )
        await asyncio.to_thread(write_in_plan_order, config)
        return result
    finally:
        try:
            await engine.aclose()
        finally:
            if partner_client is not None:
                await partner_client.aclose()  # waits for paid answers, so they are cached


class LogProgress:
    """A stage's progress as log lines, about every tenth of the way (a stage runs in a child
    whose stderr may be a log file; a terminal gets a progress bar instead)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.shown = -1

    def start(self, stats) -> None:
        self.shown = stats.done

    def update(self, stats) -> None:
        step = max(1, -(-stats.total // 10))  # ceil: at most ten lines, then the last
        if stats.done // step > self.shown // step or stats.done == stats.total:
            self.shown = stats.done
            log.info(
                "%s: %d/%d games, %.2f games/s, %.0f tokens/s, reward %.3f",
                self.label,
                stats.done,
                stats.total,
                stats.games_per_s,
                stats.tokens_per_s,
                stats.mean_reward,
            )

    def stop(self, stats) -> None:
        if self.shown != stats.done:
            self.update(stats)


def progress_for(stream, label: str) -> Progress:
    """A rich bar on ``stream`` when it is a terminal, else ``LogProgress`` lines (a log file,
    a pipe, CI): either way the games are counted while they play, not only at the end."""
    if stream.isatty():
        from rich.console import Console

        return RichProgress(Console(file=stream))
    return LogProgress(label)


def run_generate(
    config: GenerateConfig, engine_config: EngineConfig, progress: Progress | None = None
) -> GenerateResult:
    return asyncio.run(run_generate_async(config, engine_config, progress))


def summary_table(result: GenerateResult):
    """A rich table of the run: throughput and metrics.summarize of this plan's games."""
    from rich.table import Table

    s, st = result.summary, result.stats
    table = Table(title=f"generate: {result.path}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("games in plan", f"{st.total}"),
        ("played now / kept", f"{st.played} / {st.resumed}"),
        ("wall time (s)", f"{st.seconds:.1f}"),
        ("games/s", f"{st.games_per_s:.3f}"),
        ("generated tokens/s", f"{st.tokens_per_s:.1f}"),
        (
            "reward mean [95% CI]",
            f"{s.reward_mean:.3f} [{s.reward_ci_low:.3f}, {s.reward_ci_high:.3f}]",
        ),
        ("agreement rate", f"{s.agreement_rate:.3f}"),
        ("optimal rate", f"{s.optimal_rate:.3f}"),
        ("mean actions", f"{s.mean_actions:.1f}"),
        ("mean words", f"{s.mean_words:.1f}"),
        ("invalid action rate", f"{s.invalid_action_rate:.3f}"),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items()))),
        ("questions per game (seat 1 / seat 2)", _questions(s)),
    ]
    if s.partner is not None:
        p = s.partner
        rows += [
            ("partner calls / cache hits / retries", f"{p['calls']} / {p['cache_hits']} / "
             f"{p['retries']}"),
            ("partner tokens in / out", f"{p['prompt_tokens']} / {p['completion_tokens']}"),
        ]  # fmt: skip
    for k, v in rows:
        table.add_row(k, v)
    return table


def _questions(s: GameSummary) -> str:
    return (
        f"{s.questions_per_game:.2f} ({s.questions_per_game_seat0:.2f} / "
        f"{s.questions_per_game_seat1:.2f})"
    )
