"""The CLI's options, made from the config fields (selfplay.options): every one has help, none is
cut at 80 columns, an option several commands share is declared once (the same help, default,
bounds and environment variable everywhere), and what the command line says reaches the config."""

from __future__ import annotations

from typing import Literal

import pytest
import typer
import typer.main
from pydantic import BaseModel, Field
from pydantic_core import PydanticUndefined
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.commands import train as train_commands
from selfplay.convert import ConvertOptions
from selfplay.engines import SGLangEngineConfig
from selfplay.generate.config import GenerateConfig
from selfplay.iterate.config import IterateConfig, TrainOptions
from selfplay.options import (
    EVAL,
    GENERATE,
    HF,
    ITERATE,
    SFT,
    SGLANG,
    TRAIN,
    VLLM,
    Fields,
    build,
    options,
)
from selfplay.records import SamplingParams

COMMANDS = typer.main.get_command(app).commands


def _options(command: str) -> dict:
    return {p.name: p for p in COMMANDS[command].params if p.param_type_name == "option"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help(command):
    missing = [n for n, p in _options(command).items() if not (p.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_at_80_columns_cuts_no_option_name(command):
    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0
    assert "…" not in res.output
    for p in _options(command).values():
        assert p.opts[0] in res.output


# Options whose name several commands use for different things.
PER_COMMAND = {"out", "model", "games", "data_root", "human_data"}
# (option, command): why that command's option differs from the other commands' of that name.
# eval's "own" play and engine options are EvalConfig's own fields; once it inherits PlayOptions
# (and takes the hf options from HFEngineConfig) they drop out of this list.
OWN = {
    ("games_per_scenario", "generate"): "accepts 1 (GenerateConfig: games for sft or eval)",
    ("games_per_scenario", "eval"): "1 by default: greedy games differ only when sampled",
    ("seed", "train"): "the update's seed",
    ("seed", "sft"): "the teacher games' seed",
    ("seed", "eval"): "picks the held-out scenarios",
    ("lr", "sft"): "a warm start's default, 1e-4",
    ("mini_batch_size", "sft"): "8 rows by default",
    ("table_size", "sft"): "3 by default: the teacher's quick tables",
    ("table_size", "report"): "the baselines' table size (default: the run's own)",
    ("concurrency", "eval"): "per row",
    ("device", "eval"): "only without --engine sglang",
    ("dtype", "generate"): "the hf engine's (iterate's sets the trainer's and the engine's)",
    ("max_batch_size", "eval"): "only without --engine sglang",
    ("num_games", "sft"): "teacher games",
    ("num_games", "eval"): "scripted pair mode",
    ("partner", "sft"): "the teacher's scripted partner",
    ("temperature", "eval"): "greedy by default, and no TEMPERATURE",
}


def _signature(p) -> tuple:
    envvar = (p.envvar,) if isinstance(p.envvar, str) else tuple(p.envvar or ())
    bounds = (getattr(p, "min", None), getattr(p, "max", None))
    default = tuple(p.default) if isinstance(p.default, list) else p.default
    return (p.help, default, bounds, envvar, tuple(p.opts + p.secondary_opts), p.is_flag)


_NAMES = [n for c in COMMANDS for n in _options(c)]
SHARED = sorted({n for n in _NAMES if _NAMES.count(n) > 1} - PER_COMMAND - {"help"})


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_option_is_the_same_everywhere(name):
    found = {c: _signature(_options(c)[name]) for c in COMMANDS if name in _options(c)}
    same = {c: s for c, s in found.items() if (name, c) not in OWN}
    assert len(set(same.values())) == 1, same
    common = next(iter(same.values()))
    for c in (c for c in found if (name, c) in OWN):  # each listed difference is real
        assert found[c] != common, f"--{name} of {c} is now the same: drop it from OWN"


def test_the_shared_options_are_many():
    # generate, iterate, train, sft, convert, eval and report share these, declared once each
    assert {"temperature", "top_p", "max_new_tokens", "table_size", "max_actions"} <= set(SHARED)
    assert {"lr", "micro_batch_size", "batch_size", "loss_agg", "val_fraction"} <= set(SHARED)
    assert {"tp_size", "health_timeout", "sglang_arg", "device", "prefix_cache_tokens"} <= set(
        SHARED
    )


SPECS = {
    "eval": [EVAL, SGLANG, VLLM],
    "generate": [GENERATE, HF, SGLANG, VLLM],
    "iterate": [ITERATE, HF, SGLANG, VLLM],
    "train": [TRAIN],
    "sft": [SFT],
    "convert": [Fields(ConvertOptions)],
}


@pytest.mark.parametrize("command", sorted(SPECS))
def test_an_option_has_its_fields_default_and_bounds(command):
    import annotated_types as at

    opts = _options(command)
    for spec in SPECS[command]:
        for path, f, default in spec.selected():
            p = opts[spec.name(path)]
            default = spec.override.get(path, {}).get("default", default)
            if default is PydanticUndefined:
                assert p.required, path
            else:
                default = getattr(default, "value", default)  # an Enum's value
                assert p.default == (list(default) if isinstance(default, tuple) else default)
            ge = next((m.ge for m in f.metadata if isinstance(m, at.Ge)), None)
            le = next((m.le for m in f.metadata if isinstance(m, at.Le)), None)
            open_bound = any(isinstance(m, at.Gt | at.Lt) for m in f.metadata)
            assert (p.min, p.max) == ((None, None) if open_bound else (ge, le)), path
            assert f.description in p.help, path


@pytest.mark.parametrize("command, accepted", [("generate", True), ("iterate", False)])
def test_groups_of_one_game_follow_the_config(command, accepted, monkeypatch):
    seen = _capture(monkeypatch)
    res = CliRunner().invoke(app, [command, "--model", "m", "--games-per-scenario", "1"])
    if accepted:  # GenerateConfig takes 1 (games for sft --games); GRPO rounds need 2
        assert seen["generate"].games_per_scenario == 1, res.output
    else:
        assert res.exit_code == 2 and "--games-per-scenario" in res.output
        assert IterateConfig.model_fields["games_per_scenario"].metadata[0].ge == 2


class _Stop(Exception):
    pass


def _capture(monkeypatch) -> dict:
    """Each command's config, caught where it would run."""
    seen: dict = {}

    def catch(name):
        def run(cfg, *rest, **_):
            seen[name], seen[name + "_rest"] = cfg, rest
            raise _Stop

        return run

    monkeypatch.setattr("selfplay.generate.runner.run_generate", catch("generate"))
    monkeypatch.setattr("selfplay.iterate.iterate", catch("iterate"))
    monkeypatch.setattr("selfplay.convert.convert", catch("convert"))
    monkeypatch.setattr(train_commands, "tracked", lambda logger, cfg, *a: catch("tracked")(cfg))
    return seen


def test_generate_options_reach_its_configs(monkeypatch, tmp_path):
    seen = _capture(monkeypatch)
    CliRunner().invoke(
        app,
        ["generate", "--model", "m", "--out", str(tmp_path), "--num-games", "3",
         "--temperature", "0.3", "--top-p", "0.5", "--max-new-tokens", "9", "--table-size", "4",
         "--max-actions", "7", "--max-invalid", "2", "--concurrency", "2", "--seed", "5",
         "--round", "1", "--device", "cpu", "--max-batch-size", "3",
         "--prefix-cache-tokens", "0"],
    )  # fmt: skip
    assert seen["generate"] == GenerateConfig(
        out=tmp_path, model="m", num_games=3, table_size=4, max_actions=7, max_invalid=2,
        concurrency=2, seed=5, round=1,
        sampling=SamplingParams(temperature=0.3, top_p=0.5, max_new_tokens=9),
    )  # fmt: skip
    (engine,) = seen["generate_rest"][:1]
    assert (engine.kind, engine.device, engine.max_batch_size) == ("hf", "cpu", 3)
    assert engine.prefix_cache_tokens == 0


def test_iterate_options_and_env_vars_reach_its_config(monkeypatch, tmp_path):
    seen = _capture(monkeypatch)
    env = {
        "NUM_ITERATIONS": "3", "GAMES_PER_ITER": "12", "EPOCHS_PER_ITER": "2", "EXP_NAME": "x",
        "INITIAL_MODEL": "m", "TEMPERATURE": "0.9", "MAX_LENGTH": "11", "TRAIN_BATCH_SIZE": "8",
        "MICRO_BATCH_SIZE": "2",
    }  # fmt: skip
    res = CliRunner().invoke(
        app,
        ["iterate", "--data-root", str(tmp_path), "--engine", "sglang",
         "--engine-url", "http://h:1", "--sglang-arg=--a=1", "--sglang-arg=--b", "--tp-size", "2",
         "--lr", "1e-5", "--no-std-norm", "--keep-checkpoints", "last", "--max-invalid", "5",
         "--group-by", "scenario-seat", "--val-fraction", "0.1", "--invalid-penalty", "0.5",
         "--warm-start-lr", "0.001", "--logger", "console", "--partner", "shy"],
        env=env,
    )  # fmt: skip
    cfg = seen["iterate"]
    assert cfg.model_dump() == IterateConfig(
        name="x", iterations=3, model="m", games_per_iter=12, epochs_per_iter=2,
        data_root=tmp_path, max_actions=11, max_invalid=5, partner="shy",
        sampling=SamplingParams(temperature=0.9), group_by="scenario-seat", val_fraction=0.1,
        invalid_penalty=0.5, warm_start_lr=0.001, loggers=("console",),
        engine=SGLangEngineConfig(
            model="m", url="http://h:1", extra_args=("--a=1", "--b"), tp_size=2
        ),
        train=TrainOptions(
            lr=1e-5, std_norm=False, keep_checkpoints="last", batch_size=8, micro_batch_size=2
        ),
    ).model_dump(), res.output  # fmt: skip


def test_sft_and_convert_options_reach_their_configs(monkeypatch, tmp_path):
    seen = _capture(monkeypatch)
    CliRunner().invoke(
        app,
        ["sft", "--model", "m", "--out", str(tmp_path), "--teacher", "cooperative",
         "--clone", "2", "--lr", "0.01", "--dtype", "bf16", "--max-length", "99"],
    )  # fmt: skip
    cfg = seen["tracked"]
    assert (cfg.clone, cfg.lr, cfg.dtype, cfg.max_length) == ("2", 0.01, "bf16", 99)
    assert cfg.table_size == 3  # sft's own default
    games = tmp_path / "games.jsonl"
    CliRunner().invoke(
        app, ["convert", "--games", str(games), "--keep-degenerate", "--max-length", "50"]
    )
    cfg = seen["convert"]
    assert (cfg.games, cfg.out, cfg.keep_degenerate, cfg.max_length) == (games, tmp_path, True, 50)


@pytest.mark.parametrize(
    "args, option, message",
    [
        (["convert", "--val-fraction", "1.5"], "--val-fraction", "less than 1"),
        (["generate", "--model", "m", "--top-p", "0"], "--top-p", "greater than 0"),
        (["train", "--model", "m", "--loss-agg", "mean"], "--loss-agg", "token-mean"),
        (["iterate", "--model", "m", "--ray-address", "auto"], "--ray-address", "--gpus"),
        (["iterate", "--model", "m", "--name", "a b"], "--name", "letters, digits"),
        (["sft", "--model", "m", "--out", "o", "--clone", "3"], "--clone", "'both', '1' or '2'"),
    ],
)
def test_a_bad_value_names_the_option(args, option, message, monkeypatch):
    _capture(monkeypatch)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output
    output = " ".join(res.output.split())
    assert f"error: {option}: " in output and message in output


def test_help_states_the_bounds_a_field_refuses():
    res = CliRunner().invoke(app, ["generate", "--help"])
    # 0 is refused, so the help does not allow it
    assert "--top-p <float> Nucleus sampling: keep the top tokens of this mass. [0.0<x<=1.0]" in (
        " ".join(res.output.split())
    )


def test_the_iterate_manifest_keeps_its_flat_keys():
    """Manifests store IterateConfig.model_dump(mode="json") and resume compares it: the option
    groups it is composed of must not change its keys."""
    cfg = IterateConfig(name="r", iterations=1, model="m", engine={"kind": "hf", "model": "m"})
    dump = cfg.model_dump(mode="json")
    assert set(dump) == {
        "name", "iterations", "model", "games_per_iter", "epochs_per_iter", "seed", "data_root",
        "checkpoint_root", "engine", "sampling", "games_per_scenario", "concurrency",
        "game", "table_size", "max_actions", "max_invalid", "partner", "policy_seat",
        "partner_base_url", "partner_key_env", "partner_max_calls", "group_by", "val_fraction",
        "max_length",
        "keep_degenerate", "invalid_penalty", "reward_shaping", "credit", "train", "warm_start",
        "warm_start_lr",
        "warm_start_epochs", "warm_start_mini_batch_size", "eval_scenarios", "eval_seed",
        "eval_initial", "eval_beside_generate", "loggers", "algorithm", "ei_top_k",
        "ei_min_reward", "ei_replay", "ei_above_mean",
        "ei_invalid_turns",
        "guide",
        "guide_games",
        "guide_when", "guide_rounds", "warm_start_partner", "test_scenarios", "partner_deadline",
    }  # fmt: skip
    assert set(dump["train"]) == {
        "lr", "batch_size", "mini_batch_size", "updates_per_round", "micro_batch_size",
        "loss_agg", "std_norm", "kl_coef", "entropy_coef", "dtype", "keep_checkpoints",
        "rollout_is", "gpus", "ray_address", "nodes", "guide_gamma", "old_log_probs",
        "policy_temperature", "lora_rank", "lora_alpha",
    }  # fmt: skip


# --- the adapter on its own ------------------------------------------------------------------


class _Inner(BaseModel):
    rate: float = Field(0.5, gt=0.0, le=1.0, description="A rate.")
    seed: int | None = None


class _Cfg(BaseModel):
    size: int = Field(3, ge=1, le=9, description="A size.", json_schema_extra={"envvar": "SIZE"})
    mode: Literal["a", "b"] = Field("a", description="The mode.")
    flag: bool = Field(False, description="A flag.")
    tags: tuple[str, ...] = Field((), description="Tags, repeatable.")
    inner: _Inner = _Inner(rate=0.25)
    bare: int = 0


SPEC = Fields(_Cfg, exclude=("bare", "inner.seed"))


def _app(*specs) -> typer.Typer:
    small = typer.Typer(rich_markup_mode=None)

    @small.command()
    @options(*specs)
    def main(**opts) -> None:
        print(repr(build(SPEC, opts)))

    return small


def test_the_adapter_builds_options_from_fields_and_the_config_from_options():
    small = _app(SPEC)
    res = CliRunner().invoke(small, ["--help"], terminal_width=200)
    assert "[env var: SIZE; default: 3; 1<=x<=9]" in res.output
    assert "The mode. One of: a, b." in res.output and "--flag / --no-flag" in res.output
    assert "A rate.  [0.0<x<=1.0]  [default: 0.25]" in res.output  # the parent's default
    res = CliRunner().invoke(small, ["--tags", "x", "--tags", "y", "--flag", "--rate", "1"])
    assert res.output.strip() == repr(
        _Cfg(flag=True, tags=("x", "y"), inner=_Inner(rate=1.0, seed=None))
    )
    assert CliRunner().invoke(small, ["--size", "10"]).exit_code == 2
    res = CliRunner().invoke(small, ["--mode", "c"])
    assert res.exit_code == 1 and "--mode" in str(res.exception)  # OptionError, caught by _App


def test_a_field_without_help_or_a_name_twice_is_refused_at_declaration():
    with pytest.raises(TypeError, match=r"_Cfg.bare is the option --bare but has no description"):
        _app(Fields(_Cfg, exclude=("inner.seed",)))
    with pytest.raises(TypeError, match="would both be --seed"):
        _app(Fields(IterateConfig, exclude=("engine",)))


def test_every_option_of_a_built_command_comes_from_one_place():
    # a command's own parameter would shadow a field's option: only CLI-only ones are its own
    own = {
        "generate": {"out", "model", "engine", "engine_url"},
        "iterate": {"config", "model", "engine", "engine_url", "logger", "force", "report",
                    "seeds"},
        "train": {"data", "model", "out", "logger"},
        "sft": {"model", "logger"},
        "convert": {"games", "out", "validate_records"},
        "eval": {"models", "run", "data_root", "num_scenarios", "baselines", "engine",
                 "engine_url", "human_data", "players", "num_games", "out"},
    }  # fmt: skip
    for command, specs in SPECS.items():
        derived = {s.name(path) for s in specs for path, _, _ in s.selected()}
        assert set(_options(command)) - derived == own[command], command
        assert not own[command] & derived, command


def test_top_help_lists_the_loop_in_its_order_with_whole_summaries():
    """`selfplay --help`: generate, convert, train, iterate first, then sft, eval, report, compare
    (any other after), each with its one-line summary whole at 80 columns."""
    res = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0
    listed = res.output.split("Commands:\n", 1)[1].splitlines()
    names = [line.split()[0] for line in listed if line.strip()]
    loop = ["generate", "convert", "train", "iterate", "sft", "eval", "report", "compare"]
    assert names[: len(loop)] == loop and len(names) == len(COMMANDS)
    for line in listed:
        name, summary = line.split(maxsplit=1)
        assert summary == COMMANDS[name].short_help and summary.endswith(".")
        assert "..." not in summary and "…" not in summary
