"""`selfplay train` and `selfplay sft`: offline GRPO on converted rows, and the warm start's
fine-tuning on teacher or human games."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from selfplay.commands.common import console, default_data_dir, fail
from selfplay.options import SFT, TRAIN, LoggerOption, build, options
from selfplay.tracking import tracked


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
    from selfplay.iterate.warm_start import sft
    from selfplay.models import resolve_model

    cfg = build(SFT, opts, model=resolve_model(model))

    def show(m, total: int) -> None:
        console.print(
            f"sft update {m.step}/{total}: loss {m.loss:.4f} grad {m.grad_norm:.3f} "
            f"{m.tokens_per_s:.0f} tok/s"
        )

    result = tracked(logger, cfg, "sft", lambda step: sft(cfg, step), show)
    console.print(f"{result.rows} rows {result.sources}; model: {result.model_dir}")
