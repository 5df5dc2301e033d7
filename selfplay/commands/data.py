"""`selfplay generate` and `selfplay convert`: play games into games.jsonl, turn them into
training rows."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from selfplay.commands.common import (
    check_engine,
    console,
    default_data_dir,
    engine_config,
    sigterm_as_interrupt,
)
from selfplay.convert import ConvertOptions
from selfplay.options import (
    GENERATE,
    HF,
    SGLANG,
    VLLM,
    EngineOption,
    EngineUrlOption,
    build,
    options,
)


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
    from selfplay.generate.runner import progress_for, run_generate, summary_table
    from selfplay.models import resolve_model

    out = out or default_data_dir()
    check_engine(engine, engine_url)
    model_path = resolve_model(model)
    cfg = build(GENERATE, opts, out=out, model=model_path)
    engine_cfg = engine_config(
        engine, engine_url, opts, model_path, log_path=str(out / f"{engine}.log")
    )

    try:
        with sigterm_as_interrupt():  # so the engine server is shut down
            progress = progress_for(console.file, "generate")  # log lines when not a terminal
            result = run_generate(cfg, engine_cfg, progress=progress)
    except KeyboardInterrupt:
        console.print(
            f"[bold red]interrupted:[/] finished games are kept in {cfg.games_path}; "
            "re-run the same command to resume"
        )
        raise typer.Exit(130) from None
    Console().print(summary_table(result))


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
