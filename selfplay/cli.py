"""The `selfplay` command line: the app, its commands in the loop's order, and ``parse_iterate``.

This is the only module that sees the whole configuration. A command's options are its stage
configs' fields (``selfplay.options`` declares which, and makes them: help, default, bounds and
environment variable come from the field), plus the few that no config holds (paths whose default
is worked out); the command builds its configs from them and calls its stage's entry point. The
commands are plain functions in ``selfplay.commands``, a module per group, registered here. An
error the user can fix (``UserError``) becomes one line and exit 1, in ``_App``, where it is caught.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings

import typer
import typer.main

from selfplay.commands import data, loop, results, train
from selfplay.commands.common import check_engine, console, fail
from selfplay.errors import UserError
from selfplay.iterate.config import IterateConfig


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


# `selfplay --help` lists the commands in this order, the loop's: (name, short help, function)
COMMANDS = (
    ("generate", "Play games through an engine; append them to games.jsonl.", data.generate),
    ("convert", "Turn games into GRPO training rows (train/val parquet).", data.convert),
    ("train", "Train the model on converted rows with verl (offline GRPO).", train.train),
    ("iterate", "Run the loop: generate, convert, train, repeat (resumable).", loop.iterate_cmd),
    ("sft", "Warm start: fine-tune on teacher or human games (SFT loss).", train.sft_cmd),
    ("eval", "Evaluate models on held-out scenarios beside baselines.", results.eval_cmd),
    ("report", "Write a run's plots and REPORT.md from its metrics.", results.report_cmd),
    ("compare", "Compare held-out results side by side, paired by scenario.", results.compare_cmd),
)
for name, short_help, function in COMMANDS:
    app.command(name, short_help=short_help)(function)


def parse_iterate(args: list[str], resolve: bool = True) -> IterateConfig:
    """The run config `selfplay iterate ARGS` would start, nothing run (a recipe's
    [warm-start-sft] neither): how tests and scripts read a recipe or a manifest. ``resolve``
    False: the model as written (``embedded`` for the default), no directory looked at."""
    group = typer.main.get_command(app)
    command = group.commands["iterate"]
    root = typer.Context(group, info_name="selfplay")  # the app, as on the command line
    with command.make_context("iterate", list(args), parent=root) as ctx:
        skip = ("config", "force", "report", "seeds")
        opts = {k: v for k, v in ctx.params.items() if k not in skip}
        model, engine, url, logger = (
            opts.pop(k) for k in ("model", "engine", "engine_url", "logger")
        )
        check_engine(engine, url)
        return loop.iterate_config(ctx, model, engine, url, logger, opts, resolve=resolve)
