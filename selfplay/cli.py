"""The `selfplay` command line: one thin typer function per command.

This is the only module that sees the whole configuration; each command validates its options
into its stage's config and calls the library. Library errors become one clear message and exit 1.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from selfplay.errors import UserError
from selfplay.tracking import flat


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
                except (typer.Exit, typer.Abort, KeyboardInterrupt):
                    raise
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


def _hf_engine(
    model: str, device: str | None, max_batch_size: int, prefix_cache_tokens: int | None
):
    """The hf engine config of generate and iterate; options not given keep the config's default."""
    from selfplay.engines import HFEngineConfig

    given = {} if prefix_cache_tokens is None else {"prefix_cache_tokens": prefix_cache_tokens}
    return HFEngineConfig(model=model, device=device, max_batch_size=max_batch_size, **given)


# Options shared by several commands, defined once so their checks and help stay the same.
PartnerOption = Annotated[
    str,
    typer.Option(
        help="Who plays the other seat: self, scripted:NAME (cooperative, no-talk, shy, random; "
        "a bare NAME works too) or openai:MODEL (an OpenAI-compatible chat model, shy persona).",
    ),
]
PolicySeatOption = Annotated[
    int,
    typer.Option(
        min=1, max=2, help="The model's seat with a partner: 1, or 2 (the partner moves first)."
    ),
]
PartnerBaseUrlOption = Annotated[
    str | None,
    typer.Option(help="openai partner: the endpoint (default https://api.openai.com/v1)."),
]
MaxBatchOption = Annotated[int, typer.Option(min=1, help="hf: requests decoded together at most.")]
PrefixCacheOption = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="hf: tokens of finished turns kept as KV cache, so a seat's next turn prefills only "
        "its new tokens (0: off; default: HFEngineConfig's, 65,536).",
    ),
]
LossAggOption = Annotated[
    str,
    typer.Option(
        help="How the GRPO loss averages tokens (verl's loss_agg_mode): token-mean (long rows "
        "weigh more), seq-mean-token-mean (every row weighs the same), token-sum, "
        "seq-mean-token-sum, seq-mean-token-sum-norm.",
    ),
]
LoggerOption = Annotated[
    str,
    typer.Option(
        "--logger",
        help="Experiment trackers, comma-separated, as verl names them: console, tensorboard, "
        "wandb, mlflow (swanlab, trackio where installed). WANDB_MODE=offline works offline.",
    ),
]
TopPOption = Annotated[
    float,
    typer.Option(max=1.0, help="Nucleus sampling: keep the top tokens of this mass, in (0, 1]."),
]
HealthTimeoutOption = Annotated[
    float,
    typer.Option(
        min=1.0,
        help="sglang: seconds to wait for the server's /health (a launched server loads the model "
        "first; an attached URL that refuses connections fails at once).",
    ),
]
PartnerKeyEnvOption = Annotated[
    str,
    typer.Option(help="openai partner: NAME of the environment variable with the key."),
]
EngineOption = Annotated[str, typer.Option(help="hf (transformers in-process) or sglang.")]
EngineUrlOption = Annotated[
    str | None, typer.Option(help="sglang: attach to a running server (or router) at this URL.")
]
SGLangPythonOption = Annotated[str, typer.Option(help="sglang: the Python that has sglang.")]
TpSizeOption = Annotated[int, typer.Option(min=1, help="sglang: tensor-parallel size.")]
MemFractionOption = Annotated[float | None, typer.Option(help="sglang: --mem-fraction-static.")]
TemperatureOption = Annotated[
    float,
    typer.Option(envvar="TEMPERATURE", min=0.0, help="Sampling temperature (0: greedy)."),
]
MaxNewTokensOption = Annotated[int, typer.Option(min=1, help="Tokens per action at most.")]
MaxActionsOption = Annotated[
    int,
    typer.Option(
        envvar="MAX_LENGTH", min=1, help="Actions per game; a game that reaches it ends unagreed."
    ),
]
MaxInvalidOption = Annotated[
    int, typer.Option(min=1, help="Consecutive invalid actions of one seat that end a game.")
]
TableSizeOption = Annotated[
    int, typer.Option(min=3, max=8, help="Table size n (n reviewers x n papers).")
]
ConcurrencyOption = Annotated[
    int | None, typer.Option(min=1, help="Games in flight at most (default: all of them).")
]
SeedOption = Annotated[
    int, typer.Option(min=0, help="Run seed: scenarios, sampling and shuffling derive from it.")
]
GamesPerScenarioOption = Annotated[
    int,
    typer.Option(min=2, help="Games per scenario: a GRPO group compares them (at least 2)."),
]
ValFractionOption = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=0.99,
        help="Share of scenarios (by hash) written to val.parquet instead of train.parquet; "
        "training never reads them, so 0 (the default) trains on every game.",
    ),
]
MaxLengthOption = Annotated[
    int, typer.Option(min=2, help="Rows with more prompt + response tokens are left out.")
]
LrOption = Annotated[float, typer.Option(help="Learning rate (AdamW).")]
BatchSizeOption = Annotated[
    int | None,
    typer.Option(envvar="TRAIN_BATCH_SIZE", min=1, help="Rows per step (default: all rows)."),
]
MicroBatchOption = Annotated[
    int,
    typer.Option(envvar="MICRO_BATCH_SIZE", min=1, help="Rows per forward/backward per device."),
]
KlCoefOption = Annotated[
    float, typer.Option(min=0.0, help="KL loss weight against the starting model (0: none).")
]


def _tracked(logger: str, cfg, prefix: str, run, show):
    """``run(on_step)`` of train or sft with each step shown and sent to the --logger trackers
    as ``PREFIX/*`` (their files beside the output folder, in tracking/NAME, not in it)."""
    from selfplay.tracking import open_tracker, parse_loggers

    try:
        loggers = parse_loggers(logger)
    except ValueError as e:
        raise fail(f"--logger: {e}") from None
    out = Path(cfg.out).resolve()
    with open_tracker(
        loggers,
        project="selfplay",
        name=out.name,
        run_dir=out.parent / "tracking" / out.name,
        config=cfg.model_dump(mode="json"),
    ) as tracker:

        def on_step(m, total: int) -> None:
            show(m, total)
            if tracker is not None:
                tracker.log(flat(prefix, asdict(m)), step=m.step)

        return run(on_step)


def default_data_dir() -> Path:
    """The folder `selfplay generate` writes by default: data/$EXP_NAME, else data/generate
    (convert and train read it when given no paths)."""
    return Path("data") / (os.environ.get("EXP_NAME") or "generate")


def fail(message: str) -> typer.Exit:
    """Print one clear error line and return the exit to raise."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(1)


def bad_option(e: ValidationError, rename: dict[str, str] | None = None) -> typer.Exit:
    """One clear line for a config's first validation error, naming the option to fix."""
    err = e.errors()[0]
    names = [str(x) for x in err["loc"] if not str(x).isdigit()]
    name = (rename or {}).get(names[-1], names[-1]) if names else "options"
    msg = err["msg"].removeprefix("Value error, ")
    if not err["loc"] and (m := re.match(r"(\w+): (.*)", msg, re.S)):
        name, msg = m.groups()  # a check across fields names its field first
    return fail(f"--{name.replace('_', '-')}: {msg}")


# --- commands are added below, one function each -------------------------------------------


def _eval_engine(
    engine, url, health_timeout, python, tp_size, mem_fraction, device, max_batch_size
) -> dict:
    """eval's engine options: the default hf engine's device and batch, or an SGLang template
    (each evaluated model is loaded into it)."""
    from selfplay.engines import SGLangEngineConfig

    if url and engine != "sglang":
        raise fail("--engine-url attaches to an SGLang server: add --engine sglang")
    if engine == "hf":
        return {"device": device, "max_batch_size": max_batch_size}
    if engine != "sglang":
        raise fail(f"--engine must be hf or sglang, got {engine!r}")
    try:
        return {
            "engine": SGLangEngineConfig(
                model="(each evaluated model)",
                url=url,
                startup_timeout_s=health_timeout,
                python=python,
                tp_size=tp_size,
                mem_fraction=mem_fraction,
            )
        }
    except ValidationError as e:
        raise bad_option(e) from None


@app.command("eval")
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
    partner: str | None = typer.Option(
        None,
        help="Partner seat: scripted:NAME (cooperative, no-talk, shy, random) or openai:MODEL "
        "(a shy API model; key from $OPENAI_API_KEY or --partner-key-env); default: self-play.",
    ),
    policy_seat: PolicySeatOption = 1,
    partner_base_url: PartnerBaseUrlOption = None,
    partner_key_env: PartnerKeyEnvOption = "OPENAI_API_KEY",
    partner_max_calls: int | None = typer.Option(
        None, min=1, help="openai partner: paid calls at most (cached answers are free)."
    ),
    num_scenarios: int | None = typer.Option(
        None, min=1, help="Held-out scenarios (default 100); every row plays the same ones."
    ),
    games_per_scenario: int = typer.Option(1, min=1, help="Games per scenario (needs sampling)."),
    temperature: float = typer.Option(0.0, min=0.0, help="0: greedy, deterministic."),
    top_p: TopPOption = 1.0,
    max_new_tokens: MaxNewTokensOption = 256,
    baselines: str = typer.Option(
        "cooperative,no-talk,random", help="Scripted baseline rows (comma-separated; '' for none)."
    ),
    cross_play: bool = typer.Option(
        False, "--cross-play", help="Also play every ordered pair of models; matrix and gaps."
    ),
    concurrency: int | None = typer.Option(None, min=1, help="Games in flight per row."),
    engine: EngineOption = "hf",
    engine_url: EngineUrlOption = None,
    health_timeout: HealthTimeoutOption = 900.0,
    sglang_python: SGLangPythonOption = "python",
    tp_size: TpSizeOption = 1,
    mem_fraction: MemFractionOption = None,
    device: str | None = typer.Option(None, help="hf: cpu, cuda, cuda:1 (default: cuda if any)."),
    max_batch_size: MaxBatchOption = 64,
    human_data: Path | None = typer.Option(
        None,
        envvar="SELFPLAY_HUMAN_DATA",
        help="DialOp optimization.jsonl for the human row (default: ../shared/dialop-data).",
    ),
    players: str | None = typer.Option(
        None,
        help="Scripted pair mode: two policies, seat 1 then seat 2 (cooperative, no-talk, shy, "
        "random); the default mode when no --models or --run is given.",
    ),
    num_games: int | None = typer.Option(
        None, min=1, help="Scripted pair mode: games, one fresh scenario each (default 200)."
    ),
    seed: int = typer.Option(7, min=0, help="Eval seed: picks the held-out scenarios (odd seeds)."),
    table_size: TableSizeOption = 8,
    max_actions: int = typer.Option(30, min=1, help="Actions per game before it ends unagreed."),
    max_invalid: MaxInvalidOption = 3,
    out: Path | None = typer.Option(
        None,
        help="Models: output folder (eval.json, eval.md, PNGs, games/; default data/eval or "
        "data/RUN/eval). Scripted pair mode: the summary JSON file.",
    ),
) -> None:
    """Evaluate models on held-out scenarios beside scripted baselines and humans.

    With --models and/or --run: one table (reward with 95% CI, agreement, actions, words, invalid
    rate, questions per game) written to OUT/eval.json and OUT/eval.md with plots; --cross-play
    adds the model-pair matrix. A model that cannot load is reported and the rest are evaluated;
    the exit status is 1 only when no model could be evaluated. Without them: the scripted pair
    of --players (default cooperative,cooperative) on --num-games scenarios.
    """
    names = [m.strip() for item in models for m in item.split(",") if m.strip()]
    where = _eval_engine(
        engine, engine_url, health_timeout, sglang_python, tp_size, mem_fraction, device,
        max_batch_size,
    )  # fmt: skip
    if not names and run is None:
        if num_scenarios is not None or cross_play or partner is not None:
            raise fail("--num-scenarios, --partner and --cross-play need --models or --run")
        _eval_scripted_pair(
            players or "cooperative,cooperative",
            num_games or 200,
            seed,
            table_size,
            max_actions,
            out,
        )
        return
    if players is not None or num_games is not None:
        raise fail(
            "--players/--num-games evaluate a scripted pair; with --models or --run use "
            "--partner and --num-scenarios"
        )
    _eval_models(
        names,
        run=run,
        data_root=data_root,
        out=out,
        options=dict(
            partner=partner,
            policy_seat=policy_seat,
            partner_base_url=partner_base_url,
            partner_key_env=partner_key_env,
            partner_max_calls=partner_max_calls,
            num_scenarios=num_scenarios or 100,
            games_per_scenario=games_per_scenario,
            seed=seed,
            table_size=table_size,
            max_actions=max_actions,
            max_invalid=max_invalid,
            baselines=tuple(b.strip() for b in baselines.split(",") if b.strip()),
            cross_play=cross_play,
            concurrency=concurrency,
            **where,
            human_data=human_data,
        ),
        sampling=dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens),
    )


def _eval_models(
    names: list[str], *, run: str | None, data_root: Path, out: Path | None, options, sampling
) -> None:

    from selfplay.eval_report import row_cells, table_rows, write_eval_report
    from selfplay.evaluate import (
        EvalConfig,
        EvalError,
        ModelSpec,
        run_eval,
        run_models,
        save_result,
    )
    from selfplay.records import SamplingParams

    try:
        specs = [ModelSpec(label=n, model=n) for n in names]
        if run is not None:
            specs += run_models(run, data_root)
        out = out or (data_root / run / "eval" if run is not None else Path("data") / "eval")
        cfg = EvalConfig(
            models=tuple(specs), sampling=SamplingParams(**sampling), out=out, **options
        )
    except ValidationError as e:
        raise bad_option(e, rename={"label": "models", "model": "models"}) from None
    except EvalError as e:
        raise fail(str(e)) from None
    failed: EvalError | None = None
    try:
        result = run_eval(cfg)
    except EvalError as e:
        if e.result is None:
            raise fail(str(e)) from None
        failed, result = e, e.result
    json_path = save_result(result, out / "eval.json")
    files = write_eval_report(result, out)
    table = Table(title=f"eval: {cfg.num_scenarios} held-out scenarios (seats in eval.md)")
    for col in (
        "row",
        "games",
        "reward",
        "95% CI",
        "agree",
        "actions",
        "words",
        "invalid",
        "q/game",
    ):
        table.add_column(col, justify="left" if col == "row" else "right", overflow="fold")
    for r in table_rows(result):
        cells = row_cells(r)  # name, seats, games, reward [lo, hi], agreement, ...
        reward, _, ci = cells[3].partition(" ")
        ci = ci.replace(", ", ",")
        table.add_row(r.name, cells[2], reward, ci, *cells[4:])
    Console().print(table)
    if result.cross_play is not None:
        cp = result.cross_play
        for label in cp.models:
            gap = cp.gap[label]
            console.print(
                f"cross-play {label}: self {cp.self_play[label]:.3f}, gap "
                + ("–" if gap is None else f"{gap:+.3f}")
            )
    from selfplay.model_card import provenance

    for r in result.rows:
        origin = provenance(r.model) if r.kind == "model" and r.model else None
        if origin:
            console.print(f"{r.name}: {origin}")
    for msg in result.errors.values():
        console.print(f"[bold red]error:[/] {msg}")
    console.print(f"wrote {json_path}, " + ", ".join(str(p) for p in files.values()))
    if failed is not None:
        raise typer.Exit(1)


def _eval_scripted_pair(
    players: str, num_games: int, seed: int, table_size: int, max_actions: int, out: Path | None
) -> None:
    from selfplay.evaluate import evaluate_scripted
    from selfplay.players.scripted import SCRIPTED_NAMES

    names = tuple(p.strip() for p in players.split(","))
    if len(names) != 2 or any(n not in SCRIPTED_NAMES for n in names):
        raise fail(
            f"--players must be two of {', '.join(SCRIPTED_NAMES)} separated by a comma, "
            f"got {players!r}"
        )
    summary = evaluate_scripted(
        names, num_games=num_games, seed=seed, n=table_size, max_actions=max_actions
    )
    table = Table(title=f"{names[0]} (seat 1) + {names[1]} (seat 2), {num_games} games")
    for key in (
        "reward_mean",
        "reward_ci_low",
        "reward_ci_high",
        "agreement_rate",
        "mean_actions",
        "mean_words",
        "invalid_action_rate",
        "optimal_rate",
        "questions_per_game",
    ):
        table.add_row(key, f"{summary[key]:.4f}")
    table.add_row("outcomes", json.dumps(summary["outcomes"]))
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")


@app.command("train")
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
    epochs: int = typer.Option(1, help="Passes over the rows."),
    lr: LrOption = 1e-6,
    batch_size: BatchSizeOption = None,
    mini_batch_size: int | None = typer.Option(
        None, help="Rows per optimizer update (default: the batch size)."
    ),
    micro_batch_size: MicroBatchOption = 4,
    loss_agg: LossAggOption = "token-mean",
    std_norm: bool = typer.Option(True, "--std-norm/--no-std-norm", help="GRPO std division."),
    kl_coef: KlCoefOption = 0.0,
    rollout_is: str = typer.Option(
        "none", help="none: actor log-probs only; tis: truncated IS vs the rollout log-probs."
    ),
    gpus: int = typer.Option(0, help="GPUs per node (0: CPU, in-process)."),
    ray_address: str | None = typer.Option(None, help="Existing Ray cluster to run on."),
    nodes: int = typer.Option(1, help="Nodes of that Ray cluster."),
    seed: SeedOption = 0,
    resume_from: Path | None = typer.Option(None, help="verl checkpoint dir to resume from."),
    logger: LoggerOption = "",
) -> None:
    """Offline GRPO with verl on converted rows; writes a Hugging Face model directory."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from selfplay.models import resolve_model
    from selfplay.train import TrainConfig
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
    model = resolve_model(model)
    try:
        cfg = TrainConfig(
            data=data,
            model=model,
            out=out,
            epochs=epochs,
            lr=lr,
            batch_size=batch_size,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            loss_agg=loss_agg,
            std_norm=std_norm,
            kl_coef=kl_coef,
            rollout_is=rollout_is,
            gpus=gpus,
            ray_address=ray_address,
            nodes=nodes,
            seed=seed,
            resume_from=resume_from,
        )
    except ValidationError as e:
        raise bad_option(e) from None
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=None, info="loading")

        def show(m, total: int) -> None:
            info = (
                f"step {m.step}/{total} pg_loss {m.pg_loss:+.4f} grad {m.grad_norm:.3f} "
                f"clip {m.clip_frac:.3f} {m.tokens_per_s:.0f} tok/s"
            )
            progress.update(task, completed=m.step, total=total, info=info)

        result = _tracked(logger, cfg, "train", lambda step: run_training(cfg, step), show)
    console.print(f"model: {result.model_dir}  metrics: {result.metrics_path}")
    if result.checkpoint_dir is not None:
        console.print(f"verl checkpoint (resume with --resume-from): {result.checkpoint_dir}")


@app.command("sft")
def sft_cmd(
    out: Path = typer.Option(..., help="Output: the new HF model dir, metrics.json, sft_data/."),
    model: str | None = typer.Option(
        None, envvar="MODEL_NAME", help="Model to fine-tune (HF id or dir; default: embedded)."
    ),
    teacher: str | None = typer.Option(
        None, help="Clone a scripted policy: scripted:NAME (cooperative, no-talk, shy, random)."
    ),
    partner: str | None = typer.Option(
        None, help="teacher: the other seat's scripted policy when one seat is cloned."
    ),
    clone: str = typer.Option("both", help="teacher: the seats to clone: both, 1 or 2."),
    num_games: int = typer.Option(1000, min=1, help="teacher: games to play and clone."),
    table_size: TableSizeOption = 3,
    games: Path | None = typer.Option(
        None, help="Clone our own games: a games.jsonl (filtered by --min-reward)."
    ),
    min_reward: float = typer.Option(0.0, help="games: keep games with at least this reward."),
    human_data: Path | None = typer.Option(
        None,
        help="Clone both seats of the DialOp human games (optimization.jsonl, 8x8), replayed "
        "through our rules (rendering policy: selfplay.human).",
    ),
    epochs: int = typer.Option(1, min=1, help="Passes over the rows."),
    lr: LrOption = 1e-4,
    mini_batch_size: int = typer.Option(8, min=1, help="Rows per optimizer update."),
    micro_batch_size: MicroBatchOption = 4,
    dtype: str | None = typer.Option(
        None, help="Compute dtype: fp32 or bf16 (default: fp32 on CPU, bf16 on GPU)."
    ),
    max_length: MaxLengthOption = 4096,
    gpus: int = typer.Option(0, min=0, help="GPUs per node (0: CPU, in-process)."),
    seed: SeedOption = 0,
    logger: LoggerOption = "",
) -> None:
    """Behaviour cloning: fine-tune on token-exact teacher rows with verl's SFT loss."""
    from selfplay.models import resolve_model
    from selfplay.sft import SFTConfig, sft

    try:
        cfg = SFTConfig(
            model=resolve_model(model),
            out=out,
            teacher=teacher,
            partner=partner,
            clone=clone,
            num_games=num_games,
            table_size=table_size,
            games=games,
            min_reward=min_reward,
            human_data=human_data,
            epochs=epochs,
            lr=lr,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            dtype=dtype,
            max_length=max_length,
            gpus=gpus,
            seed=seed,
        )
    except ValidationError as e:
        raise bad_option(e) from None

    def show(m, total: int) -> None:
        console.print(
            f"sft update {m.step}/{total}: loss {m.loss:.4f} grad {m.grad_norm:.3f} "
            f"{m.tokens_per_s:.0f} tok/s"
        )

    result = _tracked(logger, cfg, "sft", lambda step: sft(cfg, step), show)
    console.print(f"{result.rows} rows {result.sources}; model: {result.model_dir}")


@app.command("generate")
def generate(
    num_games: int = typer.Option(200, envvar="NUM_GAMES", min=1, help="Games in total."),
    out: Path | None = typer.Option(
        None, help="Output folder (games.jsonl). Default: data/$EXP_NAME, else data/generate."
    ),
    model: str | None = typer.Option(
        None, envvar="MODEL_NAME", help="HF id or local dir. Default: embedded SmolLM2-135M."
    ),
    engine: EngineOption = "hf",
    engine_url: EngineUrlOption = None,
    health_timeout: HealthTimeoutOption = 900.0,
    temperature: TemperatureOption = 0.7,
    top_p: TopPOption = 1.0,
    max_new_tokens: MaxNewTokensOption = 256,
    max_actions: MaxActionsOption = 30,
    max_invalid: MaxInvalidOption = 3,
    seed: SeedOption = 0,
    round: int = typer.Option(0, "--round", min=0, help="Iteration round (part of every seed)."),
    concurrency: ConcurrencyOption = None,
    games_per_scenario: GamesPerScenarioOption = 4,
    table_size: TableSizeOption = 8,
    partner: PartnerOption = "self",
    policy_seat: PolicySeatOption = 1,
    partner_base_url: PartnerBaseUrlOption = None,
    partner_key_env: PartnerKeyEnvOption = "OPENAI_API_KEY",
    partner_max_calls: int | None = typer.Option(
        None,
        min=1,
        help="openai partner: paid calls in this run at most (cached answers are free).",
    ),
    device: str | None = typer.Option(None, help="hf: cpu, cuda, cuda:1 (default: cuda if any)."),
    max_batch_size: MaxBatchOption = 64,
    prefix_cache_tokens: PrefixCacheOption = None,
    sglang_python: SGLangPythonOption = "python",
    sglang_port: int = typer.Option(30000, help="sglang: port of the launched server."),
    tp_size: TpSizeOption = 1,
    mem_fraction: MemFractionOption = None,
    sglang_arg: list[str] = typer.Option(
        [], help="sglang: extra server flag, repeatable (--sglang-arg=--random-seed=1)."
    ),
) -> None:
    """Play games through an engine (self-play or against --partner); append each finished game
    to OUT/games.jsonl. An openai partner's key comes from $OPENAI_API_KEY (or --partner-key-env);
    its answers are cached in OUT/partner_cache.jsonl."""
    import signal

    from rich.console import Console as _Console

    from selfplay.engines import EngineFailure, SGLangEngineConfig
    from selfplay.generate_config import GenerateConfig
    from selfplay.models import resolve_model
    from selfplay.players.llm import TemplateError
    from selfplay.records import SamplingParams
    from selfplay.runner import OutputMismatch, RichProgress, run_generate, summary_table

    out = out or default_data_dir()
    if engine not in ("hf", "sglang"):
        raise fail(f"--engine must be hf or sglang, got {engine!r}")
    if engine_url and engine != "sglang":
        raise fail("--engine-url attaches to an SGLang server: add --engine sglang")
    try:
        model_path = resolve_model(model)
        sampling = SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens
        )
        cfg = GenerateConfig(
            out=out,
            num_games=num_games,
            model=model_path,
            games_per_scenario=games_per_scenario,
            concurrency=concurrency,
            seed=seed,
            round=round,
            table_size=table_size,
            max_actions=max_actions,
            max_invalid=max_invalid,
            sampling=sampling,
            partner=partner,
            policy_seat=policy_seat,
            partner_base_url=partner_base_url,
            partner_key_env=partner_key_env,
            partner_max_calls=partner_max_calls,
        )
        if engine == "hf":
            engine_cfg = _hf_engine(model_path, device, max_batch_size, prefix_cache_tokens)
        else:
            engine_cfg = SGLangEngineConfig(
                model=model_path,
                url=engine_url,
                startup_timeout_s=health_timeout,
                python=sglang_python,
                port=sglang_port,
                tp_size=tp_size,
                mem_fraction=mem_fraction,
                extra_args=tuple(sglang_arg),
                log_path=str(out / "sglang.log"),
            )
    except ValidationError as e:
        raise bad_option(e) from None
    except RuntimeError as e:
        raise fail(str(e)) from None

    def on_sigterm(signum, frame):  # stop like Ctrl-C, so the engine server is shut down
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = run_generate(cfg, engine_cfg, progress=RichProgress(console))
    except KeyboardInterrupt:
        console.print(
            f"[bold red]interrupted:[/] finished games are kept in {cfg.games_path}; "
            "re-run the same command to resume"
        )
        raise typer.Exit(130) from None
    except (EngineFailure, OutputMismatch, TemplateError, OSError, RuntimeError) as e:
        raise fail(str(e)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    _Console().print(summary_table(result))


@app.command("convert")
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
    group_by: str = typer.Option(
        "scenario",
        help="GRPO groups: scenario (all games of a scenario, both seats) or scenario-seat.",
    ),
    val_fraction: ValFractionOption = 0.0,
    max_length: MaxLengthOption = 4096,
    keep_degenerate: bool = typer.Option(
        False, "--keep-degenerate", help="Keep groups whose rewards are all equal (no signal)."
    ),
    validate_records: bool = typer.Option(
        False, "--validate", help="Fully validate every record (slower)."
    ),
) -> None:
    """Turn games into GRPO training rows: groups across games, split by scenario."""

    from selfplay.convert import ConvertConfig, ConvertError
    from selfplay.convert import convert as run_convert
    from selfplay.records import RecordError

    games = games or default_data_dir() / "games.jsonl"
    out = out or games.parent
    try:
        cfg = ConvertConfig(
            games=games,
            out=out,
            group_by=group_by,
            val_fraction=val_fraction,
            max_length=max_length,
            keep_degenerate=keep_degenerate,
            validate_records=validate_records,
        )
    except ValidationError as e:
        raise bad_option(e) from None
    try:
        s = run_convert(cfg)
    except (RecordError, ConvertError, OSError) as e:
        raise fail(str(e)) from None
    table = Table(title=f"convert {games}")
    table.add_column("")
    table.add_column("value", justify="right")
    rows = {
        "games read": s.games_read,
        "lines skipped": s.lines_skipped,
        "rows written (train / val)": f"{s.rows_written} ({s.rows_train} / {s.rows_val})",
        "groups written (train / val)": f"{s.groups_written} ({s.groups_train} / {s.groups_val})",
        "degenerate groups dropped": (
            f"{s.groups_degenerate_dropped} ({s.rows_in_degenerate_groups_dropped} rows)"
        ),
        "singleton groups dropped": s.groups_singleton_dropped,
        f"rows over {s.max_length} tokens dropped": s.rows_dropped_over_max_length,
        "rows without own tokens dropped": s.rows_dropped_no_own_tokens,
        "reward mean / std": f"{s.reward.mean:.4f} / {s.reward.std:.4f}",
        "tokens p50 / p90 / p99 / max": (
            f"{s.length_total.p50} / {s.length_total.p90} / {s.length_total.p99} / "
            f"{s.length_total.max}"
        ),
        "games/s": f"{s.games_per_second:.0f}",
    }
    for key, value in rows.items():
        table.add_row(key, str(value))
    Console().print(table)
    console.print(f"wrote {s.train_path}, {s.val_path}, {out / 'convert_summary.json'}")


@app.command("iterate")
def iterate_cmd(
    iterations: int = typer.Option(5, envvar="NUM_ITERATIONS", min=1, help="Rounds in total."),
    games_per_iter: int = typer.Option(
        200, envvar="GAMES_PER_ITER", min=2, help="Games generated per round."
    ),
    epochs_per_iter: int = typer.Option(
        1, envvar="EPOCHS_PER_ITER", min=1, help="Passes over a round's rows."
    ),
    model: str | None = typer.Option(
        None,
        envvar=["INITIAL_MODEL", "MODEL_NAME"],
        help="Initial model (HF id or dir). Default: embedded SmolLM2-135M-Instruct.",
    ),
    name: str = typer.Option(
        "selfplay", envvar="EXP_NAME", help="Run name: data/NAME, checkpoints/NAME."
    ),
    data_root: Path = typer.Option(Path("data"), help="Where data/NAME goes."),
    checkpoint_root: Path = typer.Option(Path("checkpoints"), help="Where checkpoints/NAME goes."),
    seed: SeedOption = 0,
    engine: EngineOption = "hf",
    engine_url: EngineUrlOption = None,
    health_timeout: HealthTimeoutOption = 900.0,
    device: str | None = typer.Option(None, help="hf: cpu, cuda, cuda:1."),
    max_batch_size: MaxBatchOption = 64,
    prefix_cache_tokens: PrefixCacheOption = None,
    sglang_python: SGLangPythonOption = "python",
    tp_size: TpSizeOption = 1,
    mem_fraction: MemFractionOption = None,
    temperature: TemperatureOption = 0.7,
    top_p: TopPOption = 1.0,
    max_new_tokens: MaxNewTokensOption = 256,
    max_actions: MaxActionsOption = 30,
    max_invalid: MaxInvalidOption = 3,
    games_per_scenario: GamesPerScenarioOption = 4,
    concurrency: ConcurrencyOption = None,
    table_size: TableSizeOption = 8,
    partner: PartnerOption = "self",
    policy_seat: PolicySeatOption = 1,
    partner_base_url: PartnerBaseUrlOption = None,
    partner_key_env: PartnerKeyEnvOption = "OPENAI_API_KEY",
    partner_max_calls: int | None = typer.Option(
        None, min=1, help="openai partner: paid calls per round at most (cached answers are free)."
    ),
    group_by: str = typer.Option("scenario", help="scenario or scenario-seat."),
    val_fraction: ValFractionOption = 0.0,
    max_length: MaxLengthOption = 4096,
    keep_degenerate: bool = typer.Option(
        False,
        help="Write groups whose rewards are all equal too (advantage 0: they add no gradient, "
        "and a round with nothing else still skips its update).",
    ),
    invalid_penalty: float = typer.Option(
        0.0,
        min=0.0,
        help="Reward -P (instead of 0) for the seat whose invalid actions ended a game; its "
        "partner keeps 0.",
    ),
    lr: LrOption = 1e-6,
    batch_size: BatchSizeOption = None,
    mini_batch_size: int | None = typer.Option(
        None, help="Rows per optimizer update (default: a round's rows / --updates-per-round)."
    ),
    updates_per_round: int = typer.Option(
        4, min=1, help="Optimizer updates per round when --mini-batch-size is not given."
    ),
    micro_batch_size: MicroBatchOption = 4,
    kl_coef: KlCoefOption = 0.0,
    entropy_coef: float = typer.Option(0.0, min=0.0, help="Entropy bonus in the GRPO loss."),
    loss_agg: LossAggOption = "token-mean",
    dtype: str | None = typer.Option(
        None, help="Training compute dtype: fp32 or bf16 (default: fp32 on CPU, bf16 on GPU)."
    ),
    gpus: int = typer.Option(0, help="Training GPUs per node (0: CPU)."),
    ray_address: str | None = typer.Option(
        None, help="Train on this Ray cluster (auto: the one this node joined); needs --gpus."
    ),
    nodes: int = typer.Option(1, min=1, help="Nodes of that Ray cluster to train on."),
    keep_checkpoints: str = typer.Option(
        "none",
        help="verl's checkpoint (weights + optimizer state, about 4x the model) of which rounds "
        "to keep: none, last or all. Each round's HF model is always kept; resume needs only it.",
    ),
    warm_start: str | None = typer.Option(
        None,
        help="Before round 0: scripted:NAME:GAMES (behaviour cloning of a scripted policy on "
        "GAMES games, e.g. scripted:cooperative:400) or a model dir to start from.",
    ),
    warm_start_lr: float = typer.Option(1e-4, help="Warm start: SFT learning rate."),
    warm_start_epochs: int = typer.Option(1, min=1, help="Warm start: passes over its rows."),
    warm_start_mini_batch_size: int = typer.Option(
        4, min=1, help="Warm start: rows per optimizer update."
    ),
    eval_scenarios: int = typer.Option(
        30, min=0, help="Held-out scenarios each round's model plays greedily (0: none)."
    ),
    eval_seed: int = typer.Option(7, min=0, help="Picks the held-out scenarios."),
    logger: LoggerOption = "",
    force: bool = typer.Option(False, help="Resume even though the options changed."),
    report: bool = typer.Option(True, help="Write the run report at the end."),
) -> None:
    """Generate, convert, train, repeat; resumes a killed run at its first unfinished stage."""

    from selfplay.convert import ConvertError
    from selfplay.engines import EngineFailure, SGLangEngineConfig
    from selfplay.iterate import IterateConfig, IterateError, TrainOptions, iterate
    from selfplay.locks import FolderBusy
    from selfplay.models import resolve_model
    from selfplay.records import RecordError, SamplingParams

    if engine_url and engine != "sglang":
        raise fail("--engine-url attaches to an SGLang server: add --engine sglang")
    try:
        initial = resolve_model(model)
        match engine:
            case "hf":
                engine_cfg = _hf_engine(initial, device, max_batch_size, prefix_cache_tokens)
            case "sglang":
                engine_cfg = SGLangEngineConfig(
                    model=initial,
                    url=engine_url,
                    startup_timeout_s=health_timeout,
                    python=sglang_python,
                    tp_size=tp_size,
                    mem_fraction=mem_fraction,
                )
            case _:
                raise fail(f"--engine must be hf or sglang, got {engine!r}")
        cfg = IterateConfig(
            name=name,
            iterations=iterations,
            model=initial,
            games_per_iter=games_per_iter,
            epochs_per_iter=epochs_per_iter,
            seed=seed,
            data_root=data_root,
            checkpoint_root=checkpoint_root,
            engine=engine_cfg,
            sampling=SamplingParams(
                temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens
            ),
            games_per_scenario=games_per_scenario,
            concurrency=concurrency,
            table_size=table_size,
            max_actions=max_actions,
            max_invalid=max_invalid,
            partner=partner,
            policy_seat=policy_seat,
            partner_base_url=partner_base_url,
            partner_key_env=partner_key_env,
            partner_max_calls=partner_max_calls,
            group_by=group_by,
            val_fraction=val_fraction,
            max_length=max_length,
            keep_degenerate=keep_degenerate,
            invalid_penalty=invalid_penalty,
            train=TrainOptions(
                lr=lr,
                batch_size=batch_size,
                mini_batch_size=mini_batch_size,
                updates_per_round=updates_per_round,
                micro_batch_size=micro_batch_size,
                kl_coef=kl_coef,
                entropy_coef=entropy_coef,
                loss_agg=loss_agg,
                dtype=dtype,
                gpus=gpus,
                ray_address=ray_address,
                nodes=nodes,
                keep_checkpoints=keep_checkpoints,
            ),
            warm_start=warm_start,
            warm_start_lr=warm_start_lr,
            warm_start_epochs=warm_start_epochs,
            warm_start_mini_batch_size=warm_start_mini_batch_size,
            eval_scenarios=eval_scenarios,
            eval_seed=eval_seed,
            loggers=tuple(x for x in logger.split(",") if x.strip()),
        )
    except ValidationError as e:
        raise bad_option(e) from None
    try:
        run = iterate(cfg, force=force)
    except KeyboardInterrupt:
        console.print(
            f"[bold red]interrupted:[/] finished stages are kept in {cfg.run_dir}; re-run the "
            "same command to resume"
        )
        raise typer.Exit(130) from None
    except (
        IterateError,
        ConvertError,
        RecordError,
        FileExistsError,
        EngineFailure,
        FolderBusy,
    ) as e:
        raise fail(str(e)) from None
    rounds = run.manifest.rounds.values()
    skipped = [r.stages["train"].skip_reason for r in rounds if r.stages["train"].skip_reason]
    held = run.manifest.heldout
    line = f"run {name}: {iterations} round(s), {iterations - len(skipped)} trained"
    if skipped:
        line += f", {len(skipped)} skipped ({'; '.join(sorted(set(skipped)))})"
    if held:
        first, last = held[min(held)], held[max(held)]
        initial = run.manifest.heldout_initial
        line += "; held-out reward " + (
            f"{initial.reward_mean:.3f} before the warm start, " if initial else ""
        )
        line += (
            f"{first.reward_mean:.3f} at round 0, {last.reward_mean:.3f} "
            f"[{last.reward_ci_low:.3f}, {last.reward_ci_high:.3f}] after {max(held)}"
        )
    console.print(f"{line}; manifest {run.path}")
    if report:
        from selfplay.report import write_report

        console.print(f"report: {write_report(cfg.run_dir)}")


@app.command("report")
def report_cmd(
    run: str = typer.Argument(..., help="Run name (data/RUN) or a run directory."),
    data_root: Path = typer.Option(Path("data"), help="Where data/RUN lives."),
    table_size: int | None = typer.Option(
        None, min=3, max=8, help="Table size of the scripted baselines (default: the run's own)."
    ),
) -> None:
    """Write PNG plots and REPORT.md for a run from its metrics.jsonl and manifest."""
    from selfplay.report import ReportError, write_report

    run_dir = Path(run) if Path(run).is_dir() else data_root / run
    try:
        out = write_report(run_dir, n=table_size)
    except ReportError as e:
        raise fail(str(e)) from None
    console.print(f"report: {out}")
