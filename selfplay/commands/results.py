"""`selfplay eval`, `selfplay report` and `selfplay compare`: held-out evaluation beside
baselines, a run's report, and held-out results side by side."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from selfplay.commands.common import check_engine, console, engine_config, fail
from selfplay.options import EVAL, SGLANG, VLLM, EngineOption, EngineUrlOption, build, options


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
        from selfplay.game import get_game

        pair = run_scripted_pair(
            get_game(opts["game"]),
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
    check_engine(engine, engine_url)
    # a server: one template, each evaluated model loaded into it
    template = None if engine == "hf" else engine_config(engine, engine_url, opts, "(each model)")
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
