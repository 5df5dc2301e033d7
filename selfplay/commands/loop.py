"""`selfplay iterate`: the loop, one run or one per training seed; --config reads a recipe (or a
published run's manifest) into the command's defaults."""

from __future__ import annotations

from pathlib import Path

import typer

from selfplay.commands.common import check_engine, console, engine_config, sigterm_as_interrupt
from selfplay.iterate.config import IterateConfig
from selfplay.options import (
    HF,
    ITERATE,
    SGLANG,
    VLLM,
    EngineOption,
    EngineUrlOption,
    LoggerOption,
    OptionError,
    build,
    options,
)


def _commands(ctx: typer.Context) -> dict:
    """The app's commands, by name (the root context's command is the app: ``parse_iterate``
    gives its iterate context one too)."""
    return ctx.find_root().command.commands


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
    check_engine(engine, engine_url)
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
            engine=engine_config(engine, engine_url, opts, initial),
            loggers=tuple(x for x in logger.split(",") if x.strip()),
        )
    except OptionError as e:
        recipe = ctx.meta.get(RECIPE)
        flag = str(e).partition(":")[0].removeprefix("--").replace("-", "_")
        source = ctx.get_parameter_source(flag)
        if recipe is not None and getattr(source, "name", None) == "DEFAULT_MAP":
            raise OptionError(f"{recipe.path}: {e}") from None
        raise
