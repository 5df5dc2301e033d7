"""Play many self-play games at once and append each finished game to ``OUT/games.jsonl``.

- Games are planned deterministically: scenario ``i`` has seed SeedSequence(run seed, round, i),
  made even (``scenario_seed``; evaluation seeds are odd, so eval never replays a training
  scenario), and its ``K`` games (``games_per_scenario``, so GRPO can compare them) have ids
  ``r{round}-s{scenario seed}-g{k}`` and seeds SeedSequence(run seed, round, i, k). Every sampling
  seed of a game derives from its seed (see ``LLMPlayer``), which the record stores.
- Up to ``concurrency`` games are in flight (default: all missing games), all sharing one engine
  that batches their requests. A finished game is appended and fsynced at once (a writer task
  groups games that finish together into one write).
- Re-running the same command resumes: a torn last line is dropped with a warning, finished games
  are kept, only missing ones are played. ``OUT/generate.json`` holds the options that decide which
  games the folder contains; a re-run with different ones is refused with the differences named.
- An ``EngineFailure`` (dead server) stops the run: games in flight are cancelled, every finished
  game is kept, and the error says how to resume. Ctrl-C does the same.
- With a partner (``selfplay.partners``) the model plays seat ``policy_seat`` (its only trained
  seat) and a scripted policy or an API chat model the other; ``policy_seat`` 2 lets the partner
  move first. An API partner is one ``PartnerClient`` per run (concurrency, reply cache in
  ``OUT/partner_cache.jsonl``, call cap); its spend goes into the summary (``partner``) and one
  line per run in ``OUT/partner_usage.jsonl``. Its spent cap stops the run like an engine failure.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import orjson

from selfplay.engines import Engine, EngineConfig, EngineFailure, open_engine
from selfplay.errors import UserError
from selfplay.game.matching import Scenario, generate_scenario
from selfplay.generate_config import GenerateConfig
from selfplay.locks import folder_lock
from selfplay.metrics import Summary
from selfplay.partners import OpenAIPartner, ScriptedPartner, SelfPlay, parse_partner
from selfplay.play import play_game
from selfplay.players import Player
from selfplay.players.api import (
    ApiPartner,
    ApiPartnerConfig,
    PartnerCallCap,
    PartnerClient,
    api_partner_config,
    open_partner_client,
)
from selfplay.players.llm import ChatFormat, LLMPlayer, derive_seed, load_chat_format
from selfplay.records import GameRecord, append_records, repair_jsonl_tail

log = logging.getLogger(__name__)

TRAIN_SPACE = 0x5E1F_9A3E  # first word of every generate seed sequence (eval uses its own)


class OutputMismatch(UserError, ValueError):
    """OUT already holds games planned with other options."""


# ---------------------------------------------------------------------------------------------
# The plan: which games exist, deterministically


def scenario_seed(seed: int, round: int, index: int) -> int:
    """Scenario seed of training scenario ``index``: always even, so never an evaluation seed.

    A 63-bit SeedSequence hash of (TRAIN_SPACE, seed, round, index) shifted left by one; the
    held-out scenarios of ``selfplay eval`` (``evaluate.eval_scenario_seed``) set the low bit, so
    the two sets are disjoint by construction, whatever the seeds.
    """
    words = [TRAIN_SPACE, seed, round, index]
    return (int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0]) >> 1) << 1


def game_seed(seed: int, round: int, index: int, k: int) -> int:
    return derive_seed(TRAIN_SPACE, seed, round, index, k)


@dataclass(frozen=True)
class GameSpec:
    index: int  # position in the plan
    scenario_index: int
    scenario_seed: int
    k: int  # game number on its scenario
    game_id: str
    seed: int


def plan_games(config: GenerateConfig) -> Iterator[GameSpec]:
    """The run's games in order: scenario 0's K games, scenario 1's, ... (lazy)."""
    per = config.games_per_scenario
    for i in range(math.ceil(config.num_games / per)):
        sseed = scenario_seed(config.seed, config.round, i)
        for k in range(per):
            index = i * per + k
            if index >= config.num_games:
                return
            yield GameSpec(
                index=index,
                scenario_index=i,
                scenario_seed=sseed,
                k=k,
                game_id=f"r{config.round}-s{sseed}-g{k}",
                seed=game_seed(config.seed, config.round, i, k),
            )


# ---------------------------------------------------------------------------------------------
# Output folder: snapshot, resume


def prepare_output(config: GenerateConfig, *, record: bool = True) -> dict[str, float]:
    """Create OUT, check generate.json (and write it, with ``record``), repair a torn tail;
    return {game_id: reward}. ``run_generate`` records the options only once the engine has
    started, so a typo (a model that does not load) does not tie the folder to its options."""
    config.out.mkdir(parents=True, exist_ok=True)
    snap = config.snapshot_path
    identity = config.identity()
    if snap.exists():
        old = json.loads(snap.read_text()).get("identity", {})
        diff = {k: (old.get(k), v) for k, v in identity.items() if old.get(k) != v}
        if diff:
            detail = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise OutputMismatch(
                f"{config.out} holds games generated with other options ({detail}). Re-run with "
                "the same options to resume, or choose another --out"
            )
    elif record:
        record_options(config)
    repair_jsonl_tail(config.games_path)  # logs a warning when it drops a torn line
    return scan_games(config.games_path)


def record_options(config: GenerateConfig) -> None:
    """Write OUT/generate.json: the options that decide which games the folder holds."""
    snap = config.snapshot_path
    if not snap.exists():
        tmp = snap.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"identity": config.identity()}, indent=2) + "\n")
        tmp.replace(snap)


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


# ---------------------------------------------------------------------------------------------
# Progress


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


# ---------------------------------------------------------------------------------------------
# Playing


@dataclass
class GenerateResult:
    path: Path
    stats: RunStats
    summary: dict


class _Writer:
    """Appends finished records; games that finish together share one write and fsync."""

    def __init__(self, path: Path) -> None:
        self.path = path
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
                await asyncio.to_thread(append_records, self.path, batch)
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
            if self._buffer:  # the writer died; never lose a finished game
                append_records(self.path, self._buffer)
                self._buffer = []


class _Scenarios:
    """Scenarios made off the event loop, shared by their K games, prefetched ahead of the plan.

    Specs are handed out in plan order, so once scenario ``i`` is asked for, no game needs an
    earlier one from here (games already holding a future keep it); the next ``lookahead``
    scenarios are started so that a game starting later does not wait for its table and fall
    out of step with the batch everyone else is in.
    """

    def __init__(self, config: GenerateConfig, lookahead: int) -> None:
        self.config = config
        self.lookahead = max(1, lookahead)
        self.count = math.ceil(config.num_games / config.games_per_scenario)
        self._cache: dict[int, asyncio.Future] = {}
        # One thread per core: numpy releases the GIL only in the large steps of a scenario, so
        # asyncio's default pool (cores + 4 threads) made 64 scenarios no faster than one thread
        # on 2 cores (0.73 s), and 2 threads 30% faster (0.54 s).
        self._pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="scenarios")

    def _future(self, index: int) -> asyncio.Future:
        future = self._cache.get(index)
        if future is None:
            seed = scenario_seed(self.config.seed, self.config.round, index)
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, generate_scenario, seed, self.config.table_size
            )
            self._cache[index] = future
        return future

    def close(self) -> None:
        """Stop the threads; scenarios being made are dropped (no game is waiting for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def get(self, spec: GameSpec) -> asyncio.Future:
        i = spec.scenario_index
        for old in [k for k in self._cache if k < i]:
            del self._cache[old]
        for j in range(i + 1, min(i + self.lookahead, self.count)):
            self._future(j)
        return self._future(i)

    async def warm(self, specs: list[GameSpec]) -> None:
        """Make the scenarios of the first games before any starts, so they start together."""
        await asyncio.gather(*(self._future(s.scenario_index) for s in specs))


def make_players(
    config: GenerateConfig,
    spec: GameSpec,
    scenario: Scenario,
    engine: Engine,
    chat: ChatFormat,
    partner_client: PartnerClient | None = None,
) -> tuple[Player, Player]:
    """The two seats of one game: the model in both (self-play) or in ``policy_seat`` only."""
    from selfplay.players.scripted import make_scripted

    def llm(seat: int) -> LLMPlayer:
        return LLMPlayer(
            engine,
            chat,
            sampling=config.sampling,
            seed=derive_seed(spec.seed, seat),
            name=config.model,
        )

    policy = config.policy_seat - 1
    other = 1 - policy
    partner: Player
    match parse_partner(config.partner):
        case SelfPlay():
            return llm(0), llm(1)
        case ScriptedPartner(name=name):
            partner = make_scripted(name, scenario, other, seed=derive_seed(spec.seed, other))
        case OpenAIPartner():
            if partner_client is None:
                raise ValueError(
                    f"partner {config.partner} needs a PartnerClient: pass partner_client "
                    "(run_generate opens one from the config)"
                )
            partner = ApiPartner(partner_client)
    return (llm(0), partner) if policy == 0 else (partner, llm(1))


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
) -> GenerateResult:
    """Play every planned game not yet in OUT/games.jsonl; return the run's stats and summary.

    An ``openai:MODEL`` partner needs ``partner_client`` (``run_generate`` opens one); the caller
    closes it. Its usage goes into ``summary["partner"]``.
    """
    if isinstance(parse_partner(config.partner), OpenAIPartner) and partner_client is None:
        raise ValueError(f"partner {config.partner} needs a partner_client (open_partner_client)")
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
    width = min(config.concurrency or to_play, to_play)
    pending = (s for s in plan_games(config) if s.game_id not in existing)
    first_wave = list(itertools.islice(pending, width))
    specs = itertools.chain(first_wave, pending)
    scenarios = _Scenarios(config, lookahead=2 + width // config.games_per_scenario)
    try:
        await scenarios.warm(first_wave)
    except BaseException:  # Ctrl-C or a bad table size before any game started
        scenarios.close()
        raise
    writer = _Writer(config.games_path)
    summary = Summary()  # this run's games as they finish; kept ones are read back at the end

    async def worker() -> None:
        for spec in specs:
            scenario = await scenarios.get(spec)
            record = await play_game(
                scenario,
                make_players(config, spec, scenario, engine, chat, partner_client),
                game_id=spec.game_id,
                seed=spec.seed,
                round=config.round,
                max_actions=config.max_actions,
                max_invalid=config.max_invalid,
            )
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

    tasks = [asyncio.create_task(worker(), name=f"game-worker-{i}") for i in range(width)]
    try:
        if tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
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
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        scenarios.close()
        await writer.close()
        stats.seconds = time.perf_counter() - stats.started
        if progress:
            progress.stop(stats)
    for record in _summary_records(config.games_path, kept_ids):
        summary.add(record)
    result = summary.result()
    if partner_client is not None:
        result["partner"] = partner_client.usage.as_dict()
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
            gid = obj.get("game_id")
            if gid in ids and gid not in seen:
                seen.add(gid)
                obj["tokens"] = [None, None]
                yield GameRecord.model_validate(obj)


async def run_generate_async(
    config: GenerateConfig, engine_config: EngineConfig, progress: Progress | None = None
) -> GenerateResult:
    """Check the output and the chat template, start the engine, play, always stop the engine.

    Holds OUT's lock throughout: a second generate into the same folder is refused at once."""
    with folder_lock(config.out, "selfplay generate"):
        return await _run_generate_locked(config, engine_config, progress)


async def _run_generate_locked(
    config: GenerateConfig, engine_config: EngineConfig, progress: Progress | None
) -> GenerateResult:
    existing = prepare_output(config, record=False)
    chat = await asyncio.to_thread(load_chat_format, engine_config.model)
    api = partner_config(config)
    partner_client = open_partner_client(api) if api is not None else None
    engine = open_engine(engine_config)
    try:
        await engine.start()
        record_options(config)  # the run has really started: the folder now holds its games
        return await generate_games(
            config,
            engine,
            chat,
            existing=existing,
            progress=progress,
            partner_client=partner_client,
        )
    finally:
        try:
            await engine.aclose()
        finally:
            if partner_client is not None:
                await partner_client.aclose()  # waits for paid answers, so they are cached


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
            f"{s['reward_mean']:.3f} [{s['reward_ci_low']:.3f}, {s['reward_ci_high']:.3f}]",
        ),
        ("agreement rate", f"{s['agreement_rate']:.3f}"),
        ("optimal rate", f"{s['optimal_rate']:.3f}"),
        ("mean actions", f"{s['mean_actions']:.1f}"),
        ("mean words", f"{s['mean_words']:.1f}"),
        ("invalid action rate", f"{s['invalid_action_rate']:.3f}"),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))),
        ("questions per game (seat 1 / seat 2)", _questions(s)),
    ]
    if "partner" in s:
        p = s["partner"]
        rows += [
            ("partner calls / cache hits / retries", f"{p['calls']} / {p['cache_hits']} / "
             f"{p['retries']}"),
            ("partner tokens in / out", f"{p['prompt_tokens']} / {p['completion_tokens']}"),
        ]  # fmt: skip
    for k, v in rows:
        table.add_row(k, v)
    return table


def _questions(s: dict) -> str:
    return (
        f"{s['questions_per_game']:.2f} ({s['questions_per_game_seat0']:.2f} / "
        f"{s['questions_per_game_seat1']:.2f})"
    )
