"""The `selfplay` command line: one thin typer function per command.

This is the only module that sees the whole configuration. A command's options are its stage
configs' fields (``selfplay.options`` declares which, and makes them: help, default, bounds and
environment variable come from the field), plus the few that no config holds (paths whose default
is worked out); the command builds its configs from them and calls its stage's entry point. An
error the user can fix (``UserError``) becomes one line and exit 1, in ``_App``, where it is caught.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import warnings
from pathlib import Path

import typer
import typer.main
from rich.console import Console

from selfplay.convert import ConvertOptions
from selfplay.engines import (
    ENGINE_KINDS,
    engine_config_class,
)
from selfplay.errors import UserError
from selfplay.iterate.config import IterateConfig
from selfplay.options import (
    EVAL,
    GENERATE,
    HF,
    ITERATE,
    SFT,
    SGLANG,
    TRAIN,
    VLLM,
    EngineOption,
    EngineUrlOption,
    LoggerOption,
    OptionError,
    build,
    options,
)
from selfplay.tracking import tracked


class _App(typer.Typer):
    """A Typer app whose commands all end the same way on failure (the one place errors are
    caught): a ``UserError`` is one line and exit 1; any other exception is one line naming it
    and how to see its traceback (exit 1), or the traceback itself under ``-v``."""

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)

        def decorate(fn):
            @functools.wraps(fn)
            def guarded(*a, **kw):
                try:
                    return fn(*a, **kw)
                except UserError as e:
                    raise fail(str(e)) from None
                except (typer.Exit, typer.Abort):
                    raise
                except KeyboardInterrupt:  # generate and iterate say what they kept first
                    console.print("[bold red]interrupted:[/] nothing half-written was kept")
                    raise typer.Exit(130) from None
                except Exception as e:
                    if logging.getLogger().isEnabledFor(logging.DEBUG):
                        raise
                    raise fail(
                        f"{type(e).__name__}: {e} (run `selfplay -v ...` for the traceback)"
                    ) from None

            return register(guarded)

        return decorate


app = _App(
    help="Self-play RL for language models on the DialOp matching game.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # click's plain help: at 80 columns rich's tables cut long option names
    rich_markup_mode=None,
)
# soft_wrap: messages keep paths and commands on one line (copyable, greppable)
console = Console(stderr=True, soft_wrap=True)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # one INFO line per HTTP request drowns the run's own log
        logging.getLogger("httpx").setLevel(logging.WARNING)
        # verl announces every optional engine it lacks (megatron, ...) on import: noise here
        warnings.filterwarnings("ignore", message=r".* engine is not available")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        # transformers' and the hub's bars (weights loading, shards written, GGUF converted):
        # a line each per model load; our own stage progress says what is happening
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _check_engine(kind: str, url: str | None) -> None:
    if kind not in ENGINE_KINDS:
        raise fail(f"--engine must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    if url and kind not in SERVERS:
        raise fail("--engine-url attaches to a server: add --engine sglang or --engine vllm")


SERVERS = {"sglang": SGLANG, "vllm": VLLM}  # the server engines' options


def _engine(kind: str, url: str | None, opts: dict, model: str, **server):
    """The engine config of --engine (checked) from a command's HF, SGLANG and VLLM options;
    another engine gets its config's defaults."""
    if kind == "hf":
        return build(HF, opts, model=model)
    if kind in SERVERS:
        server.setdefault("deterministic", bool(opts.get("deterministic")))
        return build(SERVERS[kind], opts, model=model, url=url, **server)
    return engine_config_class(kind)(model=model)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM stops the command as Ctrl-C does (KeyboardInterrupt): what is finished is kept,
    servers and stage processes are stopped, and the same command resumes."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # KeyboardInterrupt
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def default_data_dir() -> Path:
    """generate's default folder (convert's, train's): data/$EXP_NAME, else data/generate.
    EXP_NAME is checked as iterate checks --name: a name, never a path out of data/."""
    from selfplay.fileio import check_name

    try:
        return Path("data") / check_name(os.environ.get("EXP_NAME") or "generate")
    except ValueError as e:
        raise fail(f"EXP_NAME: {e}") from None


def fail(message: str) -> typer.Exit:
    """Print one clear error line and return the exit to raise."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(1)


# --- commands are added below, one function each -------------------------------------------


@app.command("eval", short_help="Evaluate models on held-out scenarios beside baselines.")
@options(EVAL, SGLANG, VLLM)
def eval_cmd(
    models: list[str] = typer.Option(
        [],
        "--models",
        help="Models to evaluate: HF dirs or ids, or 'embedded'; comma-separated or repeated.",
    ),
    run: str | None = typer.Option(
        None, help="Evaluate a run: its initial model and every trained checkpoint (manifest)."
    ),
    data_root: Path = typer.Option(Path("data"), help="Where data/RUN lives (with --run)."),
    num_scenarios: int | None = typer.Option(
        None, min=1, help="Held-out scenarios (default 100); every row plays the same ones."
    ),
    baselines: str | None = typer.Option(
        None,
        help="Scripted baseline rows, comma-separated ('' for none; default: cooperative,no-talk,"
        "random, or another game's scripted players).",
    ),
    engine: EngineOption = "hf",
    engine_url: EngineUrlOption = None,
    *,
    human_data: Path | None = typer.Option(
        None,
        envvar="SELFPLAY_HUMAN_DATA",
        help="DialOp optimization.jsonl for the human row, shown beside 8x8 results only "
        "(default: the copy shipped with selfplay).",
    ),
    players: str | None = typer.Option(
        None,
        help="Scripted pair mode: two policies, seat 1 then seat 2 (matching: cooperative, "
        "no-talk, proposer, shy, shy-strict, random, inquisitive, advised, ...); the default "
        "mode when no --models or --run is given.",
    ),
    num_games: int | None = typer.Option(
        None, min=1, help="Scripted pair mode: games, one fresh scenario each (default 200)."
    ),
    out: Path | None = typer.Option(
        None,
        help="Models: output folder (eval.json, eval.md, PNGs, games/; default data/eval or "
        "data/RUN/eval). Scripted pair mode: the summary JSON file.",
    ),
    **opts,
) -> None:
    """Evaluate models on held-out scenarios beside scripted baselines and humans.

    With --models and/or --run: one table (reward with 95% CI, agreement, actions, words, invalid
    rate, questions per game) written to OUT/eval.json and OUT/eval.md with plots; --cross-play
    adds the model-pair matrix. A model that cannot load is reported and the rest are evaluated;
    the exit status is 1 only when no model could be evaluated. Without them: the scripted pair
    of --players (default cooperative,cooperative) on --num-games scenarios.
    """
    from selfplay.evaluate.config import ModelSpec
    from selfplay.evaluate.run import run_models

    names = [m.strip() for item in models for m in item.split(",") if m.strip()]
    if not names and run is None:
        if num_scenarios or baselines or opts["cross_play"] or opts["partner"] is not None:
            raise fail(
                "--num-scenarios, --partner, --baselines and --cross-play need --models or --run"
            )
        from selfplay.evaluate.scripted import run_scripted_pair, scripted_table

        pair = run_scripted_pair(
            opts["game"],
            players or "cooperative,cooperative",
            num_games=num_games or 200,
            n=opts["table_size"],
            out=out,
            **{k: opts[k] for k in ("seed", "max_actions", "split")},
        )
        Console().print(scripted_table(pair))
        return
    if players is not None or num_games is not None:
        raise fail(
            "--players/--num-games evaluate a scripted pair; with --models or --run use "
            "--partner and --num-scenarios"
        )
    _check_engine(engine, engine_url)
    # a server: one template, each evaluated model loaded into it
    template = None if engine == "hf" else _engine(engine, engine_url, opts, "(each model)")
    if template is not None and "dtype" in type(template).model_fields:
        opts = {**opts, "dtype": "auto"}  # --dtype went to the server
    specs = [ModelSpec(label=n, model=n) for n in names]
    if run is not None:
        specs += run_models(run, data_root)
    out = out or (data_root / run / "eval" if run is not None else Path("data") / "eval")
    cfg = build(
        EVAL,
        opts,
        models=tuple(specs),
        num_scenarios=num_scenarios or 100,
        baselines=None
        if baselines is None
        else tuple(b.strip() for b in baselines.split(",") if b.strip()),
        engine=template,
        human_data=human_data,
        out=out,
    )
    _eval_models(cfg)


def _eval_models(cfg) -> None:
    from selfplay.evaluate import run_eval
    from selfplay.evaluate.config import EvalError, save_result
    from selfplay.evaluate.report import console_table, write_eval_report

    out = cfg.out
    failed: EvalError | None = None
    try:
        result = run_eval(cfg)
    except EvalError as e:
        if e.result is None:
            raise fail(str(e)) from None
        failed, result = e, e.result
    json_path = save_result(result, out / "eval.json")
    files = write_eval_report(result, out)
    Console().print(console_table(result, cfg.num_scenarios))
    if result.cross_play is not None:
        cp = result.cross_play
        for label in cp.models:
            gap = cp.gap[label]
            console.print(
                f"cross-play {label}: self {cp.self_play[label]:.3f}, gap "
                + ("–" if gap is None else f"{gap:+.3f}")
            )
    from selfplay.train.model_card import provenance

    for r in result.rows:
        origin = provenance(r.model) if r.kind == "model" and r.model else None
        if origin:
            console.print(f"{r.name}: {origin}")
    for msg in result.errors.values():
        console.print(f"[bold red]error:[/] {msg}")
    console.print(f"wrote {json_path}, " + ", ".join(str(p) for p in files.values()))
    if failed is not None:
        raise typer.Exit(1)


@app.command("train", short_help="Train the model on converted rows with verl (offline GRPO).")
@options(TRAIN)
def train(
    data: Path | None = typer.Option(
        None,
        help="train.parquet written by `selfplay convert` (default: the default generate "
        "folder's, data/$EXP_NAME/train.parquet, else data/generate/train.parquet).",
    ),
    model: str | None = typer.Option(
        None,
        help="HF model the rows were generated with ('embedded' for SmolLM2; default: the model "
        "in generate.json beside --data).",
    ),
    out: Path | None = typer.Option(
        None,
        help="Output: HF model dir, verl checkpoint, metrics.json (default: "
        "checkpoints/$EXP_NAME, else checkpoints/generate).",
    ),
    *,
    logger: LoggerOption = "",
    **opts,
) -> None:
    """Offline GRPO with verl on converted rows; writes a Hugging Face model directory."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from selfplay.models import resolve_model
    from selfplay.train import train as run_training

    data = data or default_data_dir() / "train.parquet"
    out = out or Path("checkpoints") / default_data_dir().name
    if model is None:
        snapshot = data.parent / "generate.json"
        try:
            model = json.loads(snapshot.read_text())["identity"]["model"]
        except (OSError, ValueError, KeyError):
            raise fail(
                f"--model not given and {snapshot} does not name the model the games were "
                "generated with; pass --model"
            ) from None
    cfg = build(TRAIN, opts, data=data, model=resolve_model(model), out=out)
    columns = (TextColumn("[bold]train"), BarColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("train", total=None, info="loading")

        def show(m, total: int) -> None:
            info = (
                f"step {m.step}/{total} pg_loss {m.pg_loss:+.4f} grad {m.grad_norm:.3f} "
                f"clip {m.clip_frac:.3f} {m.tokens_per_s:.0f} tok/s"
            )
            progress.update(task, completed=m.step, total=total, info=info)

        result = tracked(logger, cfg, "train", lambda step: run_training(cfg, step), show)
    console.print(f"model: {result.model_dir}  metrics: {result.metrics_path}")
    if result.checkpoint_dir is not None:
        console.print(f"verl checkpoint (resume with --resume-from): {result.checkpoint_dir}")


@app.command("sft", short_help="Warm start: fine-tune on teacher or human games (SFT loss).")
@options(SFT)
def sft_cmd(
    model: str | None = typer.Option(
        None, envvar="MODEL_NAME", help="Model to fine-tune (HF id or dir; default: embedded)."
    ),
    *,
    logger: LoggerOption = "",
    **opts,
) -> None:
    """Behaviour cloning: fine-tune on token-exact teacher rows with verl's SFT loss."""
    from selfplay.iterate.sft import sft
    from selfplay.models import resolve_model

    cfg = build(SFT, opts, model=resolve_model(model))

    def show(m, total: int) -> None:
        console.print(
            f"sft update {m.step}/{total}: loss {m.loss:.4f} grad {m.grad_norm:.3f} "
            f"{m.tokens_per_s:.0f} tok/s"
        )

    result = tracked(logger, cfg, "sft", lambda step: sft(cfg, step), show)
    console.print(f"{result.rows} rows {result.sources}; model: {result.model_dir}")


@app.command("generate", short_help="Play games through an engine; append them to games.jsonl.")
@options(GENERATE, HF, SGLANG, VLLM)
def generate(
    out: Path | None = typer.Option(
        None, help="Output folder (games.jsonl). Default: data/$EXP_NAME, else data/generate."
    ),
    model: str | None = typer.Option(
        None, envvar="MODEL_NAME", help="HF id or local dir. Default: embedded SmolLM2-135M."
    ),
    engine: EngineOption = "hf",
    engine_url: EngineUrlOption = None,
    **opts,
) -> None:
    """Play games through an engine (self-play or against --partner); append each finished game
    to OUT/games.jsonl. An openai partner's key comes from $OPENAI_API_KEY (or --partner-key-env);
    its answers are cached in OUT/partner_cache.jsonl."""
    from selfplay.generate.runner import RichProgress, run_generate, summary_table
    from selfplay.models import resolve_model

    out = out or default_data_dir()
    _check_engine(engine, engine_url)
    model_path = resolve_model(model)
    cfg = build(GENERATE, opts, out=out, model=model_path)
    engine_cfg = _engine(engine, engine_url, opts, model_path, log_path=str(out / f"{engine}.log"))

    try:
        with sigterm_as_interrupt():  # so the engine server is shut down
            result = run_generate(cfg, engine_cfg, progress=RichProgress(console))
    except KeyboardInterrupt:
        console.print(
            f"[bold red]interrupted:[/] finished games are kept in {cfg.games_path}; "
            "re-run the same command to resume"
        )
        raise typer.Exit(130) from None
    Console().print(summary_table(result))


@app.command("convert", short_help="Turn games into GRPO training rows (train/val parquet).")
@options(ConvertOptions)
def convert(
    games: Path | None = typer.Option(
        None,
        help="games.jsonl written by `selfplay generate` (default: the default generate "
        "folder's, data/$EXP_NAME/games.jsonl, else data/generate/games.jsonl).",
    ),
    out: Path | None = typer.Option(
        None,
        help="Output folder: train.parquet, val.parquet, convert_summary.json (default: the "
        "games file's folder).",
    ),
    *,
    validate_records: bool = typer.Option(
        False, "--validate", help="Fully validate every record (slower)."
    ),
    **opts,
) -> None:
    """Turn games into GRPO training rows: groups across games, split by scenario."""
    from selfplay.convert import ConvertConfig
    from selfplay.convert import convert as run_convert
    from selfplay.convert.stats import summary_table

    games = games or default_data_dir() / "games.jsonl"
    out = out or games.parent
    cfg = build(ConvertConfig, opts, games=games, out=out, validate_records=validate_records)
    s = run_convert(cfg)
    table = summary_table(s, title=f"convert {games}")
    Console().print(table)
    console.print(f"wrote {s.train_path}, {s.val_path}, {out / 'convert_summary.json'}")


def _commands(ctx: typer.Context) -> dict:
    root = ctx.find_root().command
    return getattr(root, "commands", None) or typer.main.get_command(app).commands


def _read_recipe(ctx: typer.Context, value: Path | None) -> Path | None:
    """--config: the recipe's options become the command's defaults (before the others are
    read: the option is eager), its [warm-start-sft] is kept for the command."""
    if value is not None and not ctx.resilient_parsing:
        from selfplay.recipe import RecipeError, load_recipe

        commands = _commands(ctx)
        try:
            recipe = load_recipe(value, ctx.command, commands["sft"])
        except RecipeError as e:
            raise typer.BadParameter(str(e)) from None
        ctx.default_map = {**(ctx.default_map or {}), **recipe.options}
        ctx.meta[RECIPE] = recipe
    return value


RECIPE = "selfplay.recipe"  # where --config leaves the recipe it read (click's ctx.meta)


@app.command("iterate", short_help="Run the loop: generate, convert, train, repeat (resumable).")
@options(ITERATE, HF, SGLANG, VLLM)
def iterate_cmd(
    config: Path | None = typer.Option(
        None,
        "--config",
        is_eager=True,
        callback=_read_recipe,
        help="A recipe (recipes/NAME.toml: options under their flag names) or a published "
        "run's manifest.json (to reproduce it): its options are the defaults, a flag given "
        "here wins.",
    ),
    model: str | None = typer.Option(
        None,
        envvar=["INITIAL_MODEL", "MODEL_NAME"],
        help="Initial model (HF id or dir). Default: embedded SmolLM2-135M-Instruct.",
    ),
    engine: EngineOption = "hf",
    engine_url: EngineUrlOption = None,
    *,
    ctx: typer.Context,
    logger: LoggerOption = "",
    force: bool = typer.Option(False, help="Resume even though the options changed."),
    report: bool = typer.Option(True, help="Write the run report at the end."),
    seeds: str | None = typer.Option(
        None,
        help="Training seeds, comma-separated (e.g. 0,1,2): one run per seed, data/NAME/seed-K "
        "(checkpoints/NAME/seed-K), one after the other, each resumable; then data/NAME/SEEDS.md "
        "over them. Replaces --seed.",
    ),
    **opts,
) -> None:
    """Generate, convert, train, repeat; resumes a killed run at its first unfinished stage."""
    _check_engine(engine, engine_url)
    recipe = ctx.meta.get(RECIPE)
    if recipe is not None and model is not None:
        from selfplay.recipe import warm_start_sft

        if warm_start_sft(recipe, model, ctx, _commands(ctx)["sft"]):
            console.print(f"warm start for {config}: {model}")

    def run_config(**update):
        return iterate_config(ctx, model, engine, engine_url, logger, {**opts, **update})

    if seeds is None:
        _iterate_one(run_config(), force, report)
        return
    from selfplay.iterate.seeds import parse_seeds, seed_name, seeds_report

    parent = run_config()  # checks the options once, before any seed starts
    for s in parse_seeds(seeds):
        console.print(f"[bold]seed {s}[/]: run {parent.name}/{seed_name(s)}")
        cfg = run_config(
            seed=s,
            name=seed_name(s),
            data_root=parent.data_root / parent.name,
            checkpoint_root=parent.checkpoint_root / parent.name,
        )
        _iterate_one(cfg, force, report)
    console.print(f"seeds: {seeds_report(parent.run_dir, parse_seeds(seeds))}")


def _iterate_one(cfg, force: bool, report: bool) -> None:
    from selfplay.iterate import iterate
    from selfplay.iterate.track import summary_line

    try:
        with sigterm_as_interrupt():  # the stage's child is stopped too
            run = iterate(cfg, force=force)
    except KeyboardInterrupt:
        console.print(
            f"[bold red]interrupted:[/] finished stages are kept in {cfg.run_dir}; re-run the "
            "same command to resume"
        )
        raise typer.Exit(130) from None
    console.print(f"{summary_line(run, cfg)}; manifest {run.path}")
    if report:
        from selfplay.iterate.report import write_report

        console.print(f"report: {write_report(cfg.run_dir)}")


def iterate_config(
    ctx: typer.Context, model, engine, engine_url, logger, opts, resolve: bool = True
) -> IterateConfig:
    """`selfplay iterate`'s run config from its parsed options; an option the config refuses that
    came from --config's file is named with the file."""
    from selfplay.models import resolve_model

    initial = resolve_model(model) if resolve else model or "embedded"
    try:
        return build(
            ITERATE,
            opts,
            model=initial,
            engine=_engine(engine, engine_url, opts, initial),
            loggers=tuple(x for x in logger.split(",") if x.strip()),
        )
    except OptionError as e:
        recipe = ctx.meta.get(RECIPE)
        flag = str(e).partition(":")[0].removeprefix("--").replace("-", "_")
        source = ctx.get_parameter_source(flag)
        if recipe is not None and getattr(source, "name", None) == "DEFAULT_MAP":
            raise OptionError(f"{recipe.path}: {e}") from None
        raise


def parse_iterate(args: list[str], resolve: bool = True) -> IterateConfig:
    """The run config `selfplay iterate ARGS` would start, nothing run (a recipe's
    [warm-start-sft] neither): how tests and scripts read a recipe or a manifest. ``resolve``
    False: the model as written (``embedded`` for the default), no directory looked at."""
    command = typer.main.get_command(app).commands["iterate"]
    with command.make_context("iterate", list(args)) as ctx:
        skip = ("config", "force", "report", "seeds")
        opts = {k: v for k, v in ctx.params.items() if k not in skip}
        model, engine, url, logger = (
            opts.pop(k) for k in ("model", "engine", "engine_url", "logger")
        )
        _check_engine(engine, url)
        return iterate_config(ctx, model, engine, url, logger, opts, resolve=resolve)


@app.command("report", short_help="Write a run's plots and REPORT.md from its metrics.")
def report_cmd(
    run: str = typer.Argument(..., help="Run name (data/RUN) or a run directory."),
    data_root: Path = typer.Option(Path("data"), help="Where data/RUN lives."),
    table_size: int | None = typer.Option(
        None, min=1, help="Table size of the scripted baselines (default: the run's own)."
    ),
) -> None:
    """Write PNG plots and REPORT.md for a run from its metrics.jsonl and manifest."""
    from selfplay.iterate.report import write_report

    run_dir = Path(run) if Path(run).is_dir() else data_root / run
    console.print(f"report: {write_report(run_dir, n=table_size)}")


@app.command("compare", short_help="Compare held-out results side by side, paired by scenario.")
def compare_cmd(
    held_out: list[str] = typer.Argument(
        ...,
        help="Two or more sets of held-out games: a run (data/NAME or NAME; @start, @K or "
        "@final, the default: which model), a published run (docs/runs/NAME[@start]) or a "
        "games file. The first is the one the others are paired with.",
    ),
    data_root: Path = typer.Option(Path("data"), help="Where data/NAME lives."),
    markdown: bool = typer.Option(False, "--markdown", help="Print Markdown tables."),
) -> None:
    """Held-out results side by side, each paired with the first by scenario (95% t-interval)."""
    from rich.table import Table

    from selfplay.evaluate import compare

    sets, pairs = compare.compare(held_out, data_root)
    if markdown:
        typer.echo(compare.markdown(sets, pairs))
        return
    out = Console(width=max(Console().width, 160))  # piped: rich's 80 columns cut the labels
    for title, columns, rows in compare.tables(sets, pairs):
        table = Table(*columns, title=title)
        for row in rows:
            table.add_row(*row)
        out.print(table)


# `selfplay --help` lists the loop's commands in the loop's order, then the others.
LOOP = ("generate", "convert", "train", "iterate", "sft", "eval", "report", "compare")
app.registered_commands.sort(key=lambda c: LOOP.index(c.name) if c.name in LOOP else len(LOOP))
